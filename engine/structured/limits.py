"""How large and complex a structured-output spec may be, checked before and by llguidance.

Ours are checked on the request's text before llguidance sees it: its size, the nesting of
a schema's JSON, the enum values and regex patterns in it, the choices of a list. The rest
are llguidance's own budgets (`LLParserLimits`), set explicitly here rather than left to
the library's defaults, so that they are part of our configuration and named in errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import llguidance

from engine.structured.errors import (
    GRAMMAR_TOO_COMPLEX,
    INVALID_GRAMMAR,
    GrammarLimitError,
    StructuredOutputError,
)

_MAX_MESSAGE_CHARS = 600


@dataclass(frozen=True, slots=True)
class StructuredLimits:
    # --- checked by us, before the library
    max_spec_bytes: int = 128 * 1024  # schema, regex or grammar text; all choices together
    max_json_depth: int = 64  # nesting of objects and arrays in a schema's JSON text
    max_enum_values: int = 1000  # all `enum` values of one schema together
    max_choices: int = 1000  # strings in a choice list
    max_regex_chars: int = 4096  # a regex, and each `pattern` of a schema
    # Whitespace.FLEXIBLE: a gap between JSON tokens is nothing, one space, or a newline
    # and at most this many spaces or tabs of indentation (see `whitespace_pattern`).
    max_whitespace_chars: int = 16
    # --- llguidance's LLParserLimits (its defaults in 1.9)
    max_items_in_row: int = 2000  # branching of one grammar rule
    initial_lexer_fuel: int = 1_000_000  # building the lexer (~50k/ms)
    step_lexer_fuel: int = 200_000  # one token mask's lexer work (~14k/ms)
    step_max_items: int = 50_000  # one token mask's Earley items (~20k/ms)
    max_lexer_states: int = 250_000  # lexer states (1-2 kB each)
    max_grammar_size: int = 500_000  # symbols in the grammar's productions

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            # Large regexes run over the whole token trie at build time, inside the compile
            # timeout, rather than during decoding steps.
            precompute_large_lexemes=True,
            # Parser state dumps make errors long and say nothing a user can act on.
            verbose_errors=False,
        )


# llguidance's messages for its budgets -> the LLParserLimits field that bounds each.
_LIBRARY_LIMITS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"initial lexer configuration .*too big"), "initial_lexer_fuel"),
    (re.compile(r"grammar size .*too big"), "max_grammar_size"),
    (re.compile(r"too many expressions constructed"), "step_lexer_fuel"),
    (re.compile(r"[Tt]oo many items"), "step_max_items"),
    (re.compile(r"too many states"), "max_lexer_states"),
)
# Budgets of llguidance's that LLParserLimits does not set.
_INTERNAL = re.compile(r"DNF too large|schema too large|class too large")
# Nesting beyond what llguidance's parsers of schemas and grammars take.
_NESTING = re.compile(r"recursion limit exceeded|too deeply nested")


def clean_message(message: str) -> str:
    """llguidance's message without its state dump, cut to a readable length."""
    for marker in ("\n<state>", "\n<non-verbose/>", "\n<backtrace>"):
        message = message.split(marker, 1)[0]
    message = message.strip()
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "..."
    return message


def library_refusal(message: str, what: str, limits: StructuredLimits) -> StructuredOutputError:
    """The error for a grammar llguidance refused with `message`; `what` names the spec
    ("JSON schema", "regex"...). A budget it ran out of is named as our limit field."""
    text = clean_message(message)
    for pattern, limit in _LIBRARY_LIMITS:
        if pattern.search(text):
            value = getattr(limits, limit)
            return GrammarLimitError(
                f"the {what} is too complex: it exceeds the grammar limit {limit} "
                f"({value:,}): {text}", code=GRAMMAR_TOO_COMPLEX, limit=limit)
    if _INTERNAL.search(text):
        return GrammarLimitError(f"the {what} is too complex: {text}", code=GRAMMAR_TOO_COMPLEX)
    if _NESTING.search(text):
        return GrammarLimitError(f"the {what} is nested too deeply: {text}",
                                 code=GRAMMAR_TOO_COMPLEX)
    return StructuredOutputError(f"invalid {what}: {text}", code=INVALID_GRAMMAR)


def over_limit(what: str, limit: str, value: int, found: str) -> GrammarLimitError:
    """E.g. "the JSON schema exceeds max_json_depth (64): it nests 81 deep"."""
    return GrammarLimitError(f"the {what} exceeds {limit} ({value:,}): it has {found}",
                             limit=limit)


def whitespace_pattern(limits: StructuredLimits) -> str:
    """The regex of a gap between the tokens of a JSON document (Whitespace.FLEXIBLE):
    enough to pretty-print, never a run of blank lines.

    NOTE: one newline at most per gap: with any run of whitespace allowed (say up to 64
    characters a gap), a weak model can fill `max_tokens` with blank space across the few
    dozen gaps of a nested document."""
    return f"(?:\\x20|\\x0A[\\x20\\x09]{{0,{limits.max_whitespace_chars}}})?"
