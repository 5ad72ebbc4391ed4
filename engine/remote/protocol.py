"""The wire format between gateways and workers.

Requests and answers are JSON bodies (pydantic models below). A generation streams as
newline-delimited JSON: one `StreamLine` per line, each an engine output or, last, an
error; an empty line is a keepalive that a worker sends while a request waits, so that a
gateway can tell a silent worker from a dead one.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict

from engine.client import (
    AdapterInfo,
    AdapterPlacement,
    EngineStats,
    EngineUnavailable,
    RequestRejected,
)
from engine.lora.cache import AdapterCacheStats, LatencyHistogram
from engine.request import RequestOutput, SamplingParams, TenantContext, TokenLogprob

# The response header that names the worker a request ran on.
WORKER_HEADER = "x-loraplex-worker"

GENERATE_PATH = "/internal/generate"
ABORT_PATH = "/internal/abort"
ADAPTERS_PATH = "/internal/adapters"
REMOVE_ADAPTER_PATH = "/internal/adapters/remove"
STATS_PATH = "/internal/stats"

NDJSON = "application/x-ndjson"
KEEPALIVE = b"\n"


class NoWorkerAvailable(EngineUnavailable):
    """No worker in rotation can take the request (none alive, or none dedicated to its
    tenant): the caller answers 503 with Retry-After."""


class WorkerLost(RuntimeError):
    """The worker running a request failed after it had streamed output: the request
    cannot be moved without repeating what the caller already saw."""


class _Wire(BaseModel):
    # NOTE: unknown fields are refused, not dropped: a worker must not silently ignore a
    # sampling parameter a newer gateway sends (roll workers out before gateways).
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------- generate


class SamplingWire(_Wire):
    """SamplingParams field for field (a test keeps the two in step)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingWire:
        return cls(**dataclasses.asdict(params))

    def to_params(self) -> SamplingParams:
        """Raises ValueError for values the engine refuses."""
        return SamplingParams(**self.model_dump())


class TenantWire(_Wire):
    """TenantContext field for field."""

    tenant_id: str
    weight: float
    max_running: int | None
    max_kv_fraction: float | None
    max_tokens: int | None
    max_context_tokens: int | None

    @classmethod
    def of(cls, tenant: TenantContext) -> TenantWire:
        return cls(**dataclasses.asdict(tenant))

    def to_context(self) -> TenantContext:
        return TenantContext(**self.model_dump())


class GenerateRequest(_Wire):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingWire
    adapter_id: str | None = None
    salt: str | None = None
    priority: int = 0
    tenant: TenantWire | None = None


