"""What the tests ask the model for, as tenants' code declares it: pydantic models and one
function tool.

NOTE: every string has a maxLength and every model is closed (extra="forbid", so its
schema says additionalProperties: false): the output grammar then ends, and a random
model, which would otherwise write one string or one more property for ever, finishes
each document within a few hundred tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

City = Annotated[str, Field(max_length=10)]
Unit = Literal["c", "f"]


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: City
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    """A person and where they live."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=12)
    mood: Literal["happy", "sad"]
    address: Address


class Forecast(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")

    city: City
    unit: Unit


class SearchFilter(BaseModel):
    """Filters of a search, every one optional.

    JSON mode constrains an answer to be some JSON object, not one of this schema: the
    schema is only in the prompt. A random model follows no prompt, so only a schema that
    every object satisfies (all fields optional, extra keys ignored) makes its answer
    valid; a real model's would be."""

    city: City | None = None
    limit: int | None = None


class WeatherArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: City
    unit: Unit


WEATHER_PARAMETERS: dict[str, Any] = WeatherArguments.model_json_schema()
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The current weather in a city.",
                 "parameters": WEATHER_PARAMETERS, "strict": True},
}
WEATHER_QUESTION = "What is the weather in Paris?"
# Asked in JSON mode, each prompt one greedy path of the model (see SearchFilter).
JSON_PROMPTS = [
    "Reply in JSON.", "Give me a JSON object.", "JSON please.", "Describe a person as JSON.",
    "Answer with a JSON object.", "Summarise this in JSON: the cat sat.", "Output JSON.",
    "An empty object, in JSON.", "Name and age, as JSON.", "List three colours as JSON.",
    "What is the weather? Answer in JSON.", "Respond in json.",
]


def weather_report(city: str, unit: str) -> str:
    """What the tool answers, whatever it was asked."""
    return f"21 degrees {unit.upper()} in {city}"
