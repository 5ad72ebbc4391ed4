"""A request's running state in the engine, shared by the scheduler, the block manager,
the runner and the core, and the steps the scheduler plans over it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.request import (
    ANONYMOUS_TENANT,
    EngineRequest,
    SamplingParams,
    TenantContext,
    TokenLogprob,
)
from engine.structured.matcher import GrammarMatcher


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


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_id: int | None = None
    adapter_id: str | None = None  # the adapter's name as requested; None: base model
    # The adapter version's key ("name#3", engine/lora/versions.py), bound when the
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
    # With SamplingParams.prompt_logprobs: one entry per prompt token, filled as its
    # prefill runs (by position: a recompute after preemption writes the same ones), and
    # sent with the first output.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
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