class LogprobWire(_Wire):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class OutputWire(_Wire):
    """RequestOutput field for field."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: list[LogprobWire] = []
    new_token_texts: list[str] = []

    @classmethod
    def of(cls, out: RequestOutput) -> OutputWire:
        return cls(
            request_id=out.request_id,
            new_token_ids=out.new_token_ids,
            new_text=out.new_text,
            finished=out.finished,
            finish_reason=out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens,
            new_logprobs=[
                LogprobWire(token_id=lp.token_id, logprob=lp.logprob, top=lp.top)
                for lp in out.new_logprobs
            ],
            new_token_texts=out.new_token_texts,
        )

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.new_token_ids,
            new_text=self.new_text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            new_logprobs=[
                TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top))
                for lp in self.new_logprobs
            ],
            new_token_texts=self.new_token_texts,
        )


# "rejected": RequestRejected (code, param); "invalid": another ValueError the request
# caused; "unavailable": the worker cannot take work now (draining, starting), so another
# one may; "engine": the engine failed; "unauthorized": the token was missing or wrong.
ErrorKind = Literal["rejected", "invalid", "unavailable", "engine", "unauthorized"]


class WireError(_Wire):
    kind: ErrorKind
    message: str
    code: str | None = None
    param: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> WireError:
        if isinstance(exc, RequestRejected):
            return cls(kind="rejected", message=str(exc), code=exc.code, param=exc.param)
        if isinstance(exc, ValueError):
            return cls(kind="invalid", message=str(exc))
        return cls(kind="engine", message=f"{type(exc).__name__}: {exc}")

    def to_exception(self) -> Exception:
        """What the engine raised, for the errors a request causes; RuntimeError else."""
        if self.kind == "rejected":
            return RequestRejected(self.message, code=self.code or "invalid_request",
                                   param=self.param)
        if self.kind == "invalid":
            return ValueError(self.message)
        return RuntimeError(f"worker error ({self.kind}): {self.message}")


class ErrorBody(_Wire):
    """Body of every non-2xx answer of a worker."""

    error: WireError


class StreamLine(_Wire):
    """One line of a generation stream: exactly one of the two."""

    output: OutputWire | None = None
    error: WireError | None = None


def encode_output(out: RequestOutput) -> bytes:
    return b'{"output":' + OutputWire.of(out).model_dump_json().encode() + b"}\n"


def encode_error(error: WireError) -> bytes:
    return b'{"error":' + error.model_dump_json().encode() + b"}\n"


def decode_line(line: str | bytes) -> RequestOutput | WireError:
    parsed = StreamLine.model_validate_json(line)
    if parsed.output is not None:
        return parsed.output.to_output()
    if parsed.error is not None:
        return parsed.error
    raise ValueError("a stream line with neither an output nor an error")


class AbortRequest(_Wire):
    request_id: str


# ----------------------------------------------------------------------------- adapters


class AddAdapterRequest(_Wire):
    name: str
    # Relative to the worker's data directory, or absolute; either way it must lie in
    # the worker's adapter store (<data_dir>/adapters/).
    path: str


class RemoveAdapterRequest(_Wire):
    name: str


class RemoveAdapterResponse(_Wire):
    removed: bool


class AdapterInfoWire(_Wire):
    name: str
    key: str
    path: str | None
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: list[str]
    size_bytes: int
    created: int

    @classmethod
    def of(cls, info: AdapterInfo) -> AdapterInfoWire:
        return cls(**{**dataclasses.asdict(info), "target_modules": list(info.target_modules)})

    def to_info(self) -> AdapterInfo:
        return AdapterInfo(**{**self.model_dump(), "target_modules": tuple(self.target_modules)})


class AdapterList(_Wire):
    adapters: list[AdapterInfoWire]


# ----------------------------------------------------------------------------- stats


class HistogramWire(_Wire):
    # JSON has no infinity: the last bound (always +inf) is implied.
    finite_bounds: list[float]
    cumulative_counts: list[int]
    sum: float
    count: int

    @classmethod
    def of(cls, h: LatencyHistogram) -> HistogramWire:
        assert h.bounds[-1] == float("inf"), "the last bucket is +Inf"
        return cls(finite_bounds=list(h.bounds[:-1]), cumulative_counts=list(h.cumulative_counts),
                   sum=h.sum, count=h.count)

    def to_histogram(self) -> LatencyHistogram:
        return LatencyHistogram(
            bounds=(*self.finite_bounds, float("inf")),
            cumulative_counts=tuple(self.cumulative_counts),
            sum=self.sum,
            count=self.count,
        )


class AdapterCacheWire(_Wire):
    device_hits: int
    device_misses: int
    loads: int
    load_failures: int
    device_evictions: int
    host_evictions: int
    num_device: int
    num_host: int
    num_loading: int
    num_queued: int
    load_latency: HistogramWire
    device_slots: int
    host_capacity: int

    @classmethod
    def of(cls, s: AdapterCacheStats) -> AdapterCacheWire:
        fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
        return cls(**{**fields, "load_latency": HistogramWire.of(s.load_latency)})

    def to_stats(self) -> AdapterCacheStats:
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return AdapterCacheStats(**{**fields, "load_latency": self.load_latency.to_histogram()})


class StatsWire(_Wire):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    num_adapters: int = 0
    adapter_cache: AdapterCacheWire | None = None
    num_step_failures: int = 0

    @classmethod
    def of(cls, s: EngineStats) -> StatsWire:
        fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
        cache = None if s.adapter_cache is None else AdapterCacheWire.of(s.adapter_cache)
        return cls(**{**fields, "adapter_cache": cache})

    def to_stats(self) -> EngineStats:
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        cache = None if self.adapter_cache is None else self.adapter_cache.to_stats()
        return EngineStats(**{**fields, "adapter_cache": cache})


class PlacementWire(_Wire):
    name: str
    slot: int | None
    on_host: bool
    loading: bool
    pins: int
    reservations: int

    @classmethod
    def of(cls, p: AdapterPlacement) -> PlacementWire:
        return cls(**dataclasses.asdict(p))

    def to_placement(self) -> AdapterPlacement:
        return AdapterPlacement(**self.model_dump())
