"""The HTTP side of `loraplex bench structured`: streamed chat requests with their
per-token timings, and plain chat requests whose whole answer is kept for checking."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from bench.harness.sse import timed_stream
from bench.harness.workload import RequestTiming, percentile

R = TypeVar("R")


@dataclass(slots=True)
class ChatCall:
    """One chat completion request: its body, and what it is tagged as in the report."""

    body: dict[str, Any]
    label: str  # e.g. "constrained" / "free", or the case's name


@dataclass(slots=True)
class StreamResult:
    label: str
    timing: RequestTiming


@dataclass(slots=True)
class ChatResult:
    status: int
    message: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None  # the body of a non-200 answer


@dataclass(slots=True)
class LoadSummary:
    """Per-token figures of one load (or of one label of it)."""

    requests: int
    output_tokens: int
    mean_output_tokens: float
    wall_s: float
    ttft_p50_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    gap_p50_s: float  # between consecutive streamed tokens, all requests pooled

    @classmethod
    def of(cls, results: Sequence[StreamResult], wall_s: float) -> LoadSummary:
        timings = [r.timing for r in results]
        tpot = sorted(x for t in timings if (x := t.tpot_s) is not None)
        gaps = sorted(g for t in timings for g in t.token_gaps_s)
        tokens = sum(t.num_output_tokens for t in timings)
        return cls(
            requests=len(timings),
            output_tokens=tokens,
            mean_output_tokens=round(tokens / max(1, len(timings)), 1),
            wall_s=round(wall_s, 3),
            ttft_p50_s=round(percentile(sorted(t.ttft_s for t in timings), 50), 4),
            tpot_p50_s=round(percentile(tpot, 50), 5),
            tpot_p90_s=round(percentile(tpot, 90), 5),
            gap_p50_s=round(percentile(gaps, 50), 5),
        )


async def stream_chat(client: httpx.AsyncClient, call: ChatCall) -> StreamResult:
    clock, num_tokens, end = await timed_stream(
        client, "/v1/chat/completions", call.body,
        lambda chunk: sum(1 for choice in chunk.get("choices") or []
                          if (choice.get("delta") or {}).get("content")),
    )
    # NOTE: TPOT runs to the last token's arrival, not the stream's end: the usage chunk
    # and [DONE] come after it.
    timing = RequestTiming(ttft_s=clock.ttft_s(end), e2e_s=clock.last - clock.start,
                           num_output_tokens=num_tokens, token_gaps_s=clock.gaps)
    return StreamResult(call.label, timing)


async def post_chat(client: httpx.AsyncClient, call: ChatCall) -> ChatResult:
    resp = await client.post("/v1/chat/completions", json=call.body)
    if resp.status_code != 200:
        return ChatResult(resp.status_code, error=resp.text[:2000])
    choice = resp.json()["choices"][0]
    return ChatResult(200, dict(choice["message"]), choice.get("finish_reason"))


def send_all(base_url: str, calls: Sequence[ChatCall], concurrency: int,
             send: Callable[[httpx.AsyncClient, ChatCall], Awaitable[R]]
             ) -> tuple[list[R], float]:
    """Every call through `send` (stream_chat or post_chat), at most `concurrency` at once;
    the results and the wall time."""
    async def run() -> tuple[list[R], float]:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:

            async def bounded(call: ChatCall) -> R:
                async with sem:
                    return await send(client, call)

            start = time.perf_counter()
            results = await asyncio.gather(*(bounded(c) for c in calls))
            return list(results), time.perf_counter() - start

    return asyncio.run(run())


def scrape_counter(base_url: str, name: str) -> float:
    """The /metrics sample `name` (no labels); 0 where it is missing."""
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name:
            return float(value)
    return 0.0
