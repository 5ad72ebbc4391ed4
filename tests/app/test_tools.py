"""A request's tools checked, and the constraints of `tool_choice` compiled with the
engine's grammar compiler and decoded from random logits under the real SmolLM2
tokenizer's masks: every output parses into valid calls whose arguments validate against
their function's schema."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from app.api.errors import APIError
from app.api.openai.protocol import ChatTool, NamedToolChoice, ToolChoice
from app.api.openai.tool_calls import ToolCallStreamParser, parse_tool_calls
from app.api.openai.tools import (
    INVALID_TOOL_CHOICE,
    INVALID_TOOLS,
    MAX_TOOLS,
    TOO_MANY_TOOLS,
    arguments_schema,
    tool_constraint,
    tool_plan,
)
from engine.models.loader import load_tokenizer
from engine.structured import (
    CompiledGrammar,
    GrammarCompiler,
    OutputKind,
    StructuredOutputError,
    TokenMasker,
)

MAX_TOKENS = 500


def tool(name: str, parameters: dict[str, Any] | None = None, *, strict: bool | None = None,
         description: str | None = None) -> ChatTool:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    if strict is not None:
        function["strict"] = strict
    if description is not None:
        function["description"] = description
    return ChatTool.model_validate({"type": "function", "function": function})


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


WEATHER = tool("get_weather", {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12, "description": "a city // # } \"x\""},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}, description="The weather now: see http://example.com/#weather {}")
# Strict, with pydantic's $defs and $refs (re-rooted under the call's "arguments").
ADD = tool("add", {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$defs": {"Operand": {"type": "object", "properties": {
        "value": {"type": "integer", "minimum": -99, "maximum": 99}}, "required": ["value"]}},
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/Operand"}, "b": {"$ref": "#/$defs/Operand"}},
    "required": ["a", "b"],
}, strict=True)
SEARCH = tool("search-web", {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 10},
                   "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
                   "tags": {"type": "array", "items": {"enum": ["news", "maps"]},
                            "maxItems": 2}},
    "required": ["query", "max_results"],
    "additionalProperties": False,
})
NOARGS = tool("now")  # no parameters: takes {}
TOOLS = [WEATHER, ADD, SEARCH, NOARGS]


def closed(schema: Any) -> Any:
    """A schema as strict mode reads it: objects allow no unlisted properties."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum") else closed(v)) for k, v in schema.items()}
    if "properties" in schema or schema.get("type") == "object":
        out.setdefault("additionalProperties", False)
    for key in ("properties", "$defs"):
        if key in schema:
            out[key] = {k: closed(v) for k, v in schema[key].items()}
    return out


def validator(chat_tool: ChatTool) -> jsonschema.Draft202012Validator:
    function = chat_tool.function
    schema = function.parameters or {"type": "object", "properties": {},
                                     "additionalProperties": False}
    return jsonschema.Draft202012Validator(closed(schema) if function.strict else schema)


# ------------------------------------------------------------------ checks


def refusal(tools: list[ChatTool] | None, choice: ToolChoice | None = None) -> APIError:
    with pytest.raises(APIError) as info:
        tool_plan(tools, choice)
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize("name", ["", "has space", "dots.not.allowed", "a" * 65, "émoji",
                                  "semi;colon"])
def test_bad_names_are_refused(name: str) -> None:
    error = refusal([WEATHER, tool(name)])
    assert (error.param, error.code) == ("tools[1].function.name", INVALID_TOOLS)


def test_good_names_pass() -> None:
    plan = tool_plan([tool("a"), tool("A-b_9"), tool("x" * 64)], None)
    assert plan.names == {"a", "A-b_9", "x" * 64} and plan.mode == "auto"


def test_duplicate_names_are_refused() -> None:
    error = refusal([WEATHER, SEARCH, tool("get_weather")])
    assert (error.param, error.code) == ("tools[2].function.name", INVALID_TOOLS)
    assert "get_weather" in error.message


@pytest.mark.parametrize("parameters", [
    {"type": "string"}, {"type": "array", "items": {}}, {"type": ["object", "null"]},
    {"anyOf": [{"type": "object"}]},
])
def test_parameters_must_be_an_object_schema(parameters: dict[str, Any]) -> None:
    error = refusal([tool("f", parameters)])
    assert (error.param, error.code) == ("tools[0].function.parameters", INVALID_TOOLS)


def test_too_deep_parameters_are_refused() -> None:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(80):
        schema = {"type": "object", "properties": {"x": schema}}
    error = refusal([tool("f", schema)])
    assert error.param == "tools[0].function.parameters"


