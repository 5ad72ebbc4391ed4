"""The OpenAI Agents SDK against the server: an `Agent` with a `@function_tool`, run over
Chat Completions (`OpenAIChatCompletionsModel`) and over the Responses API
(`OpenAIResponsesModel`), tracing off and turns bounded."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from agents.result import RunResult, RunResultStreaming

from tests.clients.conftest import ClientService
from tests.clients.schemas import WEATHER_PARAMETERS, WEATHER_QUESTION, City, Unit, weather_report

pytestmark = pytest.mark.timeout(60)

set_tracing_disabled(True)


def _weather_agent(model: Any, calls: list[dict[str, str]], **options: Any) -> Agent[None]:
    @function_tool
    def get_weather(city: City, unit: Unit) -> str:
        """The current weather in a city."""
        calls.append({"city": city, "unit": unit})
        return weather_report(city, unit)

    # `required` on the first turn; the SDK then resets tool_choice (reset_tool_choice)
    # so that the next turn may answer.
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False,
                             temperature=0, max_tokens=200)
    return Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather],
                 model=model, model_settings=settings, **options)


def test_a_chat_completions_run_calls_the_tool_then_answers(service: ClientService) -> None:
    calls: list[dict[str, str]] = []
    model = OpenAIChatCompletionsModel(service.model, service.async_openai())
    result = Runner.run_sync(_weather_agent(model, calls), WEATHER_QUESTION, max_turns=3)
    (arguments,) = calls
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    output = result.new_items[1]
    assert isinstance(output, ToolCallOutputItem)
    assert output.output == weather_report(**arguments)
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_a_responses_run_calls_the_tool(service: ClientService, streamed: bool) -> None:
    # NOTE: the SDK refuses a Responses turn that ends `incomplete`, and a random model's
    # free text ends only at max_output_tokens: the run ends on the tool's result
    # (stop_on_first_tool), which the SDK makes its final output.
    calls: list[dict[str, str]] = []
    model = OpenAIResponsesModel(service.model, service.async_openai())
    agent = _weather_agent(model, calls, tool_use_behavior="stop_on_first_tool")
    result: RunResult | RunResultStreaming
    if streamed:
        result = Runner.run_streamed(agent, WEATHER_QUESTION, max_turns=2)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    else:
        result = await Runner.run(agent, WEATHER_QUESTION, max_turns=2)
    (arguments,) = calls
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    call = result.new_items[0]
    assert isinstance(call, ToolCallItem)
    assert json.loads(call.raw_item.arguments) == arguments  # type: ignore[union-attr]
    assert result.final_output == weather_report(**arguments)
    assert len(result.raw_responses) == 1
    assert result.raw_responses[0].response_id.startswith("resp_")  # type: ignore[union-attr]
