"""Chat histories with tools, tool calls and tool results rendered by real chat templates:
SmolLM2's own (no tools: the fallback prompt) and a Hermes-style template that knows tools,
in the manner of Qwen2.5's and Qwen3's, on a tokenizer built from the SmolLM2 files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.api.errors import APIError
from app.api.openai.protocol import ChatMessage, ChatTool, NamedToolChoice
from app.api.openai.tool_calls import parse_tool_calls
from app.api.openai.tool_prompt import (
    TOOLS_PROMPT,
    ChatPrompt,
    call_block,
    chat_template_messages,
    template_uses_tools,
    tools_prompt,
)
from app.api.openai.tools import NO_TOOLS, tool_plan
from engine.models.loader import load_tokenizer

# A template in the Hermes style Qwen2.5 and Qwen3 use: tools listed in the system turn,
# calls as <tool_call> blocks in the assistant turn, results as user turns in
# <tool_response> tags.
HERMES_TEMPLATE = """\
{%- if tools %}{{ '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\nCall functions to help. Their signatures:\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools>\\n\\nReply with each call as:\\n<tool_call>\\n'
    + '{"name": <name>, "arguments": <arguments>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{ '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- elif message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{%- if message.content or not loop.first %}{{ '\\n' }}{% endif %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": '
    + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}{{ '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content
    + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def hermes(smollm2_dir: Path) -> Any:
    tokenizer = load_tokenizer(smollm2_dir)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def render(tokenizer: Any, prompt: ChatPrompt) -> str:
    text = tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools,
                                         add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    return text


WEATHER = ChatTool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}, "strict": True}})
CLOCK = ChatTool.model_validate({"type": "function", "function": {"name": "now"}})
TOOLS = [WEATHER, CLOCK]

HISTORY = [
    ChatMessage(role="developer", content="Be brief."),
    ChatMessage(role="user", content="Weather in Paris and Zürich, and the time?"),
    ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Zürich"}'}},
        {"id": "call_3", "type": "function", "function": {"name": "now", "arguments": ""}},
    ]}),
    ChatMessage(role="tool", tool_call_id="call_1", content="18 C, sunny"),
    ChatMessage.model_validate({"role": "tool", "tool_call_id": "call_2", "content": [
        {"type": "text", "text": "9 C"}, {"type": "text", "text": "rain"}]}),
    ChatMessage(role="tool", tool_call_id="call_3", content="12:00"),
    ChatMessage.model_validate({
        "role": "assistant", "content": "Paris 18 C; checking once more.", "tool_calls": [
            {"id": "call_4", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}),
    ChatMessage(role="tool", tool_call_id="call_4", content="19 C"),
    ChatMessage(role="user", content="Thanks!"),
]


def test_template_detection(smol: Any) -> None:
    assert not template_uses_tools(smol.chat_template)
    assert template_uses_tools(HERMES_TEMPLATE)
    assert not template_uses_tools(None) and not template_uses_tools("{% if %}")
    assert not template_uses_tools("{% set tools = [] %}{{ tools }}")  # its own variable


def test_fallback_prompt_on_the_smollm2_template(smol: Any) -> None:
    plan = tool_plan(TOOLS, "auto")
    prompt = chat_template_messages(HISTORY, plan, template_has_tools=False)
    assert prompt.tools is None
    assert len(prompt.messages) == len(HISTORY)  # nothing dropped, nothing added
    text = render(smol, prompt)
    # The tools are explained in the caller's system message, after its own text.
    system = prompt.messages[0]
    assert system["role"] == "system"
    assert system["content"] == "Be brief.\n\n" + tools_prompt(plan)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "You are a helpful AI assistant named SmolLM" not in text
    for chat_tool in TOOLS:
        line = json.dumps({"type": "function", "function": {
            k: v for k, v in chat_tool.function.model_dump().items()
            if k != "strict" and v is not None}}, ensure_ascii=False)
        if chat_tool.function.parameters is None:
            line = line[:-2] + ', "parameters": {"type": "object", "properties": {}}}}'
        assert line in text
    # Past calls in the format the model is asked to write; results as tool turns.
    assert ("<|im_start|>assistant\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
            "</tool_call>\n"
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>') in text
    assert ('<|im_start|>tool\n<tool_response name="get_weather">\n18 C, sunny\n'
            "</tool_response><|im_end|>") in text
    assert '<tool_response name="get_weather">\n9 C\nrain\n</tool_response>' in text
    assert '<tool_response name="now">\n12:00\n</tool_response>' in text
    assert ("<|im_start|>assistant\nParis 18 C; checking once more.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') in text
    assert ('<|im_start|>tool\n<tool_response name="get_weather">\n19 C\n'
            "</tool_response><|im_end|>") in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")


def test_fallback_history_round_trips_through_the_parser() -> None:
    prompt = chat_template_messages(HISTORY, tool_plan(TOOLS, "auto"), template_has_tools=False)
    assistant = [m for m in prompt.messages if m["role"] == "assistant"]
    content, calls = parse_tool_calls(assistant[0]["content"], {"get_weather", "now"})
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich"}), ("now", {})]
    content, calls = parse_tool_calls(assistant[1]["content"], {"get_weather", "now"})
    assert content == "Paris 18 C; checking once more." and len(calls) == 1


def test_fallback_without_a_system_message_adds_one(smol: Any) -> None:
    messages = [ChatMessage(role="user", content="Time?")]
    plan = tool_plan(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "now"}}))
    prompt = chat_template_messages(messages, plan, template_has_tools=False)
    assert [m["role"] for m in prompt.messages] == ["system", "user"]
    assert prompt.messages[0]["content"].endswith("Now call the function `now`.")
    text = render(smol, prompt)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    required = tools_prompt(tool_plan(TOOLS, "required", False))
    assert required.endswith("Now call at least one of the functions.\n\n"
                             "Call at most one function at a time.")
    assert tools_prompt(tool_plan(TOOLS, "auto")).endswith("answer in plain text.")


