"""Property: for any schema of a small generated family (objects with required and optional
properties, arrays, enums, consts, bounded integers, string lengths and patterns, anyOf),
every document decoded under its mask from random logits validates against it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.models.loader import load_tokenizer
from engine.structured import GrammarCompiler, StructuredOutput, Whitespace
from tests.engine.test_structured import Decoder, schema_check

NAMES = ("id", "name", "tags", "kind", "x")
PATTERNS = ("^[a-z]{1,4}$", "^[A-Z][0-9]{2}$", "^(red|green|blue)$")
SCALARS = st.one_of(st.integers(-50, 50), st.sampled_from(["a", "b c", "d\"e", "é"]),
                    st.booleans(), st.none())


@st.composite
def integers(draw: st.DrawFn) -> dict[str, Any]:
    low = draw(st.integers(-1000, 1000))
    return {"type": "integer", "minimum": low, "maximum": low + draw(st.integers(0, 500))}


@st.composite
def strings(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.booleans()):
        return {"type": "string", "pattern": draw(st.sampled_from(PATTERNS))}
    low = draw(st.integers(0, 3))
    return {"type": "string", "minLength": low, "maxLength": low + draw(st.integers(0, 10))}


LEAVES = st.one_of(
    integers(),
    strings(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.just({"type": "number"}),
    st.lists(SCALARS, min_size=1, max_size=5, unique=True).map(lambda v: {"enum": v}),
    SCALARS.map(lambda v: {"const": v}),
)


@st.composite
def objects(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    properties = {name: draw(children) for name in names}
    required = [name for name in names if draw(st.booleans())]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


@st.composite
def arrays(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    low = draw(st.integers(0, 2))
    return {"type": "array", "items": draw(children), "minItems": low,
            "maxItems": low + draw(st.integers(0, 3))}


def _composites(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    return st.one_of(objects(children), arrays(children),
                     st.lists(children, min_size=2, max_size=3).map(lambda s: {"anyOf": s}))


SCHEMAS = st.recursive(LEAVES, _composites, max_leaves=8)


@pytest.fixture(scope="module")
def decoder(smollm2_dir: Path) -> Any:
    compiler = GrammarCompiler(load_tokenizer(smollm2_dir), compile_timeout_s=30.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Decoder(compiler)
    torch.set_num_threads(threads)
    compiler.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, strict=st.booleans(), whitespace=st.sampled_from(list(Whitespace)),
       greedy=st.booleans(), seed=st.integers(0, 2**16))
def test_decoded_documents_validate(decoder: Decoder, schema: dict[str, Any], strict: bool,
                                    whitespace: Whitespace, greedy: bool, seed: int) -> None:
    grammar = decoder.compiler.compile(
        StructuredOutput.json_schema(schema, strict=strict, whitespace=whitespace))
    check = schema_check(schema)
    text, ended = decoder.run(grammar, seed=seed, greedy=greedy, check=check)
    assert ended, text
    assert check(text) is None, text
    if whitespace is Whitespace.COMPACT:
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text