def test_too_many_tools_are_refused() -> None:
    assert len(tool_plan([tool(f"f{i}") for i in range(MAX_TOOLS)], None).functions) == \
        MAX_TOOLS
    error = refusal([tool(f"f{i}") for i in range(MAX_TOOLS + 1)])
    assert (error.param, error.code) == ("tools", TOO_MANY_TOOLS)


def test_tool_choice_must_name_a_tool() -> None:
    error = refusal(TOOLS, named("delete_everything"))
    assert (error.param, error.code) == ("tool_choice", INVALID_TOOL_CHOICE)
    assert refusal(None, named("add")).param == "tool_choice"
    assert refusal(None, "required").param == "tool_choice"
    assert refusal([], "required").code == INVALID_TOOL_CHOICE


def test_plans() -> None:
    assert tool_plan(None, None).functions == () and tool_plan(None, "auto").functions == ()
    assert tool_plan(TOOLS, "none").functions == ()  # tools ignored entirely
    assert tool_constraint(TOOLS, "none") is None and tool_constraint(None, None) is None
    auto = tool_plan(TOOLS, None)
    assert (auto.mode, auto.parallel, len(auto.functions)) == ("auto", True, 4)
    assert tool_plan(TOOLS, "auto", False).parallel is False
    required = tool_plan(TOOLS, "required", None)
    assert (required.mode, required.parallel) == ("required", True)
    one = tool_plan(TOOLS, named("add"), True)
    assert (one.mode, one.named, one.parallel) == ("named", "add", False)


def test_arguments_schema_reroots_refs_and_fills_no_parameters() -> None:
    schema = arguments_schema(ADD.function)
    assert schema["properties"]["a"] == {"$ref": "#/properties/arguments/$defs/Operand"}
    assert "$schema" not in schema
    assert ADD.function.parameters is not None
    assert ADD.function.parameters["properties"]["a"] == {"$ref": "#/$defs/Operand"}
    assert arguments_schema(NOARGS.function) == {
        "type": "object", "properties": {}, "additionalProperties": False}
    assert arguments_schema(tool("f", {}).function)["additionalProperties"] is False


def test_constraints_are_grammars() -> None:
    spec = tool_constraint(TOOLS, "auto")
    assert spec is not None and spec.kind is OutputKind.GRAMMAR
    assert spec.text.count("%json") == 4
    only = tool_constraint(TOOLS, named("now"))
    assert only is not None and only.text.count("%json") == 1


# ------------------------------------------------------------------ decoding


@pytest.fixture(scope="module")
def compiler(smollm2_dir: Path) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(load_tokenizer(smollm2_dir), compile_timeout_s=60.0)
    yield compiler
    compiler.close()


