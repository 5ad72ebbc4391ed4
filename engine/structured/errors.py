"""Why a structured-output request is refused: a code for the API and a message for the user.

Every refusal is a `RequestRejected` (so a `ValueError`: the client's input is at fault, an
HTTP 400), and crosses the worker wire as one. `code` is stable and machine-readable;
`limit` names the limit that was hit, when one was (a `StructuredLimits` field, ours or
one of llguidance's), so an operator knows which knob to turn and a user what to shrink;
the message names it too, as the wire keeps only code, param and message.
"""

from __future__ import annotations

from engine.errors import RequestRejected

# The request's spec is malformed (wrong kind, empty choice list, not JSON...).
INVALID_SPEC = "invalid_structured_output"
# The grammar library refused the schema, regex or grammar (syntax, unsupported keyword,
# unsatisfiable constraint).
INVALID_GRAMMAR = "invalid_grammar"
# Larger or more complex than a limit allows.
GRAMMAR_TOO_COMPLEX = "grammar_too_complex"
# Compiling it took longer than the compiler's timeout.
GRAMMAR_TIMEOUT = "grammar_compile_timeout"


class StructuredOutputError(RequestRejected):
    """A structured-output spec the engine will not serve. `param`: the request field
    that held it, where the caller knows (e.g. "response_format")."""

    def __init__(self, message: str, *, code: str, limit: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message, code=code, param=param)
        self.message = message
        self.limit = limit

    def clone(self) -> StructuredOutputError:
        """A fresh exception with the same content (a cached refusal is raised anew each
        time, so tracebacks of different requests never mix)."""
        return _rebuild(type(self), self.message, self.code, self.limit, self.param)

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments: the default pickling would call cls(message) alone.
        return (_rebuild, (type(self), self.message, self.code, self.limit, self.param))


class GrammarLimitError(StructuredOutputError):
    """The spec exceeds a size or complexity limit; `limit` names it."""

    def __init__(self, message: str, *, code: str = GRAMMAR_TOO_COMPLEX,
                 limit: str | None = None, param: str | None = None) -> None:
        super().__init__(message, code=code, limit=limit, param=param)


class GrammarTimeoutError(StructuredOutputError):
    """The grammar did not compile within `compile_timeout_s`."""

    def __init__(self, message: str, *, code: str = GRAMMAR_TIMEOUT,
                 limit: str | None = "compile_timeout_s", param: str | None = None) -> None:
        super().__init__(message, code=code, limit=limit, param=param)


def _rebuild(cls: type[StructuredOutputError], message: str, code: str, limit: str | None,
             param: str | None) -> StructuredOutputError:
    return cls(message, code=code, limit=limit, param=param)
