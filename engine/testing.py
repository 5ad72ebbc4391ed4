"""FakeEngine: a deterministic EngineClient without a model or a tokenizer.

It serves the API tests (what the app does around an engine), the scale-out tests (the
engine inside a worker) and the gateway benchmark (what the app costs when the engine
costs nothing).

NOTE: it lives in the engine package rather than under tests/ because the benchmark runs
it too (bench/ never imports tests/), and because it depends on nothing but the engine's
own types: it is the engine contract, minus the model.

Tokens are the UTF-8 bytes of the text (token id = byte value). A request "generates" a
source's bytes cyclically, starting at offset `seed % len(source)` (0 without a seed): its
own prompt by default, or, with `filler=True`, a fixed ASCII sentence (every request then
costs the same whatever its prompt). It finishes with "length" at max_tokens, with "stop"
after `eos_after` tokens (a stand-in for EOS) or when a stop string appears (the stop
string and anything after it never reach the client), or with "abort" after abort().
Outputs come one token at a time, or, with `instant=True`, all in one finished output.
Structured outputs are accepted and not enforced: with byte tokens there is no grammar to
compile, so `check_structured_output` refuses nothing and the output ignores the spec.
Its chat template renders tools as one line before the messages.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.client import AdapterInfo, AdapterPlacement, EngineStats, RunsItsOwnRequests
from engine.errors import AdapterError, RequestRejected
from engine.request import (
    EngineRequest,
    RequestOutput,
    SamplingParams,
    TenantContext,
    TokenLogprob,
)
from engine.structured import StructuredOutput

FILLER = b"the quick brown fox jumps over the lazy dog "
VOCAB_SIZE = 256


@dataclass(slots=True)
class SubmittedRequest:
    """A request as the engine received it (prompt as a list, for easy comparison)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter_id: str | None
    salt: str | None
    priority: int
    tenant: TenantContext | None = None

    @classmethod
    def of(cls, request: EngineRequest) -> SubmittedRequest:
        return cls(request.request_id, list(request.prompt_token_ids), request.sampling,
                   request.adapter, request.salt, request.priority, request.tenant)


def fake_logprob(token_id: int) -> float:
    return -0.25 * (1 + token_id % 4)


def fake_top(token_id: int, k: int) -> list[tuple[int, float]]:
    """k alternatives, best first: the chosen token, then the next byte values."""
    return [((token_id + j) % VOCAB_SIZE, fake_logprob(token_id) - j) for j in range(k)]


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                ) -> str:
    head = f"<|tools|>{json.dumps(tools, separators=(',', ':'))}\n" if tools else ""
    return head + "".join(
        f"<|{m['role']}|>{m.get('content') or ''}\n" for m in messages
    ) + "<|assistant|>"


