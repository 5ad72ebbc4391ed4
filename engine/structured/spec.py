"""What a request asks its output to be: a JSON object, a JSON schema, a regex, a grammar or
one of a list of choices.

`StructuredOutput` is immutable and hashable: it is the key of the compiled-grammar cache,
so two requests with the same spec share one compile. The API builds one from
`response_format` (json_object, json_schema strict or not), `structured_outputs` /
`guided_json`, `guided_regex`, `guided_grammar` and `guided_choice`, or from a tool's
parameter schema; the engine hands it to `GrammarCompiler`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.structured.errors import INVALID_SPEC, StructuredOutputError


class OutputKind(enum.StrEnum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # a document valid against value (the schema as JSON text)
    REGEX = "regex"  # the whole output matches value (Rust regex syntax, anchored)
    GRAMMAR = "grammar"  # value in Lark syntax (GBNF is accepted and converted)
    CHOICE = "choice"  # exactly one of value (a tuple of strings)


class Whitespace(enum.StrEnum):
    """Whitespace between the tokens of a JSON document."""

    # Per gap: nothing, a space, or a newline and at most
    # StructuredLimits.max_whitespace_chars of indentation: the model may pretty-print,
    # but cannot loop on blank space.
    FLEXIBLE = "flexible"
    COMPACT = "compact"  # none at all: {"a":1,"b":[2,3]}


_JSON_KINDS = (OutputKind.JSON_OBJECT, OutputKind.JSON_SCHEMA)
_TEXT_KINDS = (OutputKind.JSON_SCHEMA, OutputKind.REGEX, OutputKind.GRAMMAR)


def _refuse(message: str) -> StructuredOutputError:
    return StructuredOutputError(message, code=INVALID_SPEC)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One request's output constraint. Build it with the class methods.

    `strict` (JSON schemas only) follows OpenAI's strict structured outputs: objects that do
    not say otherwise allow no properties beyond those listed, and a keyword the grammar
    cannot enforce is an error. Not strict: unknown properties are allowed where the
    schema does not forbid them (JSON Schema's default), and keywords the grammar cannot
    enforce are ignored (the output is then checked against the rest of the schema only).
    """

    kind: OutputKind
    value: str | tuple[str, ...] | None = None
    strict: bool = False
    whitespace: Whitespace = Whitespace.FLEXIBLE

    def __post_init__(self) -> None:
        try:
            kind = OutputKind(self.kind)
            whitespace = Whitespace(self.whitespace)
        except ValueError as e:
            raise _refuse(f"unknown structured output setting: {e}") from None
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "whitespace", whitespace)
        value = self.value
        if kind is OutputKind.JSON_OBJECT:
            if value is not None:
                raise _refuse("a json_object output takes no value")
        elif kind is OutputKind.CHOICE:
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise _refuse("a choice output takes a list of strings")
            choices = tuple(value)
            if not choices:
                raise _refuse("a choice output needs at least one choice")
            if not all(isinstance(c, str) for c in choices):
                raise _refuse("every choice must be a string")
            object.__setattr__(self, "value", choices)
        elif not isinstance(value, str) or not value.strip():
            raise _refuse(f"a {kind.value} output needs a non-empty string")
        if self.strict and kind is not OutputKind.JSON_SCHEMA:
            raise _refuse("strict applies to JSON schemas only")
        if whitespace is not Whitespace.FLEXIBLE and kind not in _JSON_KINDS:
            raise _refuse("a whitespace policy applies to JSON outputs only")

    @classmethod
    def json_object(cls, *, whitespace: Whitespace = Whitespace.FLEXIBLE) -> StructuredOutput:
        return cls(OutputKind.JSON_OBJECT, whitespace=whitespace)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str, *, strict: bool = False,
                    whitespace: Whitespace = Whitespace.FLEXIBLE) -> StructuredOutput:
        """`schema` as parsed JSON or as JSON text (kept as given: property order matters,
        it is the order the model writes them in)."""
        if not isinstance(schema, str):
            try:
                schema = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
            except (TypeError, ValueError, RecursionError) as e:
                raise _refuse(f"the JSON schema is not serialisable JSON: {e}") from None
        return cls(OutputKind.JSON_SCHEMA, schema, strict=strict, whitespace=whitespace)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls(OutputKind.REGEX, pattern)

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        return cls(OutputKind.GRAMMAR, text)

    @classmethod
    def choice(cls, choices: Iterable[str]) -> StructuredOutput:
        if isinstance(choices, str):
            raise _refuse("a choice output takes a list of strings")
        return cls(OutputKind.CHOICE, tuple(choices))

    @property
    def choices(self) -> tuple[str, ...]:
        assert self.kind is OutputKind.CHOICE and isinstance(self.value, tuple)
        return self.value

    @property
    def text(self) -> str:
        """The schema, regex or grammar text."""
        assert self.kind in _TEXT_KINDS and isinstance(self.value, str)
        return self.value

    @property
    def num_bytes(self) -> int:
        """Size of what the request sent (the schema, regex, grammar or all choices)."""
        if self.value is None:
            return 0
        if isinstance(self.value, str):
            return len(self.value.encode())
        return sum(len(c.encode()) for c in self.value)

    def describe(self) -> str:
        return {
            OutputKind.JSON_OBJECT: "JSON object",
            OutputKind.JSON_SCHEMA: "JSON schema",
            OutputKind.REGEX: "regex",
            OutputKind.GRAMMAR: "grammar",
            OutputKind.CHOICE: "choice list",
        }[self.kind]
