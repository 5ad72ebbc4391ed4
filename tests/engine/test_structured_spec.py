"""StructuredOutput: validation, hashing (it is the cache key), and the grammar each kind
becomes, checked without a tokenizer; errors are picklable (they cross the worker wire)."""

from __future__ import annotations

import json
import pickle

import pytest

from engine.structured import (
    GRAMMAR_TIMEOUT,
    GRAMMAR_TOO_COMPLEX,
    INVALID_SPEC,
    GrammarLimitError,
    GrammarTimeoutError,
    OutputKind,
    StructuredLimits,
    StructuredOutput,
    StructuredOutputError,
    Whitespace,
    to_grammar,
)
from engine.structured.grammar import json_depth


def test_specs_are_hashable_and_compare_by_value() -> None:
    a = StructuredOutput.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutput.json_schema('{"type":"object","properties":{"x":{"type":"integer"}}}')
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != StructuredOutput.json_schema(a.text, strict=True)
    assert a != StructuredOutput.json_schema(a.text, whitespace=Whitespace.COMPACT)
    choice = StructuredOutput(OutputKind.CHOICE, ["x", "y"])  # type: ignore[arg-type]
    assert choice.value == ("x", "y") and choice == StructuredOutput.choice(["x", "y"])
    assert StructuredOutput("regex", "a+") == StructuredOutput.regex("a+")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        a.strict = True  # type: ignore[misc]


def test_property_order_is_kept() -> None:
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"z": {}, "a": {}}})
    assert spec.text.index('"z"') < spec.text.index('"a"')


@pytest.mark.parametrize("build", [
    lambda: StructuredOutput(OutputKind.JSON_OBJECT, "x"),
    lambda: StructuredOutput("yaml", "x"),  # type: ignore[arg-type]
    lambda: StructuredOutput.regex(""),
    lambda: StructuredOutput.grammar("   "),
    lambda: StructuredOutput.json_schema(""),
    lambda: StructuredOutput.choice([]),
    lambda: StructuredOutput.choice("yes"),
    lambda: StructuredOutput.choice(["ok", 3]),  # type: ignore[list-item]
    lambda: StructuredOutput(OutputKind.REGEX, "a+", strict=True),
    lambda: StructuredOutput(OutputKind.CHOICE, ("a",), whitespace=Whitespace.COMPACT),
    lambda: StructuredOutput.json_schema({"x": {1, 2}}),
    lambda: StructuredOutput(OutputKind.JSON_OBJECT, whitespace="tabs"),  # type: ignore[arg-type]
], ids=["object-value", "unknown-kind", "empty-regex", "blank-grammar", "empty-schema",
        "no-choices", "choice-string", "choice-not-string", "strict-regex",
        "whitespace-choice", "not-json", "unknown-whitespace"])
def test_malformed_specs_are_refused(build: object) -> None:
    with pytest.raises(StructuredOutputError) as info:
        build()  # type: ignore[operator]
    assert info.value.code == INVALID_SPEC and isinstance(info.value, ValueError)


def test_json_depth_counts_brackets_outside_strings() -> None:
    assert json_depth('{"a": [1, {"b": "[[[{{{"}]}') == 3
    assert json_depth('"just a string"') == 0 and json_depth("[]") == 1
    assert json_depth('{"a\\"[": {}}') == 2
    assert json_depth("[" * 100_000 + "]" * 100_000) == 100_000  # no recursion


def _grammar(spec: StructuredOutput, **limits: int) -> dict:
    return json.loads(to_grammar(spec, StructuredLimits(**limits)))


def test_json_options_follow_strict_and_whitespace() -> None:
    schema = {"type": "object", "properties": {"p": {"type": "object", "properties": {}}},
              "additionalProperties": True}
    strict = _grammar(StructuredOutput.json_schema(schema, strict=True,
                                                   whitespace=Whitespace.COMPACT))
    (body,) = strict["grammars"]
    assert body["json_schema"]["additionalProperties"] is True  # said explicitly: kept
    assert body["json_schema"]["properties"]["p"]["additionalProperties"] is False
    options = body["json_schema"]["x-guidance"]
    assert options["lenient"] is False and options["whitespace_flexible"] is False
    loose = _grammar(StructuredOutput.json_schema(schema), max_whitespace_chars=7)
    (body,) = loose["grammars"]
    assert "additionalProperties" not in body["json_schema"]["properties"]["p"]
    assert body["json_schema"]["x-guidance"]["lenient"] is True
    # One space, or a newline and at most 7 spaces or tabs of indentation.
    assert body["json_schema"]["x-guidance"]["whitespace_pattern"] == (
        "(?:\\x20|\\x0A[\\x20\\x09]{0,7})?")


def test_choices_become_one_alternation_of_literals() -> None:
    grammar = to_grammar(StructuredOutput.choice(["a", 'q"uote', "ünï"]), StructuredLimits())
    assert grammar == 'start: CHOICE\nCHOICE: "a" | "q\\"uote" | "ünï"'


def test_size_is_checked_before_anything_is_parsed() -> None:
    spec = StructuredOutput.json_schema('{"enum": [' + "1," * 70_000 + "1]}")
    with pytest.raises(StructuredOutputError) as info:
        to_grammar(spec, StructuredLimits())
    assert info.value.limit == "max_spec_bytes"
    assert f"{len(spec.text):,} bytes" in str(info.value) and "131,072" in str(info.value)


def test_errors_survive_pickling() -> None:
    error = GrammarTimeoutError("took too long")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is GrammarTimeoutError and copy.code == GRAMMAR_TIMEOUT
    assert copy.limit == "compile_timeout_s" and str(copy) == "took too long"
    clone = error.clone()
    assert clone is not error and (clone.code, clone.limit, str(clone)) == (
        error.code, error.limit, str(error))


def test_refusals_are_request_rejections_on_the_wire() -> None:
    from engine.errors import RequestRejected
    from engine.remote.protocol import WireError

    error = GrammarLimitError("the regex exceeds max_regex_chars (4,096): it has 5,000 "
                              "characters", limit="max_regex_chars", param="guided_regex")
    assert isinstance(error, RequestRejected) and isinstance(error, ValueError)
    back = WireError.of(error).to_exception()
    assert isinstance(back, RequestRejected)
    assert (back.code, back.param, str(back)) == (GRAMMAR_TOO_COMPLEX, "guided_regex",
                                                 str(error))


def test_boolean_schemas() -> None:
    (body,) = _grammar(StructuredOutput.json_schema(True))["grammars"]
    assert {k: v for k, v in body["json_schema"].items() if k != "x-guidance"} == {}
    for refused in (False, [1, 2], "null"):
        with pytest.raises(StructuredOutputError) as info:
            to_grammar(StructuredOutput.json_schema(refused), StructuredLimits())  # type: ignore[arg-type]
        assert info.value.code == INVALID_SPEC
