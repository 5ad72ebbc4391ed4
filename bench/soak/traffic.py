"""The traffic of `loraplex bench soak`: one tenant's mix of requests, each kept as an
Outcome, and its adapter uploads."""

from __future__ import annotations

import io
import random
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness.sse import EventStream

# kind -> weight in the mix; "lora" is a plain completion on the tenant's adapter.
MIX: dict[str, float] = {"plain": 0.35, "stream": 0.30, "cut": 0.15, "lora": 0.10, "bad": 0.10}
ADAPTER_NAME = "soak-lora"
TENANT_MAX_TOKENS = 512
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
          "seven", "wizards", "quietly", "box", "jugglers", "near", "old", "harbour", "dawn")


@dataclass(slots=True)
class Outcome:
    kind: str
    phase: str  # "capacity" or "load"
    status: int  # 0: no HTTP answer
    latency_s: float
    response_id: str | None = None  # of a successful generation
    expected: bool = True
    detail: str = ""


@dataclass(frozen=True, slots=True)
class TrafficShape:
    """What the soak's options say of each request."""

    seed: int
    max_tokens: int
    cut_max_tokens: int  # of a stream the client cuts off


class Traffic:
    """The tenant's requests, each kept as an Outcome."""

    def __init__(
        self, client: httpx.AsyncClient, model: str, opts: TrafficShape, pid: int
    ) -> None:
        self.client = client
        self.pid = pid
        self.rss_samples: list[tuple[float, int]] = []  # (seconds into the load, RSS)
        self.model = model
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.adapter: str | None = None
        self.outcomes: list[Outcome] = []
        self._kinds, self._weights = list(MIX), list(MIX.values())
        self._num_bad = 0

    def _prompt(self) -> str:
        return " ".join(self.rng.choices(_WORDS, k=self.rng.randint(4, 48)))

    async def one(self, phase: str) -> Outcome:
        kind = self.rng.choices(self._kinds, self._weights)[0]
        started = time.perf_counter()
        outcome = Outcome(kind, phase, 0, 0.0)
        try:
            if kind in ("plain", "lora"):
                await self._plain(outcome, self.adapter if kind == "lora" else None)
            elif kind == "bad":
                await self._bad(outcome)
            else:
                await self._stream(outcome, cut=kind == "cut")
        except httpx.HTTPError as exc:
            outcome.expected, outcome.detail = False, f"{type(exc).__name__}: {exc}"
        outcome.latency_s = time.perf_counter() - started
        self.outcomes.append(outcome)
        return outcome

    async def _plain(self, outcome: Outcome, adapter: str | None) -> None:
        body = {"model": adapter or self.model, "prompt": self._prompt(),
                "max_tokens": self.opts.max_tokens, "temperature": 0.7, "ignore_eos": True}
        response = await self.client.post("/v1/completions", json=body)
        outcome.status = response.status_code
        if response.status_code == 200:
            outcome.response_id = response.json()["id"]
        else:
            outcome.expected, outcome.detail = False, response.text[:200]

    async def _stream(self, outcome: Outcome, *, cut: bool) -> None:
        max_tokens = self.opts.cut_max_tokens if cut else self.opts.max_tokens
        cut_after = self.rng.randint(2, 4) if cut else None
        body = {"model": self.model, "messages": [{"role": "user", "content": self._prompt()}],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.expected = False
                outcome.detail = (await response.aread()).decode(errors="replace")[:200]
                return
            num_chunks, events = 0, EventStream(response)
            async for event in events:
                outcome.response_id = event.get("id", outcome.response_id)
                num_chunks += 1
                if cut_after is not None and num_chunks >= cut_after:
                    return  # leaving the block closes the connection mid-stream
            if not events.done:
                outcome.expected, outcome.detail = False, "stream ended without [DONE]"

    async def _bad(self, outcome: Outcome) -> None:
        """Mistakes a client makes; each must get a 4xx other than 429."""
        self._num_bad += 1
        case = self._num_bad % 4
        if case == 0:
            response = await self.client.post(
                "/v1/completions", content=b'{"model": "x", "prompt": ',
                headers={"Content-Type": "application/json"},
            )
        else:
            body: dict[str, object] = {"model": self.model, "prompt": "hi", "max_tokens": 4}
            if case == 1:
                body["model"] = f"no-such-adapter-{self._num_bad}"
            elif case == 2:
                body["max_tokens"] = TENANT_MAX_TOKENS * 100
            else:
                body["temperature"] = -1
            response = await self.client.post("/v1/completions", json=body)
        outcome.status = response.status_code
        outcome.expected = 400 <= response.status_code < 500 and response.status_code != 429
        if not outcome.expected:
            outcome.detail = response.text[:200]

    async def upload(self, adapter_dir: Path, phase: str) -> Outcome:
        started = time.perf_counter()
        response = await self.client.post(
            "/v1/adapters", data={"name": ADAPTER_NAME},
            files={"file": ("adapter.tar.gz", _tar_gz(adapter_dir), "application/gzip")},
        )
        outcome = Outcome("upload", phase, response.status_code, time.perf_counter() - started)
        if response.status_code == 201 and response.json()["status"] == "ready":
            self.adapter = ADAPTER_NAME
        else:
            outcome.expected, outcome.detail = False, response.text[:200]
        self.outcomes.append(outcome)
        return outcome


def _tar_gz(adapter_dir: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(adapter_dir / name, arcname=f"adapter/{name}")
    return buffer.getvalue()


