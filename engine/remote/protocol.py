"""The wire format between gateways and workers.

Engine values travel as themselves: the bodies below are pydantic models whose fields are
the engine's own dataclasses (EngineRequest, RequestOutput, EngineStats, AdapterInfo,
AdapterPlacement...), validated and serialised by pydantic, so that the wire cannot drift
from them. A generation streams as newline-delimited JSON: one `StreamLine` per line, each
an engine output or, last, an error; an empty line is a keepalive that a worker sends
while a request waits, so that a gateway can tell a silent worker from a dead one.

NOTE: unknown fields are refused, not dropped, in everything but heartbeats: a worker must
not silently ignore a sampling parameter a newer gateway sends (roll workers out before
gateways). Heartbeats (heartbeat.py) ignore them: newer workers may report more.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from engine.client import WORKER_HEADER as WORKER_HEADER
from engine.client import AdapterInfo, AdapterPlacement, EngineStats
from engine.errors import EngineError, EngineUnavailable, RequestRejected, error_class
from engine.request import EngineRequest, RequestOutput

GENERATE_PATH = "/internal/generate"
ABORT_PATH = "/internal/abort"
ADAPTERS_PATH = "/internal/adapters"
REMOVE_ADAPTER_PATH = "/internal/adapters/remove"
STATS_PATH = "/internal/stats"

NDJSON = "application/x-ndjson"
KEEPALIVE = b"\n"


class Wire(BaseModel):
    """Base of every body; its config reaches the engine dataclasses inside."""

    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------- generate


class GenerateBody(Wire):
    request: EngineRequest


def encode_request(request: EngineRequest) -> bytes:
    return GenerateBody(request=request).model_dump_json().encode()


def decode_request(body: bytes | str) -> EngineRequest:
    """Raises ValidationError (a ValueError): see `refusal` for what it means."""
    return GenerateBody.model_validate_json(body).request


def refusal(exc: ValidationError) -> str | None:
    """When a body is well formed but the engine's own checks refuse a value in it
    (`top_p` 0, an empty prompt), what they said; None for a malformed body."""
    errors = exc.errors()
    causes = [e.get("ctx", {}).get("error") for e in errors if e["type"] == "value_error"]
    if not causes or len(causes) != len(errors):
        return None
    return "; ".join(str(c) for c in causes)


# "rejected": RequestRejected (code, param); "invalid": another ValueError the request
# caused; "unavailable": the worker cannot take work now (draining, starting), so another
# one may; "engine": the engine failed; "unauthorized": the token was missing or wrong.
ErrorKind = Literal["rejected", "invalid", "unavailable", "engine", "unauthorized"]


class WireError(Wire):
    """An error on the wire. `code` is the EngineError's (decoded back into its class),
    or, for other errors, what a route says went wrong (e.g. path_outside_store)."""

    kind: ErrorKind
    message: str
    code: str | None = None
    param: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> WireError:
        if isinstance(exc, RequestRejected):
            return cls(kind="rejected", message=str(exc), code=exc.code, param=exc.param)
        if isinstance(exc, EngineError):
            kind: ErrorKind = "engine"
            if isinstance(exc, EngineUnavailable):
                kind = "unavailable"
            elif isinstance(exc, ValueError):
                kind = "invalid"
            return cls(kind=kind, message=str(exc), code=exc.code)
        if isinstance(exc, ValueError):
            return cls(kind="invalid", message=str(exc))
        return cls(kind="engine", message=f"{type(exc).__name__}: {exc}")

    def to_exception(self) -> Exception:
        """The error the engine raised: the same EngineError class, a ValueError for
        another error the request caused, RuntimeError else."""
        if self.kind == "rejected":
            return RequestRejected(self.message, code=self.code or "invalid_request",
                                   param=self.param)
        cls = None if self.code is None else error_class(self.code)
        if cls is not None:
            return cls(self.message)
        if self.kind == "invalid":
            return ValueError(self.message)
        return RuntimeError(f"worker error ({self.kind}): {self.message}")


class ErrorBody(Wire):
    """Body of every non-2xx answer of a worker."""

    error: WireError


class StreamLine(Wire):
    """One line of a generation stream: exactly one of the two."""

    output: RequestOutput | None = None
    error: WireError | None = None


_OUTPUT = TypeAdapter(RequestOutput)


def encode_output(out: RequestOutput) -> bytes:
    return b'{"output":' + _OUTPUT.dump_json(out) + b"}\n"


def encode_error(error: WireError) -> bytes:
    return b'{"error":' + error.model_dump_json().encode() + b"}\n"


def decode_line(line: str | bytes) -> RequestOutput | WireError:
    parsed = StreamLine.model_validate_json(line)
    if parsed.output is not None:
        return parsed.output
    if parsed.error is not None:
        return parsed.error
    raise ValueError("a stream line with neither an output nor an error")


class AbortRequest(Wire):
    request_id: str


# ----------------------------------------------------------------------------- adapters


class AddAdapterRequest(Wire):
    name: str
    # Relative to the worker's data directory, or absolute; either way it must lie in
    # the worker's adapter store (<data_dir>/adapters/).
    path: str


class RemoveAdapterRequest(Wire):
    name: str


class RemoveAdapterResponse(Wire):
    removed: bool


class AdapterList(Wire):
    adapters: list[AdapterInfo]


class _AdapterInfoBody(Wire):
    info: AdapterInfo


_ADAPTER_INFO = TypeAdapter(AdapterInfo)


def encode_adapter_info(info: AdapterInfo) -> bytes:
    """An AdapterInfo as a body of its own (what registering an adapter answers)."""
    return _ADAPTER_INFO.dump_json(info)


def decode_adapter_info(body: bytes | str) -> AdapterInfo:
    """Raises ValueError for a body that is not one."""
    return _AdapterInfoBody.model_validate({"info": json.loads(body)}).info


# ----------------------------------------------------------------------------- stats


class WorkerStats(Wire):
    """What GET /internal/stats answers."""

    model_id: str
    max_model_len: int
    ready: bool
    draining: bool
    stats: EngineStats
    residency: list[AdapterPlacement]