class FakeEngine(RunsItsOwnRequests):
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
        filler: bool = False,
        instant: bool = False,
        read_adapter_configs: bool = False,
        strict_adapters: bool = False,
        record: bool = True,
    ) -> None:
        """filler: generate FILLER instead of the prompt. instant: answer every request
        with one finished output. read_adapter_configs: an adapter's rank, alpha and
        target modules come from its adapter_config.json (AdapterError when unreadable),
        not fixed values. strict_adapters: as the real engine, refuse requests for
        adapters not added (model_not_found); otherwise any adapter name is served.
        record: keep every request in `submitted`, `finished` and `aborted` (for tests;
        a long benchmark run would only grow them)."""
        self._model_id = model_id
        self._max_model_len = max_model_len
        self.eos_after = eos_after
        self.token_delay_s = token_delay_s
        self.first_token_delay_s = first_token_delay_s
        self.num_cached_tokens = num_cached_tokens
        self.fail_with = fail_with
        self._max_adapter_bytes = max_adapter_bytes
        self.filler = filler
        self.instant = instant
        self.read_adapter_configs = read_adapter_configs
        self.strict_adapters = strict_adapters
        self.record = record
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
        self._num_versions = 0

    @classmethod
    def instant_engine(cls, **options: Any) -> FakeEngine:
        """The gateway benchmark's engine: filler text, answered at once, adapters read
        from their directories."""
        defaults: dict[str, Any] = {"model_id": "instant", "max_model_len": 4096,
                                    "filler": True, "instant": True,
                                    "read_adapter_configs": True, "record": False}
        return cls(**{**defaults, **options})

    # -- EngineClient ------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        if any(m["role"] == "assistant" and m.get("content") == "RAISE" for m in messages):
            raise ValueError("the template refuses this conversation")
        return self.encode(render_chat(messages, tools))

    @property
    def chat_template_has_tools(self) -> bool:
        return True

    def check_structured_output(self, spec: StructuredOutput) -> None:
        pass  # nothing to compile against byte tokens: every spec is served, unenforced

    def token_text(self, token_id: int) -> str:
        if token_id < VOCAB_SIZE:
            return bytes([token_id]).decode(errors="replace")
        return f"<{token_id}>"

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
            num_adapters=len(self.adapters),
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
        config: dict[str, Any] = {"r": 8, "lora_alpha": 16.0,
                                  "target_modules": ["q_proj", "v_proj"]}
        size_bytes, created = 1024, 1_700_000_000
        if self.read_adapter_configs:
            config_path = Path(path) / "adapter_config.json"
            try:
                config = json.loads(config_path.read_text())
            except (OSError, ValueError) as exc:
                raise AdapterError(f"cannot read {config_path.name}: {exc}") from exc
            size_bytes = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
            created = int(time.time())
        self._num_versions += 1
        info = AdapterInfo(
            name=name,
            key=f"{name}#{self._num_versions}",
            path=path,
            rank=int(config.get("r", 8)),
            alpha=float(config.get("lora_alpha", 8)),
            use_rslora=bool(config.get("use_rslora", False)),
            target_modules=tuple(config.get("target_modules") or ()),
            size_bytes=size_bytes,
            created=created,
        )
        self.adapters[name] = info
        return info

    async def remove_adapter(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None

    def adapter_residency(self) -> list[AdapterPlacement]:
        return []  # adapters hold no memory here

    def max_adapter_bytes(self) -> int:
        return self._max_adapter_bytes

    async def shutdown(self) -> None:
        self.shut_down = True

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        adapter = request.adapter
        if self.strict_adapters and adapter is not None and adapter not in self.adapters:
            raise RequestRejected(f"The model `{adapter}` does not exist.",
                                  code="model_not_found", param="model")
        if self.record:
            self.submitted.append(SubmittedRequest.of(request))
        if self.fail_with is not None:
            raise self.fail_with
        request_id = request.request_id
        self.active.add(request_id)
        done = False
        try:
            async for output in self._outputs(request):
                done = output.finished
                yield output
        finally:
            self.active.discard(request_id)
            if not done:
                self._note(self.aborted, request_id)

    # -- the fake model ----------------------------------------------------------------

    async def _outputs(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        request_id, sampling = request.request_id, request.sampling
        steps = self._steps(request.prompt_token_ids, sampling)
        if self.instant:
            if self.first_token_delay_s:
                await asyncio.sleep(self.first_token_delay_s)
            if request_id in self._abort_requested:
                self._note(self.aborted, request_id)
                yield self._output(request, [], "", 0, "abort")
                return
            merged = list(steps)
            tokens = [token for token, _, _ in merged]
            text = "".join(new_text for _, new_text, _ in merged)
            self._note(self.finished, request_id)
            yield self._output(request, tokens, text, len(tokens), merged[-1][2])
            return
        for i, (token, new_text, reason) in enumerate(steps):
            await asyncio.sleep(self.first_token_delay_s if i == 0 else self.token_delay_s)
            if request_id in self._abort_requested:
                self._note(self.aborted, request_id)
                yield self._output(request, [], "", i, "abort")
                return
            if reason is not None:
                self._note(self.finished, request_id)
            yield self._output(request, [token], new_text, i + 1, reason)
            if reason is not None:
                return

    def _note(self, log: list[str], request_id: str) -> None:
        if self.record:
            log.append(request_id)

    def _steps(
        self, prompt: Sequence[int], sampling: SamplingParams
    ) -> Iterator[tuple[int, str, str | None]]:
        """(token, its new visible text, finish reason or None) for each token."""
        source: Sequence[int] = FILLER if self.filler else prompt
        start = (sampling.seed or 0) % len(source)
        text = ""
        num_emitted = 0  # characters of `text` already sent
        for i in range(sampling.max_tokens):
            token = source[(start + i) % len(source)]
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
            yield token, new_text, reason
            if reason is not None:
                return

    def _output(
        self,
        request: EngineRequest,
        tokens: list[int],
        new_text: str,
        num_output_tokens: int,
        finish_reason: str | None,
    ) -> RequestOutput:
        k = request.sampling.logprobs
        logprobs = []
        if k is not None:
            logprobs = [TokenLogprob(t, fake_logprob(t), fake_top(t, k)) for t in tokens]
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            new_text=new_text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
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
