"""AsyncEngine: concurrent streams from asyncio, early close aborts and frees KV blocks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.client import RouteHint
from engine.config import EngineConfig
from engine.errors import EngineDeadError, RequestRejected
from engine.request import EngineRequest, SamplingParams
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
    request = EngineRequest(rid, tuple(ids), SamplingParams(max_tokens=n, temperature=0))
    async for out in engine.generate(request):
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
    gen = engine.generate(EngineRequest(
        "long", tuple(ids), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    ))
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
        async for _ in engine.generate(EngineRequest("too-long", tuple(ids),
                                                     SamplingParams(max_tokens=1))):
            pass
    assert engine.is_ready()


async def test_runs_everything_itself(engine: AsyncEngine) -> None:
    assert engine.route(["a", "b"], RouteHint("some-adapter", "t", dedicated=True)) is None
    engine.release(["a", "b"])  # nothing to forget
    [worker] = engine.workers()
    stats = engine.stats()
    assert (worker.id, worker.model, worker.ready) == ("local", engine.model_id, True)
    assert worker.stats.num_total_blocks == stats.num_total_blocks
    assert (worker.adapters, worker.residency) == (engine.list_adapters(), [])
    assert (worker.url, worker.in_rotation, worker.inflight) == (None, None, None)


async def test_a_stopped_engine_refuses_with_engine_failed() -> None:
    stopped = AsyncEngine(EngineConfig(model="unused"))
    stopped._stopping = True
    with pytest.raises(EngineDeadError) as dead:
        async for _ in stopped.generate(EngineRequest("r", (1,), SamplingParams())):
            pass
    assert dead.value.code == "engine_failed"


async def test_stats_count_steps_and_the_kv_filled_in_blocks(engine: AsyncEngine) -> None:
    before = engine.stats()
    ids = engine.encode("Count the steps: one, two, three,")
    request = EngineRequest(
        "steps", tuple(ids), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    filled: list[tuple[int, int]] = []
    async for _ in engine.generate(request):
        stats = engine.stats()
        filled.append((stats.kv_filled_slots, stats.num_total_blocks - stats.num_free_blocks))
    after = engine.stats()
    # One prefill step (the prompt fits the budget), then one step per further token.
    assert after.num_steps - before.num_steps == 6
    assert after.step_seconds > before.step_seconds
    assert after.block_size == 16
    # While it runs, the blocks held are this request's: its tokens fill all but the tail
    # (a block the step in progress took counts with the token it is writing; the two
    # figures are read a moment apart, while the step thread runs).
    # Read once it finished (the last token), it holds nothing.
    running = [(n, b) for n, b in filled if b]
    assert running
    for num_filled, num_blocks in running:
        assert len(ids) <= num_filled <= len(ids) + 6, (num_filled, len(ids))
        assert abs(num_blocks - -(-num_filled // 16)) <= 1
