"""The open-loop client of `loraplex bench serve`: each request sent at its arrival time
as a stream of `POST /v1/completions`, timed chunk by chunk, failures kept as records."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from bench.harness import loops
from bench.harness.sse import EventStream, TokenClock
from bench.serve.workload import ServeRequest


@dataclass(slots=True)
class Target:
    """The server under load and what it calls the models."""

    base_url: str
    model: str  # the base model's served name
    adapter_models: dict[str, str] = field(default_factory=dict)  # adapter -> served name
    headers: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = True  # an extension loraplex and vLLM take; others may refuse it
    pid: int | None = None  # the server's process when started here
    vocab_size: int | None = None  # None: unknown, only a dataset's prompts can be sent

    def served_name(self, adapter: str | None) -> str:
        if adapter is None:
            return self.model
        return self.adapter_models.get(adapter, adapter)


@dataclass(slots=True)
class RequestRecord:
    """One request's fate. Times in seconds; `sent_s` from the start of its run."""

    index: int
    model: str
    scheduled_s: float
    sent_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks after the first
    prompt_tokens: int | None = None
    output_tokens: int = 0
    requested_output_tokens: int = 0
    shared_prefix: bool = False
    status: int | None = None  # the HTTP status, None when none came
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, object]:
        return {
            "index": self.index,
            "model": self.model,
            "scheduled_s": round(self.scheduled_s, 4),
            "sent_s": round(self.sent_s, 4),
            "ttft_s": _round(self.ttft_s),
            "tpot_s": _round(self.tpot_s),
            "e2e_s": _round(self.e2e_s),
            "itl_s": [round(x, 5) for x in self.itl_s],
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "requested_output_tokens": self.requested_output_tokens,
            "shared_prefix": self.shared_prefix,
            "status": self.status,
            "error": self.error,
        }


def completion_body(target: Target, request: ServeRequest) -> dict[str, object]:
    """Greedy and streamed; with ignore_eos every requested token is generated, so each
    run does the same work."""
    body: dict[str, object] = {
        "model": target.served_name(request.adapter),
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_stream(
    client: httpx.AsyncClient, target: Target, request: ServeRequest, record: RequestRecord
) -> RequestRecord:
    """Fill `record` from one streamed completion; errors end up in it, not raised."""
    record.requested_output_tokens = request.output_len
    record.shared_prefix = request.shared_prefix
    record.prompt_tokens = request.prompt_len
    clock = TokenClock(time.perf_counter())
    record.itl_s = clock.gaps  # filled as tokens arrive
    try:
        await _read_stream(client, completion_body(target, request), record, clock)
    except (httpx.HTTPError, OSError, ValueError) as exc:  # ValueError: bad JSON
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.e2e_s = time.perf_counter() - clock.start
    if clock.first is not None:
        record.ttft_s = clock.first - clock.start
    elif record.error is None:
        record.error = "the stream ended without a token"
    return record


async def _read_stream(
    client: httpx.AsyncClient, body: dict[str, object], record: RequestRecord, clock: TokenClock
) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {text[:200]}"
            return
        async for event in EventStream(response):
            if event.get("error"):
                record.error = f"stream error: {json.dumps(event['error'])[:200]}"
                return
            if event.get("choices"):
                clock.tick()
            usage = event.get("usage")
            if usage:
                record.output_tokens = int(usage.get("completion_tokens") or 0)
                record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
    if record.output_tokens == 0 and clock.first is not None:
        # A server without usage in streams: one token per chunk.
        record.output_tokens = len(clock.gaps) + 1


async def run_schedule(
    client: httpx.AsyncClient, target: Target, requests: Sequence[ServeRequest],
    arrivals: Sequence[float], *, max_concurrency: int | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send request i at arrivals[i] seconds (open loop: no request waits for another,
    unless `max_concurrency` caps the streams in flight); wait for all to end. Returns
    the records and the seconds from the first arrival to the last request's end."""
    assert len(requests) == len(arrivals)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []

    async def one(index: int, due: float) -> None:
        request, start = requests[index], due - arrivals[index]
        record = RequestRecord(index, target.served_name(request.adapter),
                               scheduled_s=arrivals[index])
        records.append(record)
        async with limit or contextlib.nullcontext():
            record.sent_s = time.perf_counter() - start
            await send_stream(client, target, request, record)

    wall_s = await loops.open_loop(arrivals, one)
    return sorted(records, key=lambda r: r.index), wall_s


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 5)
