"""A watchdog for async tests: if one runs past its limit, every task of its event loop is
written to stderr with the await it is parked at, which a thread dump (pytest-timeout's)
cannot show. Nothing is cancelled; the test goes on to pass, fail or time out."""

from __future__ import annotations

import asyncio
import io
import sys
import threading
from collections.abc import AsyncIterator


def describe_tasks(loop: asyncio.AbstractEventLoop) -> str:
    out = io.StringIO()
    for task in list(asyncio.all_tasks(loop)):
        out.write(f"--- {task!r}\n")
        task.print_stack(file=out)
    return out.getvalue()


async def watch_event_loop(test_id: str, limit_s: float) -> AsyncIterator[None]:
    """Use as the body of an async fixture around one test."""
    loop = asyncio.get_running_loop()
    finished = threading.Event()

    def watch() -> None:
        if not finished.wait(limit_s):
            report = describe_tasks(loop)
            sys.stderr.write(f"\n{test_id} still running after {limit_s:.0f} s; its tasks:\n"
                             f"{report}")
            sys.stderr.flush()

    watcher = threading.Thread(target=watch, name="asyncio-watchdog", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
