"""Structured outputs decoded under the masks of the real SmolLM2 tokenizer: every kind of
spec, greedy and sampled, from seeded random logits; the batch mask on a mixed batch.

The decoding loop here is the engine's in miniature: a [1, V] row of random logits biased
toward tokens that close strings, objects and arrays (so documents end), masked by
`TokenMasker`, then argmax or a seeded sample, accepted by the matcher. At every step the
EOS column must be open exactly when the matcher says the output is complete, and an
output that could end there must already be valid.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from bench.grammar.cases import (
    DATE_PATTERN,
    EMAIL_PATTERN,
    ENUM_SCHEMA,
    FLAT_SCHEMA,
    NESTED_SCHEMA,
    TOOL_CALL_SCHEMA,
    deep_schema,
)
from engine.models.loader import load_tokenizer
from engine.structured import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    StructuredOutput,
    TokenMasker,
    Whitespace,
)

MAX_TOKENS = 400
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(hf_tokenizer: Any) -> Any:
    compiler = GrammarCompiler(hf_tokenizer, compile_timeout_s=30.0)
    yield compiler
    compiler.close()


class Decoder:
    """Random logits -> mask -> token, until EOS or MAX_TOKENS."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        (self.eos,) = compiler.eos_token_ids
        self.masker = TokenMasker(self.vocab_size)
        bias = torch.zeros(self.vocab_size)
        for token in range(self.vocab_size):
            piece = compiler.tokenizer.decode_bytes([token])
            if compiler.tokenizer.is_special_token(token) or not piece:
                continue
            quote, close = b'"' in piece, b"}" in piece or b"]" in piece or b")" in piece
            if not piece.strip():
                bias[token] = -4.0
            elif quote and close:
                bias[token] = 3.0
            elif quote:
                bias[token] = 2.0
            elif close:
                bias[token] = 1.0
        bias[self.eos] = 4.0
        self.bias = bias  # [V]

    def text(self, tokens: list[int]) -> str:
        return self.compiler.tokenizer.decode_bytes(tokens).decode()

    def run(self, grammar: CompiledGrammar, *, seed: int, greedy: bool,
            check: Callable[[str], str | None], exact: bool = False) -> tuple[str, bool]:
        """(text, ended with EOS). `check(text)` is None for a valid document; `exact`: a
        valid prefix must also be complete (EOS open) — true of regexes and choices."""
        generator = torch.Generator().manual_seed(seed)
        matcher = grammar.new_matcher()
        tokens: list[int] = []
        for step in range(MAX_TOKENS):
            logits = torch.randn((1, self.vocab_size), generator=generator)  # [1, V]
            # The pull toward closing grows, so every document ends well within MAX_TOKENS.
            logits += self.bias * (2.0 + step / 8)
            self.masker(logits, [0], [matcher])
            eos_open = bool(torch.isfinite(logits[0, self.eos]))
            assert eos_open == matcher.is_accepting, (step, self.text(tokens))
            if eos_open:
                assert check(self.text(tokens)) is None, self.text(tokens)
            elif exact:
                assert check(self.text(tokens)) is not None, self.text(tokens)
            if greedy:
                token = int(logits[0].argmax())
            else:
                probs = torch.softmax(logits[0], dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            assert torch.isfinite(logits[0, token])
            assert matcher.accept(token), matcher.error
            if token == self.eos:
                assert matcher.is_finished and matcher.error is None
                return self.text(tokens), True
            tokens.append(token)
        return self.text(tokens), False


@pytest.fixture(scope="module")
def decoder(compiler: GrammarCompiler) -> Any:
    # One torch thread, as the masker itself runs: [1, V] ops split over two threads stall
    # on their barrier whenever another process holds a core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Decoder(compiler)
    torch.set_num_threads(threads)


def schema_check(schema: dict[str, Any]) -> Callable[[str], str | None]:
    validator = jsonschema.Draft202012Validator(schema)

    def check(text: str) -> str | None:
        try:
            value = json.loads(text)
        except ValueError as e:
            return f"not JSON: {e}"
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        return None if error is None else error.message

    return check


def closed(schema: Any) -> Any:
    """The schema as strict mode reads it: objects allow no unlisted properties."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum") else closed(v)) for k, v in schema.items()}
    if "properties" in schema or schema.get("type") == "object":
        out.setdefault("additionalProperties", False)
    if "properties" in schema:
        out["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
    return out


OPTIONAL_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                 "required": ["ok"], "additionalProperties": False},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
    },
    "required": ["id"],
    "additionalProperties": False,
}
# Strict closes objects that do not say: neither level here says additionalProperties.
OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                    "y": {"type": "integer"}},
                  "required": ["x", "y"]},
    },
    "required": ["name", "point"],
}

JSON_CASES: dict[str, tuple[dict[str, Any], bool]] = {
    "flat": (FLAT_SCHEMA, False),
    "nested": (NESTED_SCHEMA, False),
    "enum-200": (ENUM_SCHEMA, False),
    "tool-call-anyof-4": (TOOL_CALL_SCHEMA, False),
    "deep-20": (deep_schema(20), False),
    "optional-properties": (OPTIONAL_SCHEMA, False),
    "strict-closes-objects": (OPEN_SCHEMA, True),
}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", list(JSON_CASES))
def test_json_schema_outputs_validate(compiler: GrammarCompiler, decoder: Decoder, case: str,
                                      greedy: bool) -> None:
    schema, strict = JSON_CASES[case]
    check = schema_check(closed(schema) if strict else schema)
    for seed, whitespace in zip(SEEDS, [*Whitespace, *Whitespace], strict=False):
        grammar = compiler.compile(StructuredOutput.json_schema(schema, strict=strict,
                                                                whitespace=whitespace))
        text, ended = decoder.run(grammar, seed=seed, greedy=greedy, check=check)
        assert ended, text
        assert check(text) is None, text
        if whitespace is Whitespace.COMPACT:  # no whitespace outside strings
            assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text


def test_strict_refuses_what_the_open_schema_allows(compiler: GrammarCompiler) -> None:
    extra = '{"name":"a","point":{"x":1,"y":2},"z":3}'
    strict = compiler.compile(StructuredOutput.json_schema(OPEN_SCHEMA, strict=True,
                                                           whitespace=Whitespace.COMPACT))
    loose = compiler.compile(StructuredOutput.json_schema(OPEN_SCHEMA,
                                                          whitespace=Whitespace.COMPACT))
    tokens = compiler.tokenizer.tokenize_str(extra)
    assert loose.new_matcher().accept_prefix(tokens) == len(tokens)
    assert strict.new_matcher().accept_prefix(tokens) < len(tokens)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_json_object_outputs_parse_as_objects(compiler: GrammarCompiler, decoder: Decoder,
                                              greedy: bool) -> None:
    def check(text: str) -> str | None:
        try:
            value = json.loads(text)
        except ValueError as e:
            return f"not JSON: {e}"
        return None if isinstance(value, dict) else "not an object"

    grammar = compiler.compile(StructuredOutput.json_object())
    for seed in SEEDS:
        text, ended = decoder.run(grammar, seed=seed, greedy=greedy, check=check)
        assert ended and check(text) is None, text


REGEXES = {
    "iso-date": DATE_PATTERN,
    "email": EMAIL_PATTERN,
    "alternation": r"(a|b)*c[0-9]{2,4}",
    "words": r"(hello|hi) [A-Z][a-z]{1,8}!",
}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(REGEXES))
def test_regex_outputs_match(compiler: GrammarCompiler, decoder: Decoder, name: str,
                             greedy: bool) -> None:
    pattern = REGEXES[name]

    def check(text: str) -> str | None:
        return None if re.fullmatch(pattern, text) else "no full match"

    grammar = compiler.compile(StructuredOutput.regex(pattern))
    for seed in SEEDS:
        text, ended = decoder.run(grammar, seed=seed, greedy=greedy, check=check, exact=True)
        assert ended and re.fullmatch(pattern, text), text


CHOICES = ("yes", "no", "maybe later", "🚀 launch", 'say "hi"', "back\\slash", "new\nline", "")


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_choice_outputs_are_one_of_the_choices(compiler: GrammarCompiler, decoder: Decoder,
                                               greedy: bool) -> None:
    grammar = compiler.compile(StructuredOutput.choice(CHOICES))
    seen = set()
    for seed in range(8):
        text, ended = decoder.run(grammar, seed=seed, greedy=greedy,
                                  check=lambda t: None if t in CHOICES else "not a choice")
        assert ended and text in CHOICES, text
        seen.add(text)
    # Each choice is reachable: its tokens, fed one by one, are accepted, then EOS.
    for choice in CHOICES:
        matcher = grammar.new_matcher()
        tokens = decoder.compiler.tokenizer.tokenize_str(choice)
        assert matcher.accept_prefix(tokens) == len(tokens) and matcher.is_accepting, choice


def _balanced(text: str) -> str | None:
    depth = 0
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0 or char not in "()":
            return "unbalanced"
    return None if depth == 0 and text else "unbalanced"


GRAMMARS: dict[str, tuple[str, Callable[[str], str | None]]] = {
    "lark-regular": ('start: greeting " " NAME "!"\ngreeting: "hello" | "hi"\n'
                     "NAME: /[A-Z][a-z]{1,8}/",
                     lambda t: None if re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,8}!", t)
                     else "no match"),
    "lark-recursive": ('start: p+\np: "(" p* ")"', _balanced),
    "gbnf": ('root ::= item ("," item)*\nitem ::= [0-9] [0-9]?',
             lambda t: None if re.fullmatch(r"[0-9]{1,2}(,[0-9]{1,2})*", t) else "no match"),
}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(GRAMMARS))
def test_grammar_outputs_parse(compiler: GrammarCompiler, decoder: Decoder, name: str,
                               greedy: bool) -> None:
    text_grammar, check = GRAMMARS[name]
    grammar = compiler.compile(StructuredOutput.grammar(text_grammar))
    for seed in SEEDS:
        text, ended = decoder.run(grammar, seed=seed, greedy=greedy, check=check)
        assert ended and check(text) is None, text


def test_eos_is_refused_until_the_output_is_complete(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(StructuredOutput.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
         "additionalProperties": False}, whitespace=Whitespace.COMPACT))
    (eos,) = compiler.eos_token_ids
    matcher = grammar.new_matcher()
    bitmask = torch.zeros((1, (compiler.vocab_size + 31) // 32), dtype=torch.int32)
    for token in compiler.tokenizer.tokenize_str('{"a":12'):
        matcher.fill_bitmask(bitmask)
        assert not _allowed(bitmask[0], eos) and not matcher.is_accepting
        assert matcher.accept(token)
    (close,) = compiler.tokenizer.tokenize_str("}")
    assert matcher.accept(close)
    matcher.fill_bitmask(bitmask)
    assert _allowed_tokens(bitmask[0]) == [eos]  # complete, and nothing can follow
    assert matcher.is_accepting and matcher.is_finished

    early = grammar.new_matcher()
    assert early.accept_prefix(compiler.tokenizer.tokenize_str('{"a"')) > 0
    assert not early.accept(eos)  # EOS before the document is complete: refused
    assert early.error is not None and not early.is_finished
    early.fill_bitmask(bitmask)
    assert _allowed_tokens(bitmask[0]) == [eos]  # a failed matcher lets the request end


def test_rollback_restores_the_earlier_state(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(StructuredOutput.regex(r"abc[0-9]{3}"))
    matcher = grammar.new_matcher()
    tokens = compiler.tokenizer.tokenize_str("abc12")
    assert matcher.accept_prefix(tokens) == len(tokens)
    masks = torch.zeros((2, (compiler.vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(masks, 0)
    (digit,) = compiler.tokenizer.tokenize_str("3")
    assert matcher.accept(digit) and matcher.is_accepting
    matcher.rollback(1)
    matcher.fill_bitmask(masks, 1)
    assert torch.equal(masks[0], masks[1]) and matcher.num_tokens == len(tokens)
    with pytest.raises(AssertionError):
        matcher.rollback(len(tokens) + 1)
    matcher.rollback(len(tokens))
    assert matcher.num_tokens == 0 and matcher.error is None
    assert matcher.accept_prefix(compiler.tokenizer.tokenize_str("abc")) > 0


def test_forced_tokens_follow_the_grammar(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(StructuredOutput.json_schema(
        {"type": "object", "properties": {"temperature": {"type": "number"}},
         "required": ["temperature"], "additionalProperties": False},
        whitespace=Whitespace.COMPACT))
    forced = grammar.new_matcher().forced_tokens()
    assert compiler.tokenizer.decode_str(forced).startswith('{"temperature')


# ------------------------------------------------------------------ the batch mask


def _allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _allowed_tokens(row: torch.Tensor) -> list[int]:
    bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return bits.flatten().nonzero().flatten().tolist()


def _reference(logits: torch.Tensor, matcher: GrammarMatcher, vocab_size: int) -> torch.Tensor:
    """A row masked the obvious way: one token at a time from the matcher's own mask."""
    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(bitmask)
    out = torch.full_like(logits, float("-inf"))
    allowed = torch.tensor([t for t in _allowed_tokens(bitmask[0]) if t < vocab_size])
    out[allowed] = logits[allowed]
    return out


@pytest.mark.parametrize("num_threads", [None, 1], ids=["pool", "serial"])
@pytest.mark.parametrize("padding", [0, 17, 128])
def test_mixed_batch_masks_only_the_constrained_rows(compiler: GrammarCompiler, padding: int,
                                                     num_threads: int | None) -> None:
    specs = [StructuredOutput.json_schema(FLAT_SCHEMA), StructuredOutput.regex(EMAIL_PATTERN),
             StructuredOutput.choice(CHOICES), StructuredOutput.json_object()]
    grammars = [compiler.compile(spec) for spec in specs]
    vocab = compiler.vocab_size
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn((32, vocab + padding), generator=generator)  # [32, V + pad]
    logits[3, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45])
    # 16 of 32 rows, in runs and alone, not in row order; some matchers advanced a little.
    rows = [9, 10, 11, 12, 0, 1, 5, 7, 20, 21, 22, 30, 31, 15, 17, 25]
    matchers = []
    for i, _ in enumerate(rows):
        matcher = grammars[i % len(grammars)].new_matcher()
        prefix = ['{"id":', "kestrel", "ma", "{"][i % len(grammars)] if i % 3 else ""
        matcher.accept_prefix(compiler.tokenizer.tokenize_str(prefix))
        matchers.append(matcher)
    before = logits.clone()
    masker = TokenMasker(vocab, max_rows=8, num_threads=num_threads)  # grows to 16 rows
    masker(logits, rows, matchers)

    free = [r for r in range(32) if r not in rows]
    assert torch.equal(logits[free].view(torch.int32), before[free].view(torch.int32))
    for row, matcher in zip(rows, matchers, strict=True):
        expected = _reference(before[row], matcher, vocab)
        assert torch.equal(logits[row], expected), row
        assert torch.isfinite(logits[row]).any()


