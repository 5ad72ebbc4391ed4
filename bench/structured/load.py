"""The HTTP side of `loraplex bench structured`: a `loraplex serve` on a scratch data
directory, streamed chat requests with their per-token timings, and plain chat requests
whose whole answer is kept for checking."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.harness.server import clean_env, loraplex_serve
from bench.harness.sse import EventStream, TokenClock
from bench.harness.workload import RequestTiming, percentile


@contextlib.contextmanager
def scratch_server(model_dir: Path, serve_args: Sequence[str], *,
                   timeout_s: float = 300.0) -> Iterator[str]:
    """Yield the base URL of a `loraplex serve --no-auth` of `model_dir` whose database,
    spool and adapter store live in a temporary directory (removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="loraplex-structured-") as data_dir, \
            loraplex_serve(["--model", str(model_dir), *serve_args],
                           env=clean_env(LORAPLEX_DATA_DIR=data_dir),
                           log_path=Path(data_dir) / "serve.log", timeout_s=timeout_s) as server:
        yield server.base_url


@dataclass(slots=True)
class ChatCall:
    """One chat completion request: its body, and what it is tagged as in the report."""

    body: dict[str, Any]
    label: str  # e.g. "constrained" / "free", or the case's name


@dataclass(slots=True)
class StreamResult:
    label: str
    timing: RequestTiming
    content: str
    finish_reason: str | None


@dataclass(slots=True)
class ChatResult:
    label: str
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


async def _stream(client: httpx.AsyncClient, call: ChatCall) -> StreamResult:
    body = {**call.body, "stream": True, "stream_options": {"include_usage": True}}
    clock = TokenClock(time.perf_counter())
    parts: list[str] = []
    finish_reason: str | None = None
    num_tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()}")
        async for chunk in EventStream(resp):
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    parts.append(text)
                    clock.tick()
                finish_reason = choice.get("finish_reason") or finish_reason
            if chunk.get("usage"):
                num_tokens = int(chunk["usage"]["completion_tokens"])
    end = time.perf_counter()
    # NOTE: TPOT runs to the last token's arrival, not the stream's end: the usage chunk
    # and [DONE] come after it.
    timing = RequestTiming(ttft_s=clock.ttft_s(end), e2e_s=clock.last - clock.start,
                           num_output_tokens=num_tokens, token_gaps_s=clock.gaps)
    return StreamResult(call.label, timing, "".join(parts), finish_reason)


async def _post(client: httpx.AsyncClient, call: ChatCall) -> ChatResult:
    resp = await client.post("/v1/chat/completions", json=call.body)
    if resp.status_code != 200:
        return ChatResult(call.label, resp.status_code, error=resp.text[:2000])
    choice = resp.json()["choices"][0]
    return ChatResult(call.label, 200, dict(choice["message"]), choice.get("finish_reason"))


async def _gather(base_url: str, calls: Sequence[ChatCall], concurrency: int,
                  stream: bool) -> tuple[list[Any], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    send = _stream if stream else _post
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:

        async def bounded(call: ChatCall) -> Any:
            async with sem:
                return await send(client, call)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(c) for c in calls))
        return list(results), time.perf_counter() - start


def stream_load(base_url: str, calls: Sequence[ChatCall],
                concurrency: int) -> tuple[list[StreamResult], float]:
    """Every call as a stream, at most `concurrency` at once; the results and wall time."""
    return asyncio.run(_gather(base_url, calls, concurrency, stream=True))


def post_all(base_url: str, calls: Sequence[ChatCall], concurrency: int) -> list[ChatResult]:
    """Every call as one JSON response, at most `concurrency` at once."""
    results, _ = asyncio.run(_gather(base_url, calls, concurrency, stream=False))
    return results


def scrape_counters(base_url: str, prefixes: Sequence[str] = ("loraplex_structured_",
                                                              "loraplex_grammar_")
                    ) -> dict[str, float]:
    """The /metrics samples whose names start with one of `prefixes`."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(tuple(prefixes)):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out
