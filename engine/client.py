"""The one interface the app uses to reach an engine: in process (`AsyncEngine`) or on
workers behind a gateway (`RemoteEngine`); the app never tells the two apart."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from engine.errors import (
    AdapterError,
    AdapterLoadError,
    EngineDeadError,
    EngineError,
    EngineStepError,
    EngineUnavailable,
    NoWorkerAvailable,
    RequestRejected,
    WorkerLost,
)
from engine.request import EngineRequest, RequestOutput, TenantContext
from engine.stats import AdapterCacheStats, LatencyHistogram
from engine.structured.spec import StructuredOutput

__all__ = [
    "LOCAL_WORKER_ID",
    "WORKER_HEADER",
    "AdapterCacheStats",
    "AdapterError",
    "AdapterInfo",
    "AdapterLoadError",
    "AdapterPlacement",
    "EngineClient",
    "EngineDeadError",
    "EngineError",
    "EngineRequest",
    "EngineStats",
    "EngineStepError",
    "EngineUnavailable",
    "LatencyHistogram",
    "NoWorkerAvailable",
    "RequestRejected",
    "Route",
    "RouteHint",
    "TenantContext",
    "WorkerLost",
    "WorkerStatus",
]

# The response header that names the worker a request ran on (gateways only).
WORKER_HEADER = "x-loraplex-worker"
# The id of the in-process engine's one worker; a gateway's workers have their own.
LOCAL_WORKER_ID = "local"


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A LoRA adapter the engine serves, under the name requests use as `model`."""

    name: str
    key: str  # this version's engine key: a replaced adapter gets a new one
    path: str | None
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    size_bytes: int
    created: int  # unix seconds when this version was added


@dataclass(frozen=True, slots=True)
class AdapterPlacement:
    """Where one served adapter is right now (for operators)."""

    name: str
    slot: int | None  # the device slot holding it; None: not on the device
    on_host: bool  # a host-memory copy is loaded
    loading: bool  # a load from disk is running or queued
    pins: int  # running requests using it
    reservations: int  # waiting requests that asked for it


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float  # fraction of KV blocks in use, 0..1
    num_preemptions: int
    prefix_cache_hits: int  # tokens served from the prefix cache, cumulative
    prefix_cache_queries: int  # prompt tokens looked up, cumulative
    num_adapters: int = 0  # adapters registered
    adapter_cache: AdapterCacheStats | None = None  # None: LoRA disabled
    num_step_failures: int = 0  # engine steps that raised, cumulative
    num_steps: int = 0  # engine steps that ran a batch, cumulative
    num_steps_cut: int = 0  # background steps cut short (engine/core/background.py)
    # Slots of the blocks in use assigned to a running request's token (the rest of those
    # blocks' slots is paging's waste); block_size tokens a block.
    kv_filled_slots: int = 0
    block_size: int = 16
    step_seconds: float = 0.0  # their time, cumulative
    # Structured outputs, cumulative: constrained requests admitted, and the grammar
    # compiler's counters (engine/structured/compiler.py GrammarCacheStats).
    num_structured_requests: int = 0
    grammar_compiles: int = 0  # compiles started
    grammar_cache_hits: int = 0  # compile calls answered from the cache
    grammar_cache_misses: int = 0  # compile calls that waited for a compile
    grammar_refusals: int = 0  # compiles that ended in a refusal
    grammar_timeouts: int = 0  # compile calls refused for taking too long
    grammar_compile_s: float = 0.0  # compile time of finished compiles
    # What the engine computes in and on ("" where several engines are summed).
    dtype: str = ""  # float32 | bfloat16 | float16
    compute: str = ""  # the CPU and its bf16 units, or the GPU's name
    quantization: str = ""  # the base weights' scheme: "none", "int8 (per channel)", ...
    weight_bytes: int = 0  # the base model's weights as held (quantized, packed copies)


@dataclass(slots=True)
class Route:
    """Where one API request's engine requests run (chosen before its response starts, so
    that the response can name it). A retry moves it: after the request, `worker_id`
    names where they ran."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What a gateway chooses a worker by, beyond the engine requests themselves."""

    adapter: str | None  # the engine's adapter name; None: the base model
    tenant_id: str | None = None
    tenant_name: str | None = None  # workers may name their dedicated tenants either way
    dedicated: bool = False  # the tenant's isolation is "dedicated": its workers or none


