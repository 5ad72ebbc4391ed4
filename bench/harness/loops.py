"""How a benchmark sends its load: closed loop (clients back to back) or open loop (at
scheduled times, whatever the server does)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any


async def closed_loop(
    send: Callable[[], Awaitable[object]], concurrency: int, duration_s: float
) -> tuple[int, float]:
    """`concurrency` clients, each sending its next request when its last one answered,
    until `duration_s` is up; returns (requests answered, wall seconds)."""
    deadline = time.perf_counter() + duration_s
    done = 0

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await send()
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done, time.perf_counter() - started


async def open_loop(
    arrivals: Iterable[float], send: Callable[[int, float], Coroutine[Any, Any, object]]
) -> float:
    """`send(i, due)` for the i-th arrival, `arrivals[i]` seconds from now (in order),
    without waiting for the ones before; `due` is that time on time.perf_counter()'s
    clock. Returns the wall seconds until the last one answered.

    NOTE: a caller timing from `due` (the schedule), not from the actual send, sees the
    queueing when the server or this client falls behind, instead of a silently lower
    rate (coordinated omission)."""
    start = time.perf_counter()
    tasks: list[asyncio.Task[object]] = []
    for index, at in enumerate(arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(index, start + at)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - start
