"""Chat messages, tools and tool calls as a chat template takes them.

`chat_template_messages` gives what `tokenizer.apply_chat_template(messages, tools=tools,
add_generation_prompt=True)` is called with. Two cases:

- the template knows tools (it reads the `tools` variable, as Qwen2.5's and Qwen3's
  do): the tools go to it in Hugging Face's shape, assistant turns keep their
  `tool_calls` (arguments parsed to objects) and tool turns their `tool_call_id` and
  function `name`; the template writes them in the model's own format;
- it does not (SmolLM2's prints every message as `<|im_start|>{role}\\n{content}`): the
  tools are described in the system message (`TOOLS_PROMPT`), past calls are written
  into the assistant's content in the format the model is asked to use, and tool results
  become `tool` turns wrapped in `<tool_response>` tags.

No message is dropped in either case, whatever `tool_choice` says: `none` only hides the
tools.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from app.api.errors import invalid_request
from app.api.openai.protocol import ChatMessage, FunctionDefinition, ToolCall
from app.api.openai.tools import CALL_CLOSE, CALL_OPEN, ToolPlan

TOOLS_PROMPT = """\
# Tools

You may call one or more functions to help with the user's request. The functions are \
listed below, one JSON object each, with their parameters as a JSON schema:
<tools>
{tools}
</tools>

To call a function, write a block like this one, on its own lines:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments, a JSON object>}}
</tool_call>
Write one block per call and nothing after the last block. Each result comes back in a \
tool message, as <tool_response name="<function name>">...</tool_response>. When no \
function is needed, answer in plain text.{choice}"""
"""The system text that teaches tool calling to a model whose chat template does not.

`{tools}` is one line per function: `{"type": "function", "function": {"name": ...,
"description": ..., "parameters": ...}}`; `{choice}` is empty for `tool_choice: auto`
and otherwise one of `TOOL_CHOICE_LINES`. It is appended to the caller's first system
message (after a blank line), or is the system message when the caller sent none. The
call format it asks for is the one templates like Qwen's teach, so that one parser
reads both: a JSON object with `name` then `arguments` between `<tool_call>` and
`</tool_call>` lines, several blocks separated by a newline."""

TOOL_CHOICE_LINES = {
    "required": "\n\nNow call at least one of the functions.",
    "named": "\n\nNow call the function `{name}`.",
    "single": "\n\nCall at most one function at a time.",
}

TOOL_RESPONSE = '<tool_response name="{name}">\n{content}\n</tool_response>'
"""A tool message's content as the fallback prompt shows it."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """The arguments of `apply_chat_template`: `messages`, and `tools` (None: no tools
    shown)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def template_uses_tools(template: str | None) -> bool:
    """Whether a Jinja chat template reads the `tools` variable (Hugging Face passes the
    tools to it under that name)."""
    if not template:
        return False
    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def chat_template_messages(messages: Sequence[ChatMessage], plan: ToolPlan, *,
                           template_has_tools: bool) -> ChatPrompt:
    """`messages` and the plan's tools as the chat template takes them (see the module's
    docstring). A message the template cannot show (a non-text content part, a tool
    call whose arguments are not a JSON object) is refused with a 400, as is a tool turn
    that answers no call of the assistant turn before it."""
    check_tool_turns(messages)
    names = _call_names(messages)
    if template_has_tools:
        out = [_hf_message(i, m, names) for i, m in enumerate(messages)]
        tools = [hf_tool(f) for f in plan.functions] or None
        return ChatPrompt(out, tools)
    out = [_plain_message(i, m, names) for i, m in enumerate(messages)]
    if plan.functions:
        prompt = tools_prompt(plan)
        first_system = next((m for m in out if m["role"] == "system"), None)
        if first_system is None:
            out.insert(0, {"role": "system", "content": prompt})
        elif first_system["content"]:
            first_system["content"] = f"{first_system['content']}\n\n{prompt}"
        else:
            first_system["content"] = prompt
    return ChatPrompt(out, None)


