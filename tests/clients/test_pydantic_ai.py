"""A pydantic-ai `Agent` over `OpenAIChatModel` against the server: one plain tool and a
pydantic `output_type` (pydantic-ai's output tool), run to its final output."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import pytest
from pydantic import Field
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import RunContext
from pydantic_ai.usage import UsageLimits

from tests.clients.conftest import ClientService
from tests.clients.schemas import WEATHER_QUESTION, Forecast

pytestmark = pytest.mark.timeout(60)


@dataclass
class LookUpFirst(AbstractCapability[None]):
    """Step 1 must call `tool`; from step 2 on only the output tool is left.

    NOTE: a random model left to choose between the tool and the final answer may pick
    either, on every step, for ever: pinning the choice per step (pydantic-ai's way of
    forcing a tool on the first step only) makes the run two requests, always."""

    tool: str

    def get_model_settings(self) -> Callable[[RunContext[None]], ModelSettings]:
        def settings(ctx: RunContext[None]) -> ModelSettings:
            return ModelSettings(tool_choice=[self.tool] if ctx.run_step <= 1 else "none")

        return settings


def test_an_agent_calls_its_tool_and_returns_its_output_type(service: ClientService) -> None:
    model = OpenAIChatModel(
        service.model, provider=OpenAIProvider(base_url=service.api_base, api_key=service.key)
    )
    agent = Agent(
        model, output_type=Forecast, capabilities=[LookUpFirst("get_temperature")],
        model_settings=ModelSettings(temperature=0, seed=0, max_tokens=300,
                                     parallel_tool_calls=False),
    )
    cities: list[str] = []

    @agent.tool_plain
    def get_temperature(city: Annotated[str, Field(max_length=10)]) -> int:
        """The temperature in a city, in degrees Celsius."""
        cities.append(city)
        return 21

    result = agent.run_sync(WEATHER_QUESTION, usage_limits=UsageLimits(request_limit=3))
    assert len(cities) == 1 and len(cities[0]) <= 10
    assert isinstance(result.output, Forecast)
    Forecast.model_validate(result.output.model_dump())
    assert result.usage.requests == 2
    parts = [part for message in result.all_messages() for part in message.parts]
    calls = [p for p in parts if isinstance(p, ToolCallPart)]
    assert [c.tool_name for c in calls] == ["get_temperature", "final_result"]
    assert calls[0].args_as_dict() == {"city": cities[0]}
    returns = [p for p in parts if isinstance(p, ToolReturnPart)]
    assert returns[0].tool_name == "get_temperature" and returns[0].content == 21
