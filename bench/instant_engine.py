"""An EngineClient that answers at once, to measure what the gateway around it costs.

Tokens are UTF-8 bytes (token id = byte value). `generate` returns one finished output
with exactly `max_tokens` tokens of fixed ASCII filler ("length"), so every request
costs the gateway the same and the engine nothing. Stop strings and penalties are not
applied: no benchmark here depends on them.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from engine.client import AdapterInfo, AdapterPlacement, EngineStats
from engine.lora.weights import AdapterError
from engine.request import RequestOutput, SamplingParams, TenantContext, TokenLogprob

_FILLER = b"the quick brown fox jumps over the lazy dog "
_VOCAB_SIZE = 256


def render_chat(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in messages) + (
        "<|assistant|>"
    )


class InstantEngine:
    def __init__(
        self,
        *,
        model_id: str = "instant",
        max_model_len: int = 4096,
        max_adapter_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self._model_id = model_id
        self._max_model_len = max_model_len
        self._max_adapter_bytes = max_adapter_bytes
        self._adapters: dict[str, AdapterInfo] = {}
        self._num_versions = 0
        self._shut_down = False

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(render_chat(messages))

    def token_text(self, token_id: int) -> str:
        return bytes([token_id]).decode(errors="replace") if token_id < _VOCAB_SIZE else ""

    async def generate(
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
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        n = sampling.max_tokens
        tokens = list((_FILLER * (n // len(_FILLER) + 1))[:n])
        logprobs: list[TokenLogprob] = []
        texts: list[str] = []
        if sampling.logprobs is not None:
            k = sampling.logprobs
            logprobs = [TokenLogprob(t, 0.0, [(t, 0.0)] * k) for t in tokens]
            texts = [self.token_text(t) for t in tokens]
        yield RequestOutput(
            request_id=request_id,
            new_token_ids=tokens,
            new_text=bytes(tokens).decode(),
            finished=True,
            finish_reason="length",
            num_prompt_tokens=len(prompt_token_ids),
            num_output_tokens=n,
            num_cached_tokens=0,
            new_logprobs=logprobs,
            new_token_texts=texts,
        )

    def abort(self, request_id: str) -> None:
        pass  # every request has finished before anyone could abort it

    def get_adapter(self, name: str) -> AdapterInfo | None:
        return self._adapters.get(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return sorted(self._adapters.values(), key=lambda a: a.name)

    async def add_adapter(self, name: str, path: str) -> AdapterInfo:
        config_path = Path(path) / "adapter_config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise AdapterError(f"cannot read {config_path.name}: {exc}") from exc
        self._num_versions += 1
        info = AdapterInfo(
            name=name,
            key=f"{name}#{self._num_versions}",
            path=path,
            rank=int(config.get("r", 8)),
            alpha=float(config.get("lora_alpha", 8)),
            use_rslora=bool(config.get("use_rslora", False)),
            target_modules=tuple(config.get("target_modules") or ()),
            size_bytes=sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file()),
            created=int(time.time()),
        )
        self._adapters[name] = info
        return info

    async def remove_adapter(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None

    def max_adapter_bytes(self) -> int:
        return self._max_adapter_bytes

    def adapter_residency(self) -> list[AdapterPlacement]:
        return []  # adapters hold no memory here

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=0,
            num_waiting=0,
            num_free_blocks=0,
            num_total_blocks=0,
            kv_usage=0.0,
            num_preemptions=0,
            prefix_cache_hits=0,
            prefix_cache_queries=0,
            num_adapters=len(self._adapters),
        )

    def is_ready(self) -> bool:
        return not self._shut_down

    def failure(self) -> str | None:
        return None

    async def shutdown(self) -> None:
        self._shut_down = True