def test_tool_choice_none_hides_the_tools_but_keeps_the_history(smol: Any,
                                                                hermes: Any) -> None:
    plan = tool_plan(TOOLS, "none")
    assert plan == NO_TOOLS
    plain = chat_template_messages(HISTORY, plan, template_has_tools=False)
    assert plain.messages[0] == {"role": "system", "content": "Be brief."}
    text = render(smol, plain)
    assert "# Tools" not in text and text.count("<tool_call>") == 4
    assert text.count("<tool_response") == 4
    aware = chat_template_messages(HISTORY, plan, template_has_tools=True)
    assert aware.tools is None
    text = render(hermes, aware)
    assert "<tools>" not in text and text.count("<tool_call>") == 4


def test_tools_aware_template_gets_hugging_face_shapes(hermes: Any) -> None:
    prompt = chat_template_messages(HISTORY, tool_plan(TOOLS, "auto"), template_has_tools=True)
    assert prompt.tools == [
        {"type": "function", "function": {
            "name": "get_weather", "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "now", "parameters": {"type": "object", "properties": {}}}},
    ]
    assert len(prompt.messages) == len(HISTORY)
    assert prompt.messages[0] == {"role": "system", "content": "Be brief."}
    calls = prompt.messages[2]
    assert calls["role"] == "assistant" and calls["content"] == ""
    assert calls["tool_calls"][0] == {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}
    assert calls["tool_calls"][2]["function"]["arguments"] == {}
    assert prompt.messages[3] == {"role": "tool", "content": "18 C, sunny",
                                  "tool_call_id": "call_1", "name": "get_weather"}
    assert prompt.messages[4]["content"] == "9 C\nrain"
    assert prompt.messages[7] == {"role": "tool", "content": "19 C",
                                  "tool_call_id": "call_4", "name": "get_weather"}

    text = render(hermes, prompt)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "get_weather", "description": "Current weather in a city."' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Zürich"}}\n</tool_call>\n<tool_call>\n{"name": "now", '
            '"arguments": {}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n19 C\n</tool_response><|im_end|>" in text
    assert ("<|im_start|>assistant\nParis 18 C; checking once more.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    # The template's blocks read back as the calls they render.
    block = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, parsed = parse_tool_calls(block, {"get_weather", "now"})
    assert [c.function.arguments for c in parsed] == ['{"city":"Paris"}', '{"city":"Zürich"}',
                                                     "{}"]


def test_call_block_is_the_format_of_the_prompt() -> None:
    assert call_block("f", {"a": [1, "é"]}) == \
        '<tool_call>\n{"name": "f", "arguments": {"a": [1, "é"]}}\n</tool_call>'
    assert '{{"name": "<function name>"' in TOOLS_PROMPT  # a format field, escaped


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", '"text"', "{"])
def test_history_calls_need_object_arguments(arguments: str) -> None:
    messages = [ChatMessage.model_validate({"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        {"id": "d", "type": "function", "function": {"name": "now", "arguments": arguments}},
    ]})]
    for aware in (True, False):
        with pytest.raises(APIError) as info:
            chat_template_messages(messages, NO_TOOLS, template_has_tools=aware)
        assert info.value.status_code == 400
        assert info.value.param == "messages[0].tool_calls[1].function.arguments"


def test_non_text_parts_are_refused() -> None:
    messages = [ChatMessage.model_validate({"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url"}]})]
    with pytest.raises(APIError) as info:
        chat_template_messages(messages, NO_TOOLS, template_has_tools=False)
    assert info.value.param == "messages[0].content[1]"


def _call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "now", "arguments": "{}"}}


