"""What `loraplex bench structured` asks the model for: the step-time load's schema, the
schema shapes and tool sets of the validity checks, their prompts, and the checks.

Every string is bounded (maxLength), every array (maxItems) and every integer (a range),
so every constrained output can end well inside the requests' max_tokens.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import jsonschema


def _string(low: int, high: int) -> dict[str, Any]:
    return {"type": "string", "minLength": low, "maxLength": high}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


# The step-time load's constraint: nested, and with minimum lengths that make a document
# take about as many tokens as the free rows generate, so constrained rows stay in the
# batch for most of its steps.
LOAD_SCHEMA: dict[str, Any] = _object({
    "name": _string(12, 32),
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "address": _object({"street": _string(12, 40), "city": _string(6, 24),
                        "country": {"type": "string", "enum": ["Italy", "France", "Spain"]}}),
    "skills": {"type": "array", "items": _string(6, 16), "minItems": 3, "maxItems": 4},
    "bio": _string(40, 80),
})
LOAD_PROMPTS: tuple[str, ...] = (
    "Describe a fictional software engineer.",
    "Write a short profile of a chef from Lyon.",
    "Tell me about a teacher who lives in Madrid.",
    "Invent a character for a novel set in Rome.",
    "Describe a musician and where they live.",
    "Give me a profile of a nurse from Seville.",
    "Describe a mountain guide and their skills.",
    "Write a profile of a data scientist.",
)


@dataclass(frozen=True, slots=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    prompts: tuple[str, ...]


SCHEMA_CASES: tuple[SchemaCase, ...] = (
    SchemaCase("nested objects", _object({
        "name": _string(1, 40),
        "contact": _object({"email": _string(3, 40), "phone": _string(3, 20)}),
        "address": _object({"city": _string(1, 30), "country": _string(1, 30),
                            "location": _object({"lat": {"type": "integer", "minimum": -90,
                                                         "maximum": 90},
                                                 "lon": {"type": "integer", "minimum": -180,
                                                         "maximum": 180}})}),
    }), ("Make up a contact card for a person living in Paris.",
         "Who is a famous scientist? Give their contact details.",
         "Describe a customer from Berlin.")),
    SchemaCase("array of objects", _object({
        "order_id": _string(1, 16),
        "items": {"type": "array", "minItems": 1, "maxItems": 4,
                  "items": _object({"product": _string(1, 30),
                                    "quantity": {"type": "integer", "minimum": 1,
                                                 "maximum": 20}})},
    }), ("I want two apples and a loaf of bread.",
         "Order three notebooks and a pen for me.",
         "Create a grocery order for a small dinner.")),
    SchemaCase("enums", _object({
        "category": {"type": "string", "enum": ["billing", "technical", "account", "other"]},
        "priority": {"enum": ["low", "medium", "high"]},
        "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
        "summary": _string(1, 60),
    }), ("My invoice is wrong and I am very upset.",
         "The app crashes whenever I open settings.",
         "How do I change the email on my account?")),
    SchemaCase("integer ranges", _object({
        "city": _string(1, 30),
        "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
        "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100},
        "wind": _object({"speed_kmh": {"type": "integer", "minimum": 0, "maximum": 250},
                         "direction": {"type": "string", "enum": ["N", "E", "S", "W"]}}),
        "forecast_days": {"type": "array", "minItems": 1, "maxItems": 3,
                          "items": {"type": "integer", "minimum": -50, "maximum": 60}},
    }), ("What is the weather like in Oslo today?",
         "Give me a weather report for Cairo.",
         "Is it windy in Chicago?")),
)


def _function(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": parameters}}


@dataclass(frozen=True, slots=True)
class ToolCase:
    name: str
    tools: tuple[dict[str, Any], ...]
    prompts: tuple[str, ...]


TOOL_CASES: tuple[ToolCase, ...] = (
    ToolCase("weather", (
        _function("get_weather", "Current weather of a city.", _object({
            "city": _string(1, 40), "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        })),
        _function("get_time", "Local time in a time zone.", _object({
            "timezone": _string(1, 40),
        })),
    ), ("What's the weather in Rome?", "Is it cold in Toronto right now?",
        "What time is it in Tokyo?")),
    ToolCase("calendar", (
        _function("create_event", "Add an event to the calendar.", _object({
            "title": _string(1, 60),
            "day": {"type": "integer", "minimum": 1, "maximum": 31},
            "month": {"type": "integer", "minimum": 1, "maximum": 12},
            "attendees": {"type": "array", "items": _string(1, 30), "maxItems": 5},
        })),
    ), ("Schedule a meeting with Anna on March 3rd.", "Put my dentist appointment on 12 May.",
        "Plan a team lunch on the 20th of June with Bob and Carla.")),
    ToolCase("shop", (
        _function("search_products", "Search the catalogue.", _object({
            "query": _string(1, 40),
            "max_price": {"type": "integer", "minimum": 1, "maximum": 10000},
            "category": {"type": "string", "enum": ["books", "electronics", "garden", "toys"]},
        })),
        _function("add_to_cart", "Put a product in the cart.", _object({
            "sku": _string(1, 20), "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
        })),
    ), ("Find me a cheap novel.", "Add two of item AB-123 to my cart.",
        "I need headphones under 100 dollars.")),
)


def compile_schema(index: int) -> dict[str, Any]:
    """LOAD_SCHEMA with one property renamed after `index`: a new spec for each index, so
    each compiles cold; the same index again is the same spec."""
    schema = copy.deepcopy(LOAD_SCHEMA)
    schema["properties"][f"field_{index}"] = schema["properties"].pop("bio")
    schema["required"] = list(schema["properties"])
    return schema


def chat_body(model: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A one-message chat completion request on `model` (an adapter's name)."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, **extra}


def schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """`response_format` of a strict JSON schema."""
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True}}


# ------------------------------------------------------------------------ the checks


def check_document(content: str | None, schema: dict[str, Any],
                   finish_reason: str | None) -> str | None:
    """None when `content` is JSON valid against `schema`; else why not."""
    if content is None:
        return f"no content (finish_reason {finish_reason})"
    try:
        jsonschema.validate(json.loads(content), schema)
    except json.JSONDecodeError as e:
        return f"not JSON ({e}; finish_reason {finish_reason})"
    except jsonschema.ValidationError as e:
        return f"not valid against the schema: {e.message}"
    return None


def check_tool_calls(message: dict[str, Any], case: ToolCase,
                     finish_reason: str | None) -> str | None:
    """None when the message holds at least one tool call and every call names one of the
    case's functions with arguments that parse and validate; else why not."""
    calls = message.get("tool_calls") or []
    if not calls:
        return f"no tool_calls (finish_reason {finish_reason})"
    if finish_reason != "tool_calls":
        return f"finish_reason {finish_reason}, not tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in case.tools}
    for call in calls:
        function = call.get("function") or {}
        parameters = schemas.get(str(function.get("name")))
        if parameters is None:
            return f"unknown function {function.get('name')!r}"
        try:
            jsonschema.validate(json.loads(function.get("arguments") or ""), parameters)
        except json.JSONDecodeError as e:
            return f"arguments of {function['name']} are not JSON ({e})"
        except jsonschema.ValidationError as e:
            return f"arguments of {function['name']} are not valid: {e.message}"
    return None
