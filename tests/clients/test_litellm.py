"""litellm's OpenAI-compatible provider (`openai/<model>`) against the server: a required
tool call, parsed into litellm's own response types."""

from __future__ import annotations

import json

import jsonschema
import litellm
import pytest
from litellm.litellm_core_utils.get_model_cost_map import get_model_cost_map_source_info

from tests.clients.conftest import ClientService
from tests.clients.schemas import WEATHER_PARAMETERS, WEATHER_QUESTION, WEATHER_TOOL

pytestmark = pytest.mark.timeout(60)


def test_the_model_price_map_is_the_copy_litellm_ships() -> None:
    # Read at import (LITELLM_LOCAL_MODEL_COST_MAP, set by conftest), never fetched.
    source = get_model_cost_map_source_info()
    assert source["source"] == "local" and source["is_env_forced"], source
    assert source["fallback_reason"] is None
    assert litellm.model_cost


def test_a_required_tool_call_parses(service: ClientService) -> None:
    response = litellm.completion(
        model=f"openai/{service.model}", api_base=service.api_base, api_key=service.key,
        messages=[{"role": "user", "content": WEATHER_QUESTION}], tools=[WEATHER_TOOL],
        tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0,
        num_retries=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert response.model.endswith(service.model)
