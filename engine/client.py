"""The one interface the app uses to reach an engine (in-process today, a worker later)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.request import RequestOutput, SamplingParams


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
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs until one has finished=True. Closing the iterator early
        (client gone, task cancelled) aborts the request and frees what it held."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def is_ready(self) -> bool: ...

    async def shutdown(self) -> None: ...
