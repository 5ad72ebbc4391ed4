"""A deterministic, tokenizer-free EngineClient for API tests.

Tokens are the UTF-8 bytes of the text (token id = byte value). A request "generates"
its own prompt bytes, cyclically, starting at offset `seed % len(prompt)` (0 without a
seed), one token per output. It finishes with "length" at max_tokens, with "stop"
after `eos_after` tokens (a stand-in for EOS) or when a stop string appears (the stop
string and anything after it never reach the client), or with "abort" after abort().
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from app.core.config import Settings
from app.main import create_app
from engine.client import AdapterInfo, AdapterPlacement, EngineStats
from engine.request import RequestOutput, SamplingParams, TenantContext, TokenLogprob


@dataclass(slots=True)
class SubmittedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter_id: str | None
    salt: str | None
    priority: int
    tenant: TenantContext | None = None


def fake_logprob(token_id: int) -> float:
    return -0.25 * (1 + token_id % 4)


def fake_top(token_id: int, k: int) -> list[tuple[int, float]]:
    """k alternatives, best first: the chosen token, then the next byte values."""
    return [((token_id + j) % 256, fake_logprob(token_id) - j) for j in range(k)]


def render_chat(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"


class FakeEngine:
    def __init__(
        self,
        *,
        model_id: str = "fake-model",
        max_model_len: int = 64,
        eos_after: int | None = None,
        token_delay_s: float = 0.0,
        first_token_delay_s: float = 0.0,
        num_cached_tokens: int = 0,
        fail_with: Exception | None = None,
        max_adapter_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self._model_id = model_id
        self._max_model_len = max_model_len
        self.eos_after = eos_after
        self.token_delay_s = token_delay_s
        self.first_token_delay_s = first_token_delay_s
        self.num_cached_tokens = num_cached_tokens
        self.fail_with = fail_with
        self._max_adapter_bytes = max_adapter_bytes
        self.ready = True
        self.failed: str | None = None  # set by a test: the engine failed for good
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.shut_down = False
        self.submitted: list[SubmittedRequest] = []
        self.active: set[str] = set()
        self.aborted: list[str] = []  # closed early by the caller, or abort()ed
        self.finished: list[str] = []  # ran to "stop" or "length"
        self._abort_requested: set[str] = set()
        self.adapters: dict[str, AdapterInfo] = {}

    # -- EngineClient ------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if any(m["role"] == "assistant" and m["content"] == "RAISE" for m in messages):
            raise ValueError("the template refuses this conversation")
        return self.encode(render_chat(messages))

    def token_text(self, token_id: int) -> str:
        return bytes([token_id]).decode(errors="replace") if token_id < 256 else f"<{token_id}>"

    def abort(self, request_id: str) -> None:
        self._abort_requested.add(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.active),
            num_waiting=self.num_waiting,
            num_free_blocks=100,
            num_total_blocks=128,
            kv_usage=self.kv_usage,
            num_preemptions=3,
            prefix_cache_hits=40,
            prefix_cache_queries=160,
        )

    def is_ready(self) -> bool:
        return self.ready and not self.shut_down and self.failed is None

    def failure(self) -> str | None:
        return self.failed

    def get_adapter(self, name: str) -> AdapterInfo | None:
        return self.adapters.get(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return sorted(self.adapters.values(), key=lambda a: a.name)

    async def add_adapter(self, name: str, path: str) -> AdapterInfo:
        info = AdapterInfo(
            name=name,
            key=f"{name}#{len(self.adapters) + 1}",
            path=path,
            rank=8,
            alpha=16.0,
            use_rslora=False,
            target_modules=("q_proj", "v_proj"),
            size_bytes=1024,
            created=1_700_000_000,
        )
        self.adapters[name] = info
        return info

    async def remove_adapter(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None

    def adapter_residency(self) -> list[AdapterPlacement]:
        return []

    def max_adapter_bytes(self) -> int:
        return self._max_adapter_bytes

    async def shutdown(self) -> None:
        self.shut_down = True

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
        self.submitted.append(
            SubmittedRequest(request_id, list(prompt_token_ids), sampling, adapter_id, salt,
                             priority, tenant)
        )
        if self.fail_with is not None:
            raise self.fail_with
        self.active.add(request_id)
        done = False
        try:
            async for output in self._outputs(request_id, prompt_token_ids, sampling):
                done = output.finished
                yield output
        finally:
            self.active.discard(request_id)
            if not done:
                self.aborted.append(request_id)

    # -- the fake model ----------------------------------------------------------------

    async def _outputs(
        self, request_id: str, prompt: list[int], sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        start = (sampling.seed or 0) % len(prompt)
        text = ""
        num_emitted = 0  # characters of `text` already sent
        for i in range(sampling.max_tokens):
            await asyncio.sleep(self.first_token_delay_s if i == 0 else self.token_delay_s)
            if request_id in self._abort_requested:
                self.aborted.append(request_id)
                yield self._output(request_id, prompt, [], "", i, "abort", sampling)
                return
            token = prompt[(start + i) % len(prompt)]
            text += self.token_text(token)
            num_tokens = i + 1
            reason = None
            cut = _first_stop(text, sampling.stop)
            if cut is not None:
                reason, visible = "stop", cut
            elif num_tokens == self.eos_after or num_tokens == sampling.max_tokens:
                reason = "stop" if num_tokens == self.eos_after else "length"
                visible = len(text)
            else:
                visible = len(text) - _held_back(text, sampling.stop)
            new_text = text[num_emitted:max(visible, num_emitted)]
            num_emitted = max(visible, num_emitted)
            if reason is not None:
                self.finished.append(request_id)
            yield self._output(request_id, prompt, [token], new_text, num_tokens, reason, sampling)
            if reason is not None:
                return

    def _output(
        self,
        request_id: str,
        prompt: list[int],
        tokens: list[int],
        new_text: str,
        num_output_tokens: int,
        finish_reason: str | None,
        sampling: SamplingParams,
    ) -> RequestOutput:
        logprobs = []
        if sampling.logprobs is not None:
            logprobs = [
                TokenLogprob(t, fake_logprob(t), fake_top(t, sampling.logprobs)) for t in tokens
            ]
        return RequestOutput(
            request_id=request_id,
            new_token_ids=tokens,
            new_text=new_text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_prompt_tokens=len(prompt),
            num_output_tokens=num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            new_logprobs=logprobs,
            new_token_texts=[self.token_text(t) for t in tokens],
        )


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that may still become a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                longest = max(longest, n)
                break
    return longest


def make_app(engine: FakeEngine | None = None, **settings: Any) -> tuple[FastAPI, FakeEngine]:
    """The real app around a FakeEngine; `settings` override Settings fields. Without a
    `data_dir`, apps share one temporary data directory (and SQLite database) per process,
    so that the migrations run once."""
    engine = engine if engine is not None else FakeEngine()
    settings.setdefault("data_dir", shared_data_dir())
    return create_app(engine, Settings(no_auth=True, **settings)), engine


@functools.cache
def shared_data_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="loraplex-test-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class _LifespanClient(httpx.AsyncClient):
    """An in-process client that also runs the app's lifespan (startup and shutdown), as
    a server would: ASGITransport alone does not."""

    def __init__(self, app: FastAPI) -> None:
        super().__init__(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
        self._lifespan = app.router.lifespan_context(app)

    async def __aenter__(self) -> _LifespanClient:
        await self._lifespan.__aenter__()
        await super().__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await super().__aexit__(*exc_info)
        await self._lifespan.__aexit__(*exc_info)


def asgi_client(app: FastAPI) -> httpx.AsyncClient:
    return _LifespanClient(app)


def parse_sse(body: str) -> list[Any]:
    """The events of an SSE body (JSON objects, then "[DONE]"), checking the framing."""
    assert body.endswith("\n\n"), body[-40:]
    events: list[Any] = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
