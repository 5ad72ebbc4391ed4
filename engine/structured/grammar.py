"""A `StructuredOutput` checked against our limits and turned into an llguidance grammar.

`to_grammar` runs on the compiler's threads, never on the step loop: a schema of the
largest allowed size costs a few milliseconds of Python here before llguidance builds it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from engine.structured.errors import INVALID_SPEC, StructuredOutputError
from engine.structured.limits import (
    StructuredLimits,
    clean_message,
    over_limit,
    whitespace_pattern,
)
from engine.structured.spec import OutputKind, StructuredOutput, Whitespace

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON strings (their brackets do not nest anything) and everything that is not a bracket.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_OPENING = np.frombuffer(b"{[", dtype=np.uint8)
# Keywords whose values are data, not subschemas: an "enum" or "pattern" key inside them
# is a value of the document, not a constraint.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to subschemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})


def json_depth(text: str) -> int:
    """How deeply the objects and arrays of a JSON text nest; no recursion, no parse."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)).encode()
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where(np.isin(codes, _OPENING), 1, -1)
    return int(np.cumsum(steps).max())


def to_grammar(spec: StructuredOutput, limits: StructuredLimits) -> str:
    """The llguidance grammar of `spec`, or a StructuredOutputError naming the limit it
    exceeds or what is wrong with it. Errors the library finds while building the grammar
    come later, from the compiler."""
    what = spec.describe()
    if spec.num_bytes > limits.max_spec_bytes:
        raise over_limit(what, "max_spec_bytes", limits.max_spec_bytes,
                         f"{spec.num_bytes:,} bytes")
    if spec.kind is OutputKind.JSON_OBJECT:
        return _json_grammar({"type": "object"}, spec, limits)
    if spec.kind is OutputKind.JSON_SCHEMA:
        return _json_grammar(_checked_schema(spec.text, spec.strict, limits), spec, limits)
    if spec.kind is OutputKind.REGEX:
        if len(spec.text) > limits.max_regex_chars:
            raise over_limit(what, "max_regex_chars", limits.max_regex_chars,
                             f"{len(spec.text):,} characters")
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind is OutputKind.GRAMMAR:
        try:
            return llguidance.grammar_from("grammar", spec.text)
        except (ValueError, RecursionError) as e:
            raise StructuredOutputError(f"invalid grammar: {clean_message(str(e))}",
                                        code=INVALID_SPEC) from None
    choices = spec.choices
    if len(choices) > limits.max_choices:
        raise over_limit(what, "max_choices", limits.max_choices, f"{len(choices):,} choices")
    # NOTE: one terminal, not a rule of alternatives: llguidance builds it as a single
    # lexeme, 3-4x faster, and a rule of 100k alternatives overflows its symbol table.
    # Lark string literals take JSON's escapes; the choices are matched as they are.
    lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                  for c in choices)
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _json_grammar(schema: Any, spec: StructuredOutput, limits: StructuredLimits) -> str:
    options: JsonCompileOptions = {"lenient": not spec.strict}
    if spec.whitespace is Whitespace.COMPACT:
        options["whitespace_flexible"] = False
        options["item_separator"], options["key_separator"] = ",", ":"
    else:
        options["whitespace_pattern"] = whitespace_pattern(limits)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as e:
        raise StructuredOutputError(f"invalid JSON schema: {clean_message(str(e))}",
                                    code=INVALID_SPEC) from None


def _checked_schema(text: str, strict: bool, limits: StructuredLimits) -> Any:
    """The schema parsed, within our limits; with `strict`, its objects closed."""
    what = "JSON schema"
    depth = json_depth(text)
    if depth > limits.max_json_depth:
        raise over_limit(what, "max_json_depth", limits.max_json_depth,
                         f"objects and arrays nested {depth} deep")
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}",
                                    code=INVALID_SPEC) from None
    if schema is True:
        schema = {}  # any JSON value
    if schema is False:
        raise StructuredOutputError("the JSON schema false allows no document",
                                    code=INVALID_SPEC)
    if not isinstance(schema, dict):
        raise StructuredOutputError("a JSON schema must be an object or a boolean",
                                    code=INVALID_SPEC)
    num_enum_values = 0
    stack: list[Any] = [schema]  # subschemas still to look at
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        enum = node.get("enum")
        if isinstance(enum, list):
            num_enum_values += len(enum)
            if num_enum_values > limits.max_enum_values:
                raise over_limit(what, "max_enum_values", limits.max_enum_values,
                                 f"more than {limits.max_enum_values:,} enum values")
        patterns = [node.get("pattern")]
        if isinstance(node.get("patternProperties"), dict):
            patterns.extend(node["patternProperties"])
        for pattern in patterns:
            if isinstance(pattern, str) and len(pattern) > limits.max_regex_chars:
                raise over_limit(what, "max_regex_chars", limits.max_regex_chars,
                                 f"a pattern of {len(pattern):,} characters")
        if strict and _is_object_schema(node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key, value in node.items():
            if key in _DATA_KEYWORDS:
                continue
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
            else:
                stack.append(value)
    return schema


def _is_object_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) \
        or "properties" in node