def tools_prompt(plan: ToolPlan) -> str:
    """`TOOLS_PROMPT` for the plan's functions and choice."""
    lines = "\n".join(json.dumps(hf_tool(f), ensure_ascii=False) for f in plan.functions)
    if plan.mode == "named":
        choice = TOOL_CHOICE_LINES["named"].format(name=plan.named)
    elif plan.mode == "required":
        choice = TOOL_CHOICE_LINES["required"]
    else:
        choice = ""
    if not plan.parallel and plan.mode != "named":
        choice += TOOL_CHOICE_LINES["single"]
    return TOOLS_PROMPT.format(tools=lines, choice=choice)


def hf_tool(function: FunctionDefinition) -> dict[str, Any]:
    """A function as Hugging Face's templates take it (OpenAI's shape, without `strict`
    and without empty fields)."""
    body: dict[str, Any] = {"name": function.name}
    if function.description:
        body["description"] = function.description
    body["parameters"] = function.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": body}


def call_block(name: str, arguments: dict[str, Any]) -> str:
    """One call in the format models are asked to write."""
    document = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{document}\n{CALL_CLOSE}"


# ------------------------------------------------------------------ messages


def _text(index: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid_request(
                f"Only text content parts are supported, got type '{part.type}'.",
                param=f"messages[{index}].content[{j}]",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _role(message: ChatMessage) -> str:
    # "developer" is OpenAI's newer name for the system role.
    return "system" if message.role == "developer" else message.role


def check_tool_turns(messages: Sequence[ChatMessage]) -> None:
    """As OpenAI checks a conversation: every `tool` message answers, by its
    `tool_call_id`, a call of the assistant turn that precedes it (other tool messages
    may come between). Refused with a 400 naming the message."""
    calls: set[str] | None = None  # the ids the latest assistant turn called; None: none
    for index, message in enumerate(messages):
        if message.role != "tool":
            calls = ({call.id for call in message.tool_calls}
                     if message.role == "assistant" and message.tool_calls else None)
            continue
        if calls is None:
            raise invalid_request(
                "Messages with role 'tool' must be a response to a preceding message with "
                "'tool_calls'.", param=f"messages[{index}].role",
            )
        if message.tool_call_id is None:
            raise invalid_request(
                f"Missing required parameter: 'messages[{index}].tool_call_id'.",
                param=f"messages[{index}].tool_call_id", code="missing_required_parameter",
            )
        if message.tool_call_id not in calls:
            raise invalid_request(
                f"'tool_call_id' of '{message.tool_call_id}' is not one of the 'tool_calls' "
                "of the preceding assistant message.",
                param=f"messages[{index}].tool_call_id",
            )


def _call_names(messages: Sequence[ChatMessage]) -> dict[str, str]:
    """Call id -> function name, from the history's assistant turns."""
    return {call.id: call.function.name for m in messages for call in m.tool_calls or ()}


def _arguments(index: int, j: int, call: ToolCall) -> dict[str, Any]:
    text = call.function.arguments
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise invalid_request(
            "The arguments of a tool call must be a JSON object.",
            param=f"messages[{index}].tool_calls[{j}].function.arguments",
        )
    return value


def _hf_message(index: int, message: ChatMessage, names: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(message), "content": _text(index, message)}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name,
                          "arguments": _arguments(index, j, call)}}
            for j, call in enumerate(message.tool_calls)
        ]
    if message.role == "tool":
        assert message.tool_call_id is not None  # check_tool_turns
        out["tool_call_id"] = message.tool_call_id
        out["name"] = message.name or names[message.tool_call_id]
    elif message.name:
        out["name"] = message.name
    return out


def _plain_message(index: int, message: ChatMessage, names: dict[str, str]) -> dict[str, Any]:
    content = _text(index, message)
    if message.tool_calls:
        blocks = [call_block(call.function.name, _arguments(index, j, call))
                  for j, call in enumerate(message.tool_calls)]
        content = "\n".join([content, *blocks] if content else blocks)
    if message.role == "tool":
        assert message.tool_call_id is not None  # check_tool_turns
        name = message.name or names[message.tool_call_id]
        content = TOOL_RESPONSE.format(name=name, content=content)
    return {"role": _role(message), "content": content}
