"""Request state shared by the scheduler, the block manager, the runner and the engine."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.structured.spec import StructuredOutput

if TYPE_CHECKING:
    from engine.structured.matcher import GrammarMatcher

ANONYMOUS_TENANT = "-"  # the one scheduling tenant of every request that names none


@dataclass(frozen=True, slots=True)
class TenantContext:
    """Who a request is for, as far as scheduling goes (no keys, no SQL: just numbers)."""

    tenant_id: str
    weight: float = 1.0  # VTC weight (from the tenant's plan); > 0
    max_running: int | None = None  # this tenant's sequences running at once
    # Share of the KV blocks it may hold while others wait (0..1].
    max_kv_fraction: float | None = None
    max_tokens: int | None = None  # per request (enforced in the engine too)
    max_context_tokens: int | None = None  # prompt + max_tokens

    def __post_init__(self) -> None:
        if not self.tenant_id:
            raise ValueError("tenant_id must not be empty")
        if not 0 < self.weight < math.inf:
            raise ValueError(f"weight must be > 0, got {self.weight}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_kv_fraction is not None and not 0 < self.max_kv_fraction <= 1:
            raise ValueError(f"max_kv_fraction must be in (0, 1], got {self.max_kv_fraction}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be >= 2, got {self.max_context_tokens}")


# Temperatures below this sample greedily: dividing logits by them overflows float32, and
# the distribution they describe is the argmax to within float32 resolution anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, never emitted
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: chosen token + top-k alternatives
    # The output must follow this spec (engine/structured/). Logprobs are then those of the
    # masked distribution, the one actually sampled from: refused tokens never appear.
    # NOTE: a grammar that is complete (nothing but EOS may follow) ends the request with
    # "stop", ignore_eos or not: sampling on past it could only produce EOS.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # NOTE: every float is checked finite: `nan < 0` is False, so a NaN would pass
        # each range check below unnoticed.
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class RequestStatus(enum.IntEnum):
    """Ordered: everything above PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_id: int | None = None
    adapter_id: str | None = None  # the adapter's name as requested; None: base model
    # The adapter version's key ("name#3", engine/adapter_versions.py), bound when the
    # engine admits the request: what the scheduler, adapter cache and prefix cache use.
    adapter_key: str | None = None
    salt: str | None = None  # tenant salt for the prefix-cache hash chain
    priority: int = 0  # lower value = served first
    # None: the shared anonymous tenant (ANONYMOUS_TENANT, weight 1, no caps).
    tenant: TenantContext | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # KV of all_token_ids[:num_computed_tokens] is in the cache.
    num_computed_tokens: int = 0
    # Of the prompt, how many tokens came from the prefix cache at first admission.
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    # Where the output stands in its grammar (SamplingParams.structured); None: free.
    # Advanced only by newly sampled tokens, so a recompute after preemption replays none.
    matcher: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if self.sampling.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @classmethod
    def of(cls, request: EngineRequest, *, eos_token_id: int | None = None) -> Request:
        """The engine's running state of a request it was handed."""
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling,
            eos_token_id=eos_token_id,
            adapter_id=request.adapter,
            salt=request.salt,
            priority=request.priority,
            tenant=request.tenant,
        )

    @property
    def tenant_id(self) -> str:
        return ANONYMOUS_TENANT if self.tenant is None else self.tenant.tenant_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: tokens [start, start + num_tokens) are computed."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_tokens: int

    @property
    def samples(self) -> bool:
        """After this chunk every known token has KV, so the next token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    # Decodes first (num_tokens == 1 on a request already past its prompt), then
    # prefill chunks; the runner flattens tokens in this order.
    chunks: list[ScheduledChunk]
    # Requests that lost their blocks this step and went back to the waiting queue.
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation request as it crosses every boundary: the app to the engine client,
    the gateway to a worker (serialised whole, see engine/remote/protocol.py), the
    client to the engine core. Immutable: the core keeps its own running state."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    adapter: str | None = None  # the adapter's name as served; None: the base model
    salt: str | None = None  # prefix-cache salt: cached KV is shared only within it
    priority: int = 0  # lower is served first
    # Who the request is for (fair share, caps, limits); None: the anonymous tenant.
    tenant: TenantContext | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")


@dataclass(slots=True)
class RequestOutput:
    """What the engine reports for one request after a step (deltas since the last one)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Text of each new token, only when logprobs were asked for (same length as new_logprobs).
    new_token_texts: list[str] = field(default_factory=list)