@pytest.mark.parametrize(("messages", "param", "message"), [
    # No assistant turn called a tool.
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c", "content": "x"}],
     "messages[1].role", "must be a response to a preceding message with 'tool_calls'"),
    ([{"role": "tool", "tool_call_id": "c", "content": "x"}],
     "messages[0].role", "must be a response to a preceding message with 'tool_calls'"),
    # The turn before it is a user's, though an earlier assistant turn called the tool.
    ([{"role": "assistant", "tool_calls": [_call("c")]},
      {"role": "tool", "tool_call_id": "c", "content": "x"},
      {"role": "user", "content": "and?"},
      {"role": "tool", "tool_call_id": "c", "content": "x"}],
     "messages[3].role", "must be a response to a preceding message with 'tool_calls'"),
    # An assistant turn without calls.
    ([{"role": "assistant", "content": "sure"},
      {"role": "tool", "tool_call_id": "c", "content": "x"}],
     "messages[1].role", "must be a response to a preceding message with 'tool_calls'"),
    ([{"role": "assistant", "tool_calls": [_call("c")]}, {"role": "tool", "content": "x"}],
     "messages[1].tool_call_id", "Missing required parameter: 'messages[1].tool_call_id'"),
    ([{"role": "assistant", "tool_calls": [_call("c"), _call("d")]},
      {"role": "tool", "tool_call_id": "d", "content": "x"},
      {"role": "tool", "tool_call_id": "e", "content": "x"}],
     "messages[2].tool_call_id", "'tool_call_id' of 'e' is not one of the 'tool_calls'"),
])
def test_a_tool_turn_must_answer_the_calls_before_it(
    messages: list[dict[str, Any]], param: str, message: str
) -> None:
    parsed = [ChatMessage.model_validate(m) for m in messages]
    for aware in (True, False):
        with pytest.raises(APIError) as info:
            chat_template_messages(parsed, NO_TOOLS, template_has_tools=aware)
        assert info.value.status_code == 400
        assert info.value.param == param
        assert message in info.value.message


def test_several_tool_turns_answer_one_assistant_turn() -> None:
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "assistant", "tool_calls": [_call("c"), _call("d")]},
        {"role": "tool", "tool_call_id": "d", "content": "x"},
        {"role": "tool", "tool_call_id": "c", "content": "y"},
        {"role": "assistant", "tool_calls": [_call("e")]},
        {"role": "tool", "tool_call_id": "e", "content": "z"},
    ]]
    prompt = chat_template_messages(messages, NO_TOOLS, template_has_tools=True)
    assert [m.get("tool_call_id") for m in prompt.messages] == [None, "d", "c", None, "e"]
    assert all(m["name"] == "now" for m in prompt.messages if m["role"] == "tool")
