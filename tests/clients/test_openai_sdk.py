"""The `openai` SDK's own helpers against the server: `chat.completions.parse` with a
pydantic model (strict json_schema), JSON mode, a tool-call round trip streamed and not,
and a Responses API function call answered with `function_call_output`."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from tests.clients.conftest import ClientService
from tests.clients.schemas import (
    JSON_PROMPTS,
    WEATHER_PARAMETERS,
    WEATHER_QUESTION,
    WEATHER_TOOL,
    Person,
    weather_report,
)

pytestmark = pytest.mark.timeout(60)

MAX_TOKENS = 300
TOOLS: list[Any] = [WEATHER_TOOL]


def test_parse_returns_the_nested_pydantic_model(service: ClientService) -> None:
    completion = service.openai().chat.completions.parse(
        model=service.model, messages=[{"role": "user", "content": "Who lives here?"}],
        response_format=Person, max_completion_tokens=MAX_TOKENS, temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    parsed = choice.message.parsed
    assert isinstance(parsed, Person)
    assert Person.model_validate_json(choice.message.content or "") == parsed


def test_json_mode_answers_json_objects(service: ClientService) -> None:
    # NOTE: any JSON object is allowed, and a random model almost never closes a string
    # it opens: only the answers whose greedy path closes the object before that end.
    # Each prompt is its own greedy path; some of them end, and every one is a JSON
    # object or the start of one, cut by max_completion_tokens.
    def answer(prompt: str) -> tuple[str, str]:
        completion = service.openai().chat.completions.create(
            model=service.model, messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_object"}, max_completion_tokens=64,
            temperature=0,
        )
        choice = completion.choices[0]
        return choice.finish_reason, choice.message.content or ""

    with ThreadPoolExecutor(len(JSON_PROMPTS)) as pool:
        answers = list(pool.map(answer, JSON_PROMPTS))
    ended = [text for finish, text in answers if finish == "stop"]
    assert ended, answers
    for text in ended:
        assert isinstance(json.loads(text), dict), text
    for finish, text in answers:
        assert finish in ("stop", "length") and text.lstrip().startswith("{"), text


def _streamed_call(service: ClientService, messages: list[Any]) -> dict[str, Any]:
    """The assistant message of a streamed `required` call, from the tool-call deltas
    accumulated by index as the SDK's documentation shows."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    stream = service.openai().chat.completions.create(
        model=service.model, messages=messages, tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, max_completion_tokens=MAX_TOKENS,
        temperature=0, stream=True,
    )
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["function"]["name"] += delta.function.name or ""
                    call["function"]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    return {"role": "assistant", "content": None, "tool_calls": [calls[i] for i in sorted(calls)]}


def _call(service: ClientService, messages: list[Any]) -> dict[str, Any]:
    completion = service.openai().chat.completions.create(
        model=service.model, messages=messages, tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, max_completion_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    return choice.message.model_dump(exclude_none=True)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_round_trip(service: ClientService, stream: bool) -> None:
    messages: list[Any] = [{"role": "user", "content": WEATHER_QUESTION}]
    assistant = _streamed_call(service, messages) if stream else _call(service, messages)
    (call,) = assistant["tool_calls"]
    assert call["id"] and call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    messages += [assistant, {"role": "tool", "tool_call_id": call["id"],
                             "content": weather_report(**arguments)}]
    answer = service.openai().chat.completions.create(
        model=service.model, messages=messages, tools=TOOLS,
        max_completion_tokens=24, temperature=0,
    )
    message = answer.choices[0].message
    assert not message.tool_calls
    assert message.content
    assert answer.usage is not None and answer.usage.prompt_tokens > 0


def test_parallel_calls_each_validate(service: ClientService) -> None:
    # `required` with parallel calls allowed (the default): one call or more, each
    # valid; a random model may go on calling until max_completion_tokens cuts it.
    completion = service.openai().chat.completions.create(
        model=service.model, messages=[{"role": "user", "content": WEATHER_QUESTION}],
        tools=TOOLS, tool_choice="required", max_completion_tokens=MAX_TOKENS, temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    calls = choice.message.tool_calls or []
    assert calls
    assert len({call.id for call in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_the_stream_helper_parses_the_call(service: ClientService) -> None:
    with service.openai().chat.completions.stream(
        model=service.model, messages=[{"role": "user", "content": WEATHER_QUESTION}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_completion_tokens=MAX_TOKENS, temperature=0,
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    jsonschema.validate(call.function.parsed_arguments, WEATHER_PARAMETERS)
    assert [(e.name, e.parsed_arguments) for e in done] == [
        ("get_weather", call.function.parsed_arguments)
    ]


def test_a_responses_function_call_round_trip(service: ClientService) -> None:
    client = service.openai()
    function = WEATHER_TOOL["function"]
    tools: list[Any] = [{"type": "function", **function}]
    first = client.responses.create(
        model=service.model, instructions="Use the tools.", input=WEATHER_QUESTION,
        tools=tools, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=MAX_TOKENS, temperature=0,
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    second = client.responses.create(
        model=service.model, instructions="Use the tools.", tools=tools,
        input=[{"role": "user", "content": WEATHER_QUESTION}, call,  # type: ignore[list-item]
               {"type": "function_call_output", "call_id": call.call_id,
                "output": weather_report(**arguments)}],
        max_output_tokens=24, temperature=0,
    )
    assert second.output_text
    assert [item.type for item in second.output] == ["message"]
    assert first.usage is not None and second.usage is not None
    # The call and its result are part of the prompt.
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_tool_message_without_a_call_is_a_400(service: ClientService) -> None:
    import openai

    for messages in (
        [{"role": "user", "content": WEATHER_QUESTION},
         {"role": "tool", "tool_call_id": "call_0", "content": "18 C"}],
        [{"role": "user", "content": WEATHER_QUESTION},
         {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "call_0", "content": "18 C"}],
    ):
        with pytest.raises(openai.BadRequestError) as info:
            service.openai().chat.completions.create(
                model=service.model, messages=messages, tools=TOOLS, max_completion_tokens=8,
            )
        assert info.value.status_code == 400
        assert isinstance(info.value.body, dict)
        assert info.value.body["param"] in ("messages[1].role", "messages[2].tool_call_id")
    # The Responses API: an output for a call the input never made.
    with pytest.raises(openai.BadRequestError) as info:
        service.openai().responses.create(
            model=service.model, max_output_tokens=8, tools=[{
                "type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}],
            input=[{"role": "user", "content": WEATHER_QUESTION},
                   {"type": "function_call_output", "call_id": "call_0", "output": "18 C"}],
        )
    assert info.value.status_code == 400
