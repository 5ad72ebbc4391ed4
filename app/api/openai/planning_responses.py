"""A Responses API request as the chat completion it amounts to, planned by the chat path.

One planning path serves both APIs (checks, limits, tools, structured output); what a
refusal names is translated back into the Responses request's own fields.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ValidationError

from app.api.errors import APIError, invalid_request, validation_error
from app.api.openai.plan import GenerationPlan
from app.api.openai.planning import plan_chat
from app.api.openai.protocol import ChatCompletionRequest
from app.api.openai.protocol_responses import (
    FunctionCallInput,
    FunctionCallOutputInput,
    InputMessage,
    InputText,
    ResponsesRequest,
)
from app.api.state import AppState
from app.core.principal import Principal

# Chat fields -> the Responses fields they came from, for the errors a client sees.
_PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "tool_choice": "tool_choice",
}


def new_responses_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def plan_response(
    state: AppState, body: ResponsesRequest, principal: Principal
) -> GenerationPlan:
    if body.previous_response_id is not None:
        raise invalid_request(
            "'previous_response_id' is not supported: this server stores no responses. "
            "Send the whole conversation in 'input' instead.",
            param="previous_response_id", code="unsupported_parameter",
        )
    try:
        chat = ChatCompletionRequest.model_validate(chat_fields_of(body))
    except ValidationError as exc:
        raise _renamed(validation_error(exc.errors())) from exc
    try:
        return plan_chat(state, chat, principal, response_id=new_responses_id())
    except APIError as exc:
        raise _renamed(exc) from exc


def chat_fields_of(body: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request `body` amounts to (as JSON-ready fields)."""
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "user": body.user,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools is not None:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = (
            choice if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    text_format = None if body.text is None else body.text.format
    if text_format is not None and text_format.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name or "response",
            "description": text_format.description,
            "schema": text_format.json_schema,
            "strict": text_format.strict,
        }}
    elif text_format is not None:
        fields["response_format"] = {"type": text_format.type}
    return {name: value for name, value in fields.items() if value is not None}


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            # Consecutive calls are one assistant turn that called several tools.
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            assert isinstance(item, FunctionCallOutputInput)
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
    return messages


def _renamed(exc: APIError) -> APIError:
    """`exc` as the Responses request's fields name it."""
    param = exc.param
    if param is None:
        return exc
    head, dot, rest = param.partition(".")
    head, _, index = head.partition("[")
    renamed = _PARAMS.get(head)
    if renamed is None:
        return exc
    new_param = renamed + (f"[{index}" if index else "") + dot + rest
    exc.param = new_param
    exc.message = exc.message.replace(f"'{head}'", f"'{renamed}'")
    return exc
