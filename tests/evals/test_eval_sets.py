"""Eval set files: both kinds of item, every refusal with its line number, the limits,
and a hostile regular expression that fails its item instead of hanging."""

from __future__ import annotations

import json

import pytest

from app.evals.dataset import (
    ChoiceItem,
    EvalLimits,
    EvalSetError,
    GenerationItem,
    parse_eval_set,
)


def jsonl(*items: object) -> bytes:
    return "\n".join(json.dumps(i) for i in items).encode()


def test_both_kinds_parse_with_their_defaults() -> None:
    data = jsonl({"prompt": "2+2?", "expected": "4"},
                 {"prompt": "Say hi", "expected": "hi", "match": "contains", "max_tokens": 8},
                 {"prompt": "Sky?", "choices": ["blue", "red"], "answer": 0})
    parsed = parse_eval_set(data + b"\n\n")
    assert parsed.items == (
        GenerationItem("2+2?", "4"),
        GenerationItem("Say hi", "hi", "contains", 8),
        ChoiceItem("Sky?", ("blue", "red"), 0),
    )
    assert len(parsed.sha256) == 64


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: each line must be a JSON object"),
    ('{"expected": "x"}', "line 2: 'prompt' must be a non-empty string"),
    ('{"prompt": ""}', "line 2: 'prompt' must be a non-empty string"),
    ('{"prompt": "p"}', "line 2: needs 'expected'"),
    ('{"prompt": "p", "expected": "x", "match": "fuzzy"}', "line 2: 'match' must be one of"),
    ('{"prompt": "p", "expected": "(", "match": "regex"}', "not a valid regular expression"),
    ('{"prompt": "p", "expected": "{oops", "match": "json"}',
     "line 2: 'expected' must be JSON text with match 'json'"),
    ('{"prompt": "p", "match": "regex"}', "line 2: needs 'expected'"),
    ('{"prompt": "p", "expected": "x", "max_tokens": 0}', "line 2: 'max_tokens' must be"),
    ('{"prompt": "p", "expected": "x", "max_tokens": true}', "line 2: 'max_tokens' must be"),
    ('{"prompt": "p", "expected": "x", "temperature": 1}', "line 2: unknown field(s) temperature"),
    ('{"prompt": "p", "choices": ["a"], "answer": 0}', "line 2: 'choices' must be a list of 2"),
    ('{"prompt": "p", "choices": ["a", ""], "answer": 0}', "'choices' must be a list"),
    ('{"prompt": "p", "choices": ["a", "b"], "answer": 2}', "line 2: 'answer' must be"),
    ('{"prompt": "p", "choices": ["a", "b"], "answer": false}', "line 2: 'answer' must be"),
])
def test_each_problem_names_its_line(line: str, message: str) -> None:
    data = jsonl({"prompt": "ok", "expected": "ok"}) + b"\n" + line.encode()
    with pytest.raises(EvalSetError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        parse_eval_set(data)


def test_limits() -> None:
    small = EvalLimits(max_bytes=200, max_items=2, max_prompt_chars=10)
    with pytest.raises(EvalSetError, match="at most 200 are accepted"):
        parse_eval_set(b"x" * 201, small)
    with pytest.raises(EvalSetError, match="line 3: more than 2 items"):
        parse_eval_set(jsonl(*[{"prompt": "p", "expected": "e"}] * 3), small)
    with pytest.raises(EvalSetError, match="'prompt' is longer than 10 characters"):
        parse_eval_set(jsonl({"prompt": "p" * 11, "expected": "e"}), small)
    with pytest.raises(EvalSetError, match="no items"):
        parse_eval_set(b"\n \n")
    with pytest.raises(EvalSetError, match="not UTF-8"):
        parse_eval_set(b"\xff\xfe")


def test_matching() -> None:
    assert GenerationItem("p", " Paris ").passes("Paris\n")
    assert not GenerationItem("p", "Paris").passes("Paris.")
    assert GenerationItem("p", "Paris", "contains").passes("It is Paris.")
    assert GenerationItem("p", r"\d+ apples", "regex").passes(" 12 apples ")
    assert not GenerationItem("p", r"\d+", "regex").passes("12 apples")
    assert GenerationItem("p", r"Dear .*, thanks", "regex").passes("Dear Ann,\nBob, thanks")


def test_json_answers() -> None:
    [any_json, exact_json] = parse_eval_set(jsonl(
        {"prompt": "p", "match": "json"},
        {"prompt": "p", "match": "json", "expected": '{"answer": 4}'},
    )).items
    assert any_json == GenerationItem("p", None, "json")
    assert any_json.passes(' {"answer": "Paris"}\n') and any_json.passes("[1, 2]")
    assert not any_json.passes('{"answer": "Paris"') and not any_json.passes("Paris")
    assert not any_json.passes('{"a": 1} trailing')
    assert not any_json.passes("[" * 100_000 + "]" * 100_000)  # past the parser's depth
    assert exact_json.passes('{ "answer" : 4 }') and not exact_json.passes('{"answer": 5}')


def test_a_catastrophic_pattern_fails_its_item_in_bounded_time() -> None:
    import time

    # Exponential for a backtracking matcher (seconds at 30 characters, years at 45).
    item = GenerationItem("p", r"(a|aa)+$", "regex")
    started = time.monotonic()
    assert not item.passes("a" * 45 + "b")
    assert time.monotonic() - started < 5
