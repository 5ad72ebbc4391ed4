"""An adapter's eval set: a JSONL file of prompts, each with what a good answer is.

Two kinds of line, mixed freely:

- `{"prompt": "...", "expected": "...", "match": "exact" | "contains" | "regex" | "json",
  "max_tokens": N}`: the model answers the prompt (a user message, through the chat
  template) greedily; the answer passes when it equals `expected` (both stripped of
  surrounding whitespace), contains it, fully matches it as a regular expression
  (`.` matching newlines too: answers run over several lines), or, for "json", is one
  JSON document (stripped of surrounding whitespace), equal as a value to `expected`
  where a JSON `expected` is given (it may be left out: any valid JSON passes).
  `match` defaults to "exact", `max_tokens` to 64.
- `{"prompt": "...", "choices": ["...", ...], "answer": i}`: the choice the model finds
  likeliest after the prompt (the sum of its tokens' logprobs, the prompt as plain text)
  must be choice i.

Every problem is reported with its line number; sizes are bounded (EvalLimits) so that
an eval stays a small, cheap job beside the traffic it shares the engine with.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

import regex

Match = Literal["exact", "contains", "regex", "json"]
MATCHES: tuple[Match, ...] = ("exact", "contains", "regex", "json")
DEFAULT_MAX_TOKENS = 64
# A pattern gets this long on one answer (the `regex` module's timeout): a catastrophic
# pattern fails its item, not the server.
REGEX_TIMEOUT_S = 0.5


@dataclass(frozen=True, slots=True)
class EvalLimits:
    max_bytes: int = 4 * 1024 * 1024
    max_items: int = 1000
    max_prompt_chars: int = 16_000
    max_tokens: int = 256
    max_choices: int = 16


DEFAULT_LIMITS = EvalLimits()


class EvalSetError(ValueError):
    """What is wrong with an eval set, with the line it is on."""


@dataclass(frozen=True, slots=True)
class GenerationItem:
    prompt: str
    expected: str | None  # None: match "json" with any valid document
    match: Match = "exact"
    max_tokens: int = DEFAULT_MAX_TOKENS

    def passes(self, answer: str) -> bool:
        if self.match == "json":
            try:
                value = json.loads(answer.strip())
            except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
                return False
            return self.expected is None or value == json.loads(self.expected)
        assert self.expected is not None
        if self.match == "exact":
            return answer.strip() == self.expected.strip()
        if self.match == "contains":
            return self.expected in answer
        try:
            return regex.fullmatch(self.expected, answer.strip(), flags=regex.DOTALL,
                                   timeout=REGEX_TIMEOUT_S) is not None
        except TimeoutError:
            return False


@dataclass(frozen=True, slots=True)
class ChoiceItem:
    prompt: str
    choices: tuple[str, ...]
    answer: int


EvalItem = GenerationItem | ChoiceItem


@dataclass(frozen=True, slots=True)
class EvalSet:
    items: tuple[EvalItem, ...]
    sha256: str  # of the file's bytes: the set an eval's scores belong to


def parse_eval_set(data: bytes, limits: EvalLimits = DEFAULT_LIMITS) -> EvalSet:
    if len(data) > limits.max_bytes:
        raise EvalSetError(
            f"the eval set is {len(data)} bytes; at most {limits.max_bytes} are accepted")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvalSetError(f"the eval set is not UTF-8 text (byte {e.start})") from None
    items: list[EvalItem] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(items) == limits.max_items:
            raise EvalSetError(f"line {number}: more than {limits.max_items} items")
        items.append(_item(number, line, limits))
    if not items:
        raise EvalSetError("the eval set has no items (one JSON object per line)")
    return EvalSet(tuple(items), hashlib.sha256(data).hexdigest())


def _item(number: int, line: str, limits: EvalLimits) -> EvalItem:
    def fail(message: str) -> EvalSetError:
        return EvalSetError(f"line {number}: {message}")

    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise fail(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(raw, dict):
        raise fail("each line must be a JSON object")
    prompt = _text(raw, "prompt", fail, max_chars=limits.max_prompt_chars)
    if "choices" in raw:
        return _choice_item(raw, prompt, fail, limits)
    match = raw.get("match", "exact")
    if "expected" not in raw and match != "json":
        raise fail("needs 'expected' (an answer to check) or 'choices' and 'answer'")
    unknown = set(raw) - {"prompt", "expected", "match", "max_tokens"}
    if unknown:
        raise fail(f"unknown field(s) {', '.join(sorted(unknown))}")
    if match not in MATCHES:
        raise fail(f"'match' must be one of {', '.join(MATCHES)}, got {match!r}")
    expected = None
    if "expected" in raw:
        expected = _text(raw, "expected", fail, max_chars=limits.max_prompt_chars)
    if match == "json" and expected is not None:
        try:
            json.loads(expected)
        except ValueError as e:
            raise fail(f"'expected' must be JSON text with match 'json': {e}") from None
    if match == "regex":
        assert expected is not None
        try:
            regex.compile(expected)
        except regex.error as e:
            raise fail(f"'expected' is not a valid regular expression: {e}") from None
    max_tokens = raw.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) \
            or not 1 <= max_tokens <= limits.max_tokens:
        raise fail(f"'max_tokens' must be an integer from 1 to {limits.max_tokens}")
    return GenerationItem(prompt, expected, match, max_tokens)


def _choice_item(raw: dict[str, Any], prompt: str, fail: Any, limits: EvalLimits) -> ChoiceItem:
    unknown = set(raw) - {"prompt", "choices", "answer"}
    if unknown:
        raise fail(f"unknown field(s) {', '.join(sorted(unknown))}")
    choices = raw["choices"]
    if not isinstance(choices, list) or not 2 <= len(choices) <= limits.max_choices or not all(
        isinstance(c, str) and c for c in choices
    ):
        raise fail(f"'choices' must be a list of 2 to {limits.max_choices} non-empty strings")
    if any(len(c) > limits.max_prompt_chars for c in choices):
        raise fail(f"a choice is longer than {limits.max_prompt_chars} characters")
    answer = raw.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, int) \
            or not 0 <= answer < len(choices):
        raise fail(f"'answer' must be the index of a choice (0 to {len(choices) - 1})")
    return ChoiceItem(prompt, tuple(choices), answer)


def _text(raw: dict[str, Any], name: str, fail: Any, *, max_chars: int) -> str:
    value = raw.get(name)
    if not isinstance(value, str) or not value:
        raise fail(f"'{name}' must be a non-empty string")
    if len(value) > max_chars:
        raise fail(f"'{name}' is longer than {max_chars} characters")
    return value
