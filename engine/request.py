"""The public request and output values: what callers hand an engine and what it reports
(re-exported by engine/client.py). The engine's running state of a request is
engine/core/state.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured.spec import StructuredOutput

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
    # None: none; k >= 0: each prompt token's logprob (the first has none) + top-k, from
    # the prefill's logits (such a request computes its whole prompt: no prefix-cache hit).
    prompt_logprobs: int | None = None
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
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first
    # 1 + how many tokens are likelier; reported for prompt tokens only (None otherwise).
    rank: int | None = None


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
    # With prompt_logprobs, in the request's first output only: one per prompt token, the
    # first None (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