def test_fill_and_apply_apart_equal_the_combined_call(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(StructuredOutput.regex(DATE_PATTERN))
    matchers = [grammar.new_matcher() for _ in range(3)]
    matchers[1].accept_prefix(compiler.tokenizer.tokenize_str("2024-"))
    logits = torch.randn((5, compiler.vocab_size))
    split, combined = logits.clone(), logits.clone()
    masker = TokenMasker(compiler.vocab_size, max_rows=4)
    bitmask = masker.fill(matchers)
    assert bitmask.shape == (3, (compiler.vocab_size + 31) // 32)
    masker.apply(split, [4, 0, 2], bitmask)
    TokenMasker(compiler.vocab_size)(combined, [4, 0, 2], matchers)
    assert torch.equal(split.view(torch.int32), combined.view(torch.int32))
    masker.apply(split, [], masker.fill([]))  # a step with no constrained row
    assert torch.equal(split.view(torch.int32), combined.view(torch.int32))


def test_batch_mask_refuses_a_matcher_twice_and_narrow_logits(compiler: GrammarCompiler
                                                              ) -> None:
    matcher = compiler.compile(StructuredOutput.regex("[a-z]+")).new_matcher()
    masker = TokenMasker(compiler.vocab_size)
    with pytest.raises(AssertionError):
        masker.fill([matcher, matcher])
    with pytest.raises(AssertionError):
        masker(torch.zeros((1, compiler.vocab_size - 1)), [0], [matcher])


def test_a_wider_model_vocabulary_and_extra_eos_tokens(hf_tokenizer: Any) -> None:
    """The model's logits are wider than the tokenizer (padded to 49,169 here, not a
    multiple of 32) and two tokens end a request: both EOS tokens open exactly when the
    output is complete, the padding never."""
    vocab = len(hf_tokenizer) + 17
    compiler = GrammarCompiler(hf_tokenizer, vocab_size=vocab, eos_token_ids=[2, 0])
    try:
        assert compiler.vocab_size == vocab and compiler.eos_token_ids == (2, 0)
        grammar = compiler.compile(StructuredOutput.choice(["yes", "no"]))
        masker = TokenMasker(vocab)
        for text, complete in (("", False), ("ye", False), ("yes", True)):
            matcher = grammar.new_matcher()
            tokens = compiler.tokenizer.tokenize_str(text)
            assert matcher.accept_prefix(tokens) == len(tokens)
            logits = torch.zeros((1, vocab))
            masker(logits, [0], [matcher])
            allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
            assert all(t < len(hf_tokenizer) for t in allowed)
            assert (0 in allowed, 2 in allowed) == (complete, complete), text
        assert matcher.accept(0) and matcher.is_finished
    finally:
        compiler.close()
