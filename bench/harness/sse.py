"""Reading an OpenAI-style event stream as a benchmark client: its JSON events up to
`data: [DONE]`, and when its tokens arrived."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


class EventStream:
    """The JSON events of one streamed response (`data: {...}` lines, other lines
    skipped), ending at `data: [DONE]`; `done` says whether that line came."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.done = False

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        async for line in self.response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                self.done = True
                return
            yield json.loads(payload)


@dataclass(slots=True)
class TokenClock:
    """When a stream's tokens arrived (time.perf_counter()): the first, and the gaps
    between each and the next."""

    start: float
    first: float | None = None
    last: float = field(init=False)
    gaps: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.last = self.start

    def tick(self) -> float:
        """A token (or a chunk of them) arrived now; returns now."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now
        return now

    def ttft_s(self, end: float) -> float:
        """To the first token; to `end` when none came."""
        return (self.first if self.first is not None else end) - self.start


async def timed_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any],
    tokens_in: Callable[[dict[str, Any]], int],
) -> tuple[TokenClock, int, float]:
    """POST `body` to `path` as a stream with usage; the clock (ticked once for each token
    chunk: `tokens_in(event)` of each event), the usage's completion tokens, and when the
    stream ended. RuntimeError for an answer other than 200."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    clock = TokenClock(time.perf_counter())
    num_tokens = 0
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()}")
        async for chunk in EventStream(resp):
            for _ in range(tokens_in(chunk)):
                clock.tick()
            if chunk.get("usage"):
                num_tokens = int(chunk["usage"]["completion_tokens"])
    return clock, num_tokens, time.perf_counter()