class Decoder:
    """Random logits -> the grammar's mask -> a token, until EOS; biased toward tokens
    that close strings and objects, so that documents end."""

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
            if not piece.strip():
                bias[token] = -4.0
            elif b'"' in piece or b"}" in piece or b"]" in piece:
                bias[token] = 2.0
        bias[self.eos] = 4.0
        self.bias = bias  # [V]

    def run(self, grammar: CompiledGrammar, *, seed: int, prefix: str = "") -> str:
        generator = torch.Generator().manual_seed(seed)
        matcher = grammar.new_matcher()
        tokens = self.compiler.tokenizer.tokenize_str(prefix) if prefix else []
        assert matcher.accept_prefix(tokens) == len(tokens), prefix
        for step in range(MAX_TOKENS):
            logits = torch.randn((1, self.vocab_size), generator=generator)  # [1, V]
            logits += self.bias * (1.0 + step / 16)
            self.masker(logits, [0], [matcher])
            probs = torch.softmax(logits[0], dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            assert matcher.accept(token), matcher.error
            if token == self.eos:
                assert matcher.is_finished
                return self.compiler.tokenizer.decode_bytes(tokens).decode()
            tokens.append(token)
        raise AssertionError(f"no EOS within {MAX_TOKENS} tokens: "
                             f"{self.compiler.tokenizer.decode_bytes(tokens)!r}")


@pytest.fixture(scope="module")
def decoder(compiler: GrammarCompiler) -> Decoder:
    return Decoder(compiler)


def check_output(text: str, tools: list[ChatTool]) -> tuple[str | None, list[Any]]:
    """Parse `text`, validate every call, and check the stream parses it the same."""
    by_name = {t.function.name: t for t in tools}
    content, calls = parse_tool_calls(text, by_name)
    for call in calls:
        arguments = json.loads(call.function.arguments)
        errors = list(validator(by_name[call.function.name]).iter_errors(arguments))
        assert not errors, (call, errors[0].message)
    parser = ToolCallStreamParser(by_name)
    pieces: dict[int, str] = {}
    for i in range(0, len(text), 3):
        for delta in parser.feed(text[i:i + 3]):
            for piece in delta.tool_calls or ():
                pieces[piece.index] = pieces.get(piece.index, "") + (
                    piece.function.arguments or "")
    for delta in parser.finish():
        for piece in delta.tool_calls or ():
            pieces[piece.index] = pieces.get(piece.index, "") + (piece.function.arguments or "")
    assert list(pieces.values()) == [c.function.arguments for c in calls]
    return content, calls


SEEDS = range(6)


@pytest.mark.parametrize("parallel", [None, False], ids=["parallel", "single"])
def test_required_outputs_are_only_valid_calls(compiler: GrammarCompiler, decoder: Decoder,
                                               parallel: bool | None) -> None:
    spec = tool_constraint(TOOLS, "required", parallel)
    assert spec is not None
    grammar = compiler.compile(spec)
    names: set[str] = set()
    for seed in SEEDS:
        text = decoder.run(grammar, seed=seed)
        content, calls = check_output(text, TOOLS)
        assert content is None and calls, text
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        if parallel is False:
            assert len(calls) == 1
        names.update(c.function.name for c in calls)
    assert len(names) >= 2  # the random logits reach several functions
    # Parallel calls, written out, are accepted when parallel calls are on only.
    two = ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    matcher = grammar.new_matcher()
    tokens = compiler.tokenizer.tokenize_str(two)
    assert (matcher.accept_prefix(tokens) == len(tokens)) == (parallel is None)


@pytest.mark.parametrize("name", ["get_weather", "add", "search-web", "now"])
def test_named_outputs_are_one_call_of_that_function(compiler: GrammarCompiler,
                                                     decoder: Decoder, name: str) -> None:
    spec = tool_constraint(TOOLS, named(name))
    assert spec is not None
    grammar = compiler.compile(spec)
    for seed in SEEDS[:3]:
        text = decoder.run(grammar, seed=seed)
        content, calls = check_output(text, TOOLS)
        assert content is None and [c.function.name for c in calls] == [name], text


def test_auto_outputs_are_text_or_valid_calls(compiler: GrammarCompiler,
                                              decoder: Decoder) -> None:
    spec = tool_constraint(TOOLS, "auto")
    assert spec is not None
    grammar = compiler.compile(spec)
    texts = [decoder.run(grammar, seed=seed) for seed in SEEDS]
    for text in texts:
        _, calls = check_output(text, TOOLS)
        assert ("<tool_call>" in text) == bool(calls), text
    # Once the model writes the tag, with or without text before it, calls follow.
    for seed, prefix in enumerate(["<tool_call>\n", "Let me look that up. <tool_call>\n",
                                   "<b>ok</b>\n<tool_call>\n"]):
        text = decoder.run(grammar, seed=seed, prefix=prefix)
        content, calls = check_output(text, TOOLS)
        assert calls, text
        assert content == (prefix.split("<tool_call>")[0].strip() or None)


def test_auto_free_text_may_hold_anything_but_the_tag(compiler: GrammarCompiler) -> None:
    spec = tool_constraint(TOOLS, "auto")
    assert spec is not None
    grammar = compiler.compile(spec)

    def accepted(text: str) -> bool:
        matcher = grammar.new_matcher()
        tokens = compiler.tokenizer.tokenize_str(text)
        return matcher.accept_prefix(tokens) == len(tokens) and matcher.is_accepting

    assert accepted("<p>Plain text</p>, even <tool_call without its bracket")
    assert accepted("")
    assert accepted('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not accepted("Text <tool_call>\nwith the tag but no call")
    assert not accepted('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call> after')
    assert not accepted('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>')
    # Strict functions: no properties beyond those listed, at any depth.
    assert accepted('<tool_call>\n{"name": "add", "arguments": {"a": {"value": 1}, '
                    '"b": {"value": -2}}}\n</tool_call>')
    assert not accepted('<tool_call>\n{"name": "add", "arguments": {"a": {"value": 1, '
                        '"x": 0}, "b": {"value": 2}}}\n</tool_call>')
    # Not strict: the schema as given (additional properties allowed where it says nothing).
    assert accepted('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
                    '"wind": true}}\n</tool_call>')


def test_strict_refuses_keywords_the_grammar_cannot_enforce(compiler: GrammarCompiler) -> None:
    parameters = {"type": "object", "properties": {"when": {"type": "string",
                                                            "format": "no-such-format"}}}
    loose = tool_constraint([tool("f", parameters)], "required")
    assert loose is not None
    compiler.compile(loose)
    strict = tool_constraint([tool("f", copy.deepcopy(parameters), strict=True)], "required")
    assert strict is not None
    with pytest.raises(StructuredOutputError):
        compiler.compile(strict)
