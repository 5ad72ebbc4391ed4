"""AsyncEngine: concurrent streams from asyncio, early close aborts and frees KV blocks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_core import RequestRejected
from engine.request import SamplingParams
from tests.utils.hf_oracle import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path):
    eng = AsyncEngine(EngineConfig(model=str(smollm2_dir), enable_prefix_caching=False))
    eng.start_sync()
    yield eng
    asyncio.run(eng.shutdown())


async def collect(engine: AsyncEngine, rid: str, ids: list[int], n: int) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(rid, ids, SamplingParams(max_tokens=n, temperature=0)):
        tokens.extend(out.new_token_ids)
    return tokens


async def test_concurrent_streams_match_hf(engine: AsyncEngine, smollm2_dir: Path) -> None:
    prompts = ["Hello, my name is", "The three primary colors are", "In 1969, astronauts"]
    ids = [engine.encode(p) for p in prompts]
    results = await asyncio.gather(*(collect(engine, f"g{i}", p, 12) for i, p in enumerate(ids)))
    for p, got in zip(ids, results, strict=True):
        assert got == hf_greedy(smollm2_dir, p, 12)


async def test_closing_the_stream_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    total = engine.stats().num_total_blocks
    ids = engine.encode("Tell me a very long story about dragons and knights.")
    gen = engine.generate(
        "long", ids, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    )
    seen = 0
    async for _ in gen:
        seen += 1
        if seen == 3:
            break
    await gen.aclose()
    for _ in range(100):
        stats = engine.stats()
        if stats.num_free_blocks == total and stats.num_running == 0:
            break
        await asyncio.sleep(0.05)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == total


async def test_cancelled_task_aborts(engine: AsyncEngine) -> None:
    total = engine.stats().num_total_blocks
    ids = engine.encode("Count from one to one thousand:")
    task = asyncio.create_task(collect(engine, "cancel-me", ids, 400))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if engine.stats().num_free_blocks == total:
            break
        await asyncio.sleep(0.05)
    assert engine.stats().num_free_blocks == total


async def test_rejects_too_long(engine: AsyncEngine) -> None:
    ids = [100] * (engine.max_model_len + 1)
    with pytest.raises(RequestRejected):
        async for _ in engine.generate("too-long", ids, SamplingParams(max_tokens=1)):
            pass
    assert engine.is_ready()
