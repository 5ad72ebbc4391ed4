"""What an engine raises to its callers: one base class, each error with a stable `code`.

The code names the error across the worker wire (engine/remote/protocol.py decodes it back
into the same class) and lets the app map engine errors to API errors in one place.
Errors a request causes are also ValueErrors; those of the engine or its transport are
RuntimeErrors.
"""

from __future__ import annotations

__all__ = [
    "AdapterError",
    "AdapterLoadError",
    "EngineDeadError",
    "EngineError",
    "EngineStepError",
    "EngineUnavailable",
    "NoWorkerAvailable",
    "RequestRejected",
    "WorkerLost",
    "error_class",
]


class EngineError(Exception):
    """Base of every error an engine raises on purpose."""

    code: str = "engine_error"


class RequestRejected(EngineError, ValueError):
    """A request the engine can never serve (too long for the context or the KV cache,
    token ids outside the vocabulary, an adapter it does not serve). `code` says which
    (e.g. context_length_exceeded, model_not_found); `param` names the request field."""

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments: the default pickling would call cls(message) alone (the
        # engine's own process sends its refusals to the server's, engine/core_process.py).
        return (_rebuild_rejected, (type(self), str(self), self.code, self.param))


def _rebuild_rejected(
    cls: type[RequestRejected], message: str, code: str, param: str | None
) -> RequestRejected:
    return cls(message, code=code, param=param)


class AdapterError(EngineError, ValueError):
    """An adapter that cannot be served; the message says why, for the operator."""

    code = "invalid_adapter"


class AdapterLoadError(EngineError, RuntimeError):
    """The adapter a waiting request named could not be loaded from disk (a file changed
    or vanished since it was validated, or memory ran out)."""

    code = "adapter_load_failed"


class EngineStepError(EngineError, RuntimeError):
    """The engine step that ran this request failed on it; the engine serves on."""

    code = "engine_step_failed"


class EngineDeadError(EngineError, RuntimeError):
    """The engine failed for good or shut down; requests in flight end with this error.

    `failure` names what failed (`EngineDeadError.failed`); it is None for a shutdown.
    """

    code = "engine_failed"

    def __init__(self, message: str, failure: str | None = None) -> None:
        super().__init__(message)
        self.failure = failure

    @classmethod
    def failed(cls, reason: str) -> EngineDeadError:
        """The engine failed for good because of `reason` (not a shutdown)."""
        return cls(f"engine failed: {reason}", reason)


class EngineUnavailable(EngineError, RuntimeError):
    """The engine cannot take this call now, but may soon (on a gateway: no worker is in
    rotation yet, or none answered): the caller answers 503 with Retry-After."""

    code = "engine_unavailable"


class AdapterUnavailable(EngineUnavailable):
    """The adapter's files cannot be fetched from the adapter store now (it is
    unreachable); other requests go on, and this one may be retried shortly."""

    code = "adapter_unavailable"


class NoWorkerAvailable(EngineUnavailable):
    """No worker in rotation can take the request (none alive, or none dedicated to its
    tenant): the caller answers 503 with Retry-After."""

    code = "no_worker_available"


class WorkerLost(EngineError, RuntimeError):
    """The worker running a request failed after it had streamed output: the request
    cannot be moved without repeating what the caller already saw."""

    code = "worker_lost"


# NOTE: RequestRejected is left out: its codes are per instance, and it carries `param`.
_BY_CODE: dict[str, type[EngineError]] = {
    cls.code: cls
    for cls in (
        AdapterError,
        AdapterLoadError,
        EngineStepError,
        EngineDeadError,
        EngineUnavailable,
        NoWorkerAvailable,
        WorkerLost,
    )
}


def error_class(code: str) -> type[EngineError] | None:
    """The error class whose every instance has `code`; None for any other code."""
    return _BY_CODE.get(code)
