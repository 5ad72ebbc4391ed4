"""Synthetic request mixes and the HTTP load generator shared by the benchmarks."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from bench.harness.sse import timed_stream


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    model: str | None = None  # None: the base model


@dataclass(slots=True)
class RequestTiming:
    ttft_s: float
    e2e_s: float
    num_output_tokens: int
    token_gaps_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class LoadResult:
    timings: list[RequestTiming]
    wall_s: float

    @property
    def num_output_tokens(self) -> int:
        return sum(t.num_output_tokens for t in self.timings)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    def summary(self) -> dict[str, float]:
        ttft = sorted(t.ttft_s for t in self.timings)
        tpot = sorted(x for t in self.timings if (x := t.tpot_s) is not None)
        return {
            "requests": len(self.timings),
            "output_tokens": self.num_output_tokens,
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": round(self.output_tokens_per_s, 2),
            "ttft_p50_s": round(percentile(ttft, 50), 4),
            "ttft_p99_s": round(percentile(ttft, 99), 4),
            "tpot_p50_s": round(percentile(tpot, 50), 4) if tpot else float("nan"),
        }


def percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return float("nan")
    if len(sorted_values) == 1:
        return sorted_values[0]
    rank = (len(sorted_values) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def make_requests(
    num_requests: int,
    *,
    vocab_size: int,
    prompt_len: tuple[int, int] = (20, 400),
    output_len: tuple[int, int] = (16, 128),
    seed: int = 0,
) -> list[BenchRequest]:
    """Random token prompts (random_token_ids)."""
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    for _ in range(num_requests):
        n_prompt = rng.randint(*prompt_len)
        out.append(
            BenchRequest(
                prompt_token_ids=random_token_ids(rng, n_prompt, vocab_size),
                max_tokens=rng.randint(*output_len),
            )
        )
    return out


def random_token_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """`n` ids above the low range where special tokens live."""
    low = min(1000, vocab_size // 4)
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def _completion_body(base_model: str, req: BenchRequest) -> dict[str, object]:
    """Greedy, every requested token generated (ignore_eos): the same work on any run."""
    return {
        "model": req.model or base_model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def _one_stream(
    client: httpx.AsyncClient, base_model: str, req: BenchRequest
) -> RequestTiming:
    clock, num_output_tokens, end = await timed_stream(
        client, "/v1/completions", _completion_body(base_model, req),
        lambda chunk: 1 if chunk.get("choices") else 0,
    )
    return RequestTiming(
        ttft_s=clock.ttft_s(end),
        e2e_s=end - clock.start,
        num_output_tokens=num_output_tokens,
        token_gaps_s=clock.gaps,
    )


async def _one_request(
    client: httpx.AsyncClient, base_model: str, req: BenchRequest
) -> RequestTiming:
    """Non-streaming: one JSON response; TTFT is unknown and reported as the e2e time."""
    start = time.perf_counter()
    resp = await client.post("/v1/completions", json=_completion_body(base_model, req))
    end = time.perf_counter()
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text}")
    num_output_tokens = int(resp.json()["usage"]["completion_tokens"])
    return RequestTiming(ttft_s=end - start, e2e_s=end - start, num_output_tokens=num_output_tokens)


async def run_load(
    base_url: str,
    base_model: str,
    requests: list[BenchRequest],
    concurrency: int,
    *,
    stream: bool = True,
) -> LoadResult:
    """Send every request, at most `concurrency` at once, each as a stream (or, with
    stream=False, as one JSON response: less client work on a machine it shares with the
    server, for throughput-only figures)."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    send = _one_stream if stream else _one_request
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:

        async def bounded(r: BenchRequest) -> RequestTiming:
            async with sem:
                return await send(client, base_model, r)

        start = time.perf_counter()
        timings = await asyncio.gather(*(bounded(r) for r in requests))
        wall = time.perf_counter() - start
    return LoadResult(timings=list(timings), wall_s=wall)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
