"""The grammars `loraplex bench grammar` compiles and drives, with valid documents for each.

A case is a JSON schema, JSON object mode (any object) or a regex. Every case can make
random valid documents (seeded) for the batch driver to tokenize and feed, and can check a
generated document: it must parse and validate against the schema, or fully match the regex.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

_WORDS = (
    "alpha", "bravo", "cedar", "delta", "ember", "fjord", "granite", "harbor", "island",
    "juniper", "kestrel", "lantern", "meadow", "nectar", "orchid", "pepper", "quartz", "raven",
    "sierra", "tundra", "umber", "violet", "willow", "xenon", "yarrow", "zephyr",
)
EMAIL_PATTERN = r"[a-z0-9._]{1,20}@[a-z0-9]{1,15}\.[a-z]{2,6}"
DATE_PATTERN = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


@dataclass(frozen=True, slots=True)
class GrammarCase:
    name: str
    kind: str  # "json_schema" | "json_object" | "regex"
    schema: dict[str, Any] | None = None  # json_object: {"type": "object"}; regex: None
    regex: str | None = None  # regex only
    make_document: Callable[[random.Random], str] | None = None  # a valid document

    @property
    def schema_json(self) -> str:
        return json.dumps(self.schema)

    @property
    def spec(self) -> str:
        """What the libraries compile: the regex, or the schema as JSON text."""
        return self.schema_json if self.regex is None else self.regex

    def check(self, text: str) -> str | None:
        """None when `text` is a valid document of this case, else why not."""
        if self.kind == "regex":
            assert self.regex is not None
            return None if re.fullmatch(self.regex, text) else "does not match the regex"
        try:
            value = json.loads(text)
            if self.kind == "json_schema":
                jsonschema.validate(value, self.schema)
        except jsonschema.ValidationError as e:
            return f"invalid: {e.message}"
        except ValueError as e:
            return f"not JSON: {e}"
        if self.kind == "json_object" and not isinstance(value, dict):
            return f"not an object: {type(value).__name__}"
        return None


# -------------------------------------------------------------------- the schemas


def _obj(properties: dict[str, Any]) -> dict[str, Any]:
    """An object schema in the form strict structured outputs use: every property required,
    no others allowed."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _string(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def _email(rng: random.Random) -> str:
    return f"{rng.choice(_WORDS)}.{rng.randint(1, 99)}@{rng.choice(_WORDS)}.{rng.choice(['com', 'org', 'io'])}"  # noqa: E501


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


FLAT_SCHEMA = _obj({
    "id": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
    "name": _string(40),
    "email": {"type": "string", "pattern": f"^{EMAIL_PATTERN}$"},
    "score": {"type": "number"},
    "active": {"type": "boolean"},
    "tier": {"enum": ["free", "standard", "premium"]},
    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
})


def _flat_document(rng: random.Random) -> dict[str, Any]:
    return {
        "id": rng.randint(0, 1_000_000),
        "name": _words(rng, 1, 3),
        "email": _email(rng),
        "score": round(rng.uniform(-100, 100), 3),
        "active": rng.random() < 0.5,
        "tier": rng.choice(["free", "standard", "premium"]),
        "code": "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3))
        + f"-{rng.randint(0, 9999):04d}",
    }


_ADDRESS = _obj({"street": _string(60), "city": _string(30), "zip": {
    "type": "string", "pattern": "^[0-9]{5}$"}})
NESTED_SCHEMA = _obj({
    "order_id": _string(20),
    "customer": _obj({"name": _string(40), "email": {"type": "string", "maxLength": 60},
                      "address": _ADDRESS}),
    "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": _obj({
        "sku": _string(16),
        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
        "price": {"type": "number", "minimum": 0},
        "tags": {"type": "array", "maxItems": 4, "items": _string(12)},
    })},
    "gift": {"type": "boolean"},
})


def _nested_document(rng: random.Random) -> dict[str, Any]:
    return {
        "order_id": f"ord-{rng.randint(0, 10**8)}",
        "customer": {"name": _words(rng, 1, 2), "email": _email(rng), "address": {
            "street": f"{rng.randint(1, 999)} {_words(rng, 1, 2)} street",
            "city": rng.choice(_WORDS), "zip": f"{rng.randint(0, 99999):05d}"}},
        "items": [
            {"sku": f"sku-{rng.randint(0, 99999)}", "quantity": rng.randint(1, 100),
             "price": round(rng.uniform(0, 500), 2),
             "tags": [rng.choice(_WORDS) for _ in range(rng.randint(0, 4))]}
            for _ in range(rng.randint(1, 5))
        ],
        "gift": rng.random() < 0.5,
    }


ENUM_VALUES = [f"{_WORDS[i % len(_WORDS)]}-{_WORDS[i // len(_WORDS) % len(_WORDS)]}-{i}"
               for i in range(200)]
ENUM_SCHEMA = _obj({
    "city": {"enum": ENUM_VALUES},
    "count": {"type": "integer", "minimum": 1, "maximum": 99},
})


def _enum_document(rng: random.Random) -> dict[str, Any]:
    return {"city": rng.choice(ENUM_VALUES), "count": rng.randint(1, 99)}


_TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": _obj({"location": _string(40), "unit": {"enum": ["celsius", "fahrenheit"]}}),
    "search_web": _obj({"query": _string(80),
                        "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}),
    "send_email": _obj({"to": {"type": "string", "pattern": f"^{EMAIL_PATTERN}$"},
                        "subject": _string(60), "body": _string(200)}),
    "create_event": _obj({
        "title": _string(60),
        "date": {"type": "string", "pattern": f"^{DATE_PATTERN}$"},
        "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
        "attendees": {"type": "array", "maxItems": 5, "items": _string(40)},
    }),
}
TOOL_CALL_SCHEMA = {"anyOf": [
    _obj({"name": {"const": name}, "arguments": arguments}) for name, arguments in _TOOLS.items()
]}


def _tool_call_document(rng: random.Random) -> dict[str, Any]:
    name = rng.choice(list(_TOOLS))
    makers: dict[str, Callable[[], dict[str, Any]]] = {
        "get_weather": lambda: {"location": _words(rng, 1, 2),
                                "unit": rng.choice(["celsius", "fahrenheit"])},
        "search_web": lambda: {"query": _words(rng, 2, 6), "max_results": rng.randint(1, 20)},
        "send_email": lambda: {"to": _email(rng), "subject": _words(rng, 2, 5),
                               "body": _words(rng, 5, 20)},
        "create_event": lambda: {"title": _words(rng, 2, 4), "date": _date(rng),
                                 "duration_minutes": rng.randint(5, 480),
                                 "attendees": [_email(rng) for _ in range(rng.randint(0, 3))]},
    }
    return {"name": name, "arguments": makers[name]()}


def deep_schema(levels: int) -> dict[str, Any]:
    """Objects nested `levels` deep, each with a small integer and its child."""
    return dict(json.loads(deep_schema_text(levels)))


def deep_schema_text(levels: int) -> str:
    """deep_schema(levels) as JSON text, built without recursion (`json` stops near 300)."""
    level = '"level": {"type": "integer", "minimum": 0, "maximum": 100}'
    text = f'{{"type": "object", "properties": {{{level}}}, "required": ["level"], ' \
           '"additionalProperties": false}'
    for _ in range(levels - 1):
        text = (f'{{"type": "object", "properties": {{{level}, "child": {text}}}, '
                '"required": ["level", "child"], "additionalProperties": false}')
    return text


def _deep_document(levels: int, rng: random.Random) -> dict[str, Any]:
    doc: dict[str, Any] = {"level": rng.randint(0, 100)}
    for _ in range(levels - 1):
        doc = {"level": rng.randint(0, 100), "child": doc}
    return doc


def _any_object_document(rng: random.Random) -> dict[str, Any]:
    return rng.choice([_flat_document, _nested_document, _tool_call_document])(rng)


def _dumps(make: Callable[[random.Random], Any]) -> Callable[[random.Random], str]:
    return lambda rng: json.dumps(make(rng))


CASES: tuple[GrammarCase, ...] = (
    GrammarCase("flat", "json_schema", FLAT_SCHEMA, make_document=_dumps(_flat_document)),
    GrammarCase("nested", "json_schema", NESTED_SCHEMA, make_document=_dumps(_nested_document)),
    GrammarCase("enum-200", "json_schema", ENUM_SCHEMA, make_document=_dumps(_enum_document)),
    GrammarCase("tool-call-anyof-4", "json_schema", TOOL_CALL_SCHEMA,
                make_document=_dumps(_tool_call_document)),
    GrammarCase("deep-20", "json_schema", deep_schema(20),
                make_document=_dumps(lambda rng: _deep_document(20, rng))),
    GrammarCase("json-object", "json_object", {"type": "object"},
                make_document=_dumps(_any_object_document)),
    GrammarCase("regex-iso-date", "regex", regex=DATE_PATTERN, make_document=_date),
    GrammarCase("regex-email", "regex", regex=EMAIL_PATTERN, make_document=_email),
)


# ---------------------------------------------------------------- hostile grammars


@dataclass(frozen=True, slots=True)
class HostileCase:
    name: str
    kind: str  # "json_schema" | "regex"
    spec: str  # the schema as JSON text, or the regex
    probe: str = ""  # fed token by token after the compile, a mask before each token


def hostile_cases(quick: bool) -> list[HostileCase]:
    # nesting-1000 last: a case that times out costs a fresh worker for the ones after it.
    cases = [
        HostileCase("regex (a+)+$", "regex", "(a+)+$", probe="a" * 64),
        HostileCase("invalid type", "json_schema", json.dumps({"type": "objekt"})),
        HostileCase("nesting-1000", "json_schema", deep_schema_text(1000)),
    ]
    if quick:
        return cases
    return [
        *cases[:2],
        HostileCase("enum-100k", "json_schema", json.dumps(
            {"enum": [f"{_WORDS[i % len(_WORDS)]}-{i:06d}" for i in range(100_000)]})),
        HostileCase("regex (x+x+)+y", "regex", "(x+x+)+y", probe="x" * 64),
        HostileCase("regex [a-z]{10000}", "regex", "[a-z]{10000}", probe="abcdefgh" * 8),
        HostileCase("unsatisfiable min>max", "json_schema",
                    json.dumps({"type": "integer", "minimum": 5, "maximum": 1})),
        HostileCase("invalid regex (", "regex", "("),
        cases[2],
    ]
