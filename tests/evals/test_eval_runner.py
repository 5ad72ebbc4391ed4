"""The eval runner's share of the engine: up to EVAL_MAX_RUNNING sequences at once while
nothing else runs, one at a time while other requests run or wait."""

from __future__ import annotations

import asyncio

from app.evals.dataset import GenerationItem
from app.evals.runner import EVAL_MAX_RUNNING, EVAL_MAX_RUNNING_BUSY, Target, score
from engine.testing import FakeEngine


async def _most_at_once(engine: FakeEngine, num_items: int) -> tuple[float, int]:
    # Each item lasts ~30 token delays: far longer than the runner takes to start the next
    # one (a first output and a poll), even on a loaded machine.
    items = [GenerationItem(f"item {i}", "never", max_tokens=30) for i in range(num_items)]
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, len(engine.active))
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    try:
        result = await score(engine, items, Target("version", None))
    finally:
        watcher.cancel()
    return result, most


async def test_an_idle_engine_gets_several_eval_sequences_at_once() -> None:
    engine = FakeEngine(token_delay_s=0.01, max_model_len=4096)
    result, most = await _most_at_once(engine, 12)
    assert result == 0.0
    assert most == EVAL_MAX_RUNNING > EVAL_MAX_RUNNING_BUSY


async def test_other_requests_in_the_engine_hold_the_eval_to_one_sequence() -> None:
    engine = FakeEngine(token_delay_s=0.01, max_model_len=4096)
    engine.num_waiting = 1  # another tenant's request is queued all along
    _, most = await _most_at_once(engine, 12)
    assert most == EVAL_MAX_RUNNING_BUSY == 1
    assert len(engine.finished) == 12  # it still gets through the set
