"""The one interface the app uses to reach an engine (in-process today, a worker later)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.lora.cache import AdapterCacheStats
from engine.request import RequestOutput, SamplingParams, TenantContext

__all__ = [
    "AdapterInfo",
    "AdapterPlacement",
    "EngineClient",
    "EngineStats",
    "EngineStepError",
    "EngineUnavailable",
    "RequestRejected",
    "TenantContext",
]


class RequestRejected(ValueError):
    """A request the engine can never serve (too long for the context or the KV cache,
    token ids outside the vocabulary, an adapter it does not serve)."""

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class EngineStepError(RuntimeError):
    """The engine step that ran this request failed on it; the engine serves on."""


class EngineUnavailable(RuntimeError):
    """The engine cannot take this call now, but may soon (on a gateway: no worker is in
    rotation yet, or none answered): the caller answers 503 with Retry-After."""


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

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render chat messages with the model's template, ending with the assistant turn."""
        ...

    def token_text(self, token_id: int) -> str:
        """The text of one vocabulary token on its own (for logprobs' alternatives)."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        adapter_id: str | None = None,
        salt: str | None = None,
        priority: int = 0,
        tenant: TenantContext | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs until one has finished=True. Closing the iterator early
        (client gone, task cancelled) aborts the request and frees what it held.

        `priority`: lower is served first. `tenant`: who the request is for (fair share,
        per-tenant caps and limits); None: the shared anonymous tenant. Raises
        RequestRejected (e.g. code max_tokens_exceeded / context_length_exceeded)."""
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

    def is_ready(self) -> bool: ...

    def failure(self) -> str | None:
        """Why the engine stopped serving for good (repeated step failures: a broken
        device); None while it serves. A failed engine never recovers: the process
        should drain and exit so that its supervisor starts a fresh one."""
        ...

    async def shutdown(self) -> None: ...