@dataclass(slots=True)
class WorkerStatus:
    """One engine worker, for operators (GET /admin/engine)."""

    id: str  # "local" for the in-process engine
    model: str
    ready: bool
    stats: EngineStats
    adapters: list[AdapterInfo]  # what it serves (of those this process knows)
    residency: list[AdapterPlacement]
    # Workers behind a gateway only (None or empty for the in-process engine):
    url: str | None = None
    device: str | None = None  # "cpu", "cuda:0", ...
    mig_profile: str | None = None
    gpu_uuid: str | None = None
    dedicated_tenants: list[str] = field(default_factory=list)
    in_rotation: bool | None = None  # False: left out after a failed call, or draining
    inflight: int | None = None  # this gateway's requests on it
    seconds_since_heartbeat: float | None = None


class EngineClient(Protocol):
    @property
    def model_id(self) -> str:
        """The public id of the base model (what `/v1/models` lists)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Tokenize a completion prompt the way the model expects (BOS if it uses one)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Width of the model's vocabulary: prompt token ids must be below it."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Render chat messages with the model's template, ending with the assistant turn;
        `tools` (OpenAI function definitions) go to the template's `tools` variable."""
        ...

    @property
    def chat_template_has_tools(self) -> bool:
        """The chat template reads a `tools` variable (it can show the model tools)."""
        ...

    def check_structured_output(self, spec: StructuredOutput) -> None:
        """Raise the StructuredOutputError (a RequestRejected) the engine would refuse
        `spec` with, now (blocking up to the compile timeout: call it off the event
        loop). Compiled grammars are cached, so the request's own admission is quick."""
        ...

    def token_text(self, token_id: int) -> str:
        """The text of one vocabulary token on its own (for logprobs' alternatives)."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream outputs until one has finished=True. Closing the iterator early
        (client gone, task cancelled) aborts the request and frees what it held.

        Raises RequestRejected (e.g. code max_tokens_exceeded / context_length_exceeded),
        EngineUnavailable (retry later), or another EngineError."""
        ...

    def route(self, request_ids: Sequence[str], hint: RouteHint) -> Route | None:
        """Choose where the engine requests `request_ids` of one API request will run,
        before any of them starts; None for an in-process engine (it runs them itself).
        Raises NoWorkerAvailable. Each id is then either generated or released."""
        ...

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the route of engine requests that will not be generated after all."""
        ...

    def abort(self, request_id: str) -> None: ...

    def get_adapter(self, name: str) -> AdapterInfo | None:
        """The adapter served under `name`, None if there is none."""
        ...

    def list_adapters(self) -> list[AdapterInfo]: ...

    async def add_adapter(self, name: str, path: str) -> AdapterInfo:
        """Validate a PEFT directory against the base model and serve it as `name`
        (replacing the version served under that name, if any). Raises AdapterError
        (a ValueError) with the reason when the adapter is refused."""
        ...

    async def remove_adapter(self, name: str) -> bool:
        """Stop accepting requests for `name`; requests in flight finish first."""
        ...

    def max_adapter_bytes(self) -> int:
        """The most bytes a PEFT directory this engine would accept can hold: every target
        module of every layer at the largest rank, in float32, plus room for the
        safetensors header and adapter_config.json. Uploads beyond it are refused unread."""
        ...

    def adapter_residency(self) -> list[AdapterPlacement]:
        """Every served adapter that holds memory, a load, or requests."""
        ...

    def stats(self) -> EngineStats: ...

    def workers(self) -> list[WorkerStatus]:
        """Every worker this engine runs requests on (the in-process engine: one)."""
        ...

    def is_ready(self) -> bool: ...

    def failure(self) -> str | None:
        """Why the engine stopped serving for good (repeated step failures: a broken
        device); None while it serves. A failed engine never recovers: the process
        should drain and exit so that its supervisor starts a fresh one."""
        ...

    async def shutdown(self) -> None: ...


class RunsItsOwnRequests:
    """EngineClient's routing for an engine of one worker, this server's (in process or in
    a process of its own): nothing to choose, nothing to reserve."""

    def route(self, request_ids: Sequence[str], hint: RouteHint) -> Route | None:
        return None  # every request runs here

    def release(self, request_ids: Sequence[str]) -> None:
        pass  # nothing was reserved for them

    def workers(self) -> list[WorkerStatus]:
        return [local_worker(cast(EngineClient, self))]


def local_worker(engine: EngineClient) -> WorkerStatus:
    """An in-process engine as the one worker `workers()` lists."""
    return WorkerStatus(
        id=LOCAL_WORKER_ID,
        model=engine.model_id,
        ready=engine.is_ready(),
        stats=engine.stats(),
        adapters=engine.list_adapters(),
        residency=engine.adapter_residency(),
    )
