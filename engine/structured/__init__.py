"""Structured outputs: a request's output constrained to a JSON schema, a regex, a grammar
or a list of choices, through token masks from llguidance.

The API turns `response_format` / `guided_*` / tool schemas into a `StructuredOutput`; the
engine compiles it once per spec with its `GrammarCompiler` (off the step loop, cached),
gives each request a `GrammarMatcher` from the `CompiledGrammar`, and each step masks the
constrained rows of the logits with a `TokenMasker` before sampling.
"""

from engine.structured.compiler import GrammarCacheStats, GrammarCompiler
from engine.structured.errors import (
    GRAMMAR_TIMEOUT,
    GRAMMAR_TOO_COMPLEX,
    INVALID_GRAMMAR,
    INVALID_SPEC,
    GrammarLimitError,
    GrammarTimeoutError,
    StructuredOutputError,
)
from engine.structured.grammar import to_grammar
from engine.structured.limits import StructuredLimits
from engine.structured.matcher import (
    CompiledGrammar,
    GrammarMatcher,
    TokenMasker,
    num_bitmask_words,
)
from engine.structured.spec import OutputKind, StructuredOutput, Whitespace

__all__ = [
    "GRAMMAR_TIMEOUT",
    "GRAMMAR_TOO_COMPLEX",
    "INVALID_GRAMMAR",
    "INVALID_SPEC",
    "CompiledGrammar",
    "GrammarCacheStats",
    "GrammarCompiler",
    "GrammarLimitError",
    "GrammarMatcher",
    "GrammarTimeoutError",
    "OutputKind",
    "StructuredLimits",
    "StructuredOutput",
    "StructuredOutputError",
    "TokenMasker",
    "Whitespace",
    "num_bitmask_words",
    "to_grammar",
]
