"""LangChain's `ChatOpenAI` against the server: `with_structured_output` by each of its
methods, and a `bind_tools` loop (model -> ToolMessage -> model) that ends in an answer."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.clients.conftest import ClientService
from tests.clients.schemas import (
    JSON_PROMPTS,
    WEATHER_PARAMETERS,
    WEATHER_QUESTION,
    Person,
    SearchFilter,
    WeatherArguments,
    weather_report,
)

pytestmark = pytest.mark.timeout(60)


def _chat(service: ClientService, max_tokens: int = 300) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=service.api_base, api_key=service.key,  # type: ignore[arg-type]
        model=service.model, temperature=0, max_tokens=max_tokens,  # type: ignore[call-arg]
        max_retries=0,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_validates(service: ClientService, method: Any) -> None:
    structured = _chat(service).with_structured_output(Person, method=method, include_raw=True)
    result: Any = structured.invoke([HumanMessage("Who lives here?")])
    assert result["parsing_error"] is None
    parsed = result["parsed"]
    assert isinstance(parsed, Person)
    raw: AIMessage = result["raw"]
    if method == "json_schema":
        assert raw.response_metadata["finish_reason"] == "stop"
        assert Person.model_validate_json(str(raw.content)) == parsed
    else:
        (call,) = raw.tool_calls
        assert call["name"] == "Person"
        assert Person.model_validate(call["args"]) == parsed


def test_json_mode_with_the_schema_in_the_prompt(service: ClientService) -> None:
    schema = json.dumps(SearchFilter.model_json_schema())
    structured = _chat(service, max_tokens=64).with_structured_output(
        SearchFilter, method="json_mode"
    )
    system = SystemMessage(f"Answer with a JSON object valid against this schema: {schema}")
    prompts = [[system, HumanMessage(prompt)] for prompt in JSON_PROMPTS]
    # As for the SDK's JSON mode: some greedy answers end, the others are cut short.
    results = structured.batch(prompts, return_exceptions=True)  # type: ignore[arg-type]
    parsed = [r for r in results if not isinstance(r, Exception)]
    assert parsed, results
    for result in results:
        if isinstance(result, Exception):
            assert isinstance(result, openai.LengthFinishReasonError), result
        else:
            assert isinstance(result, SearchFilter)
            SearchFilter.model_validate(result.model_dump())


@tool(args_schema=WeatherArguments)
def get_weather(city: str, unit: str) -> str:
    """The current weather in a city."""
    return weather_report(city, unit)


def test_a_bind_tools_loop_ends_in_an_answer(service: ClientService) -> None:
    chat = _chat(service)
    messages: list[BaseMessage] = [HumanMessage(WEATHER_QUESTION)]
    calling = chat.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    ai = calling.invoke(messages)
    assert isinstance(ai, AIMessage)
    assert not ai.invalid_tool_calls
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_PARAMETERS)
    messages += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = _chat(service, max_tokens=24).bind_tools([get_weather]).invoke(messages)
    assert isinstance(answer, AIMessage)
    assert not answer.tool_calls and not answer.invalid_tool_calls
    assert isinstance(answer.content, str) and answer.content
