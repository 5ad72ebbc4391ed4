"""A failed engine step fails only the requests it failed on; a broken device is fatal.

Faults are injected where real ones would surface: inside the model runner's forward
(engine/core/faults.py, as `loraplex serve` reads it from LORAPLEX_FAULTS) and in sampling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError, StreamTable, read_stream
from engine.client import EngineStepError
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.faults import FAULTS_ENV, FaultPlan
from engine.core.state import Request
from engine.core_process import ProcessEngine
from engine.request import EngineRequest, RequestOutput, SamplingParams
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.tiny_models import random_prompt

POISON = (7, 8, 9)
PREFIX = random_prompt(40, seed=99)  # two full blocks of 16 and a bit


def _config(model_dir: Path, **overrides: Any) -> EngineConfig:
    return EngineConfig(model=str(model_dir), kv_cache_tokens=2048, max_model_len=256,
                        **overrides)


def _greedy(
    rid: str, prompt: list[int], *, adapter: str | None = None, n: int = 8
) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=n, temperature=0,
                                                            ignore_eos=True), adapter=adapter)


def _run(core: EngineCore, requests: list[EngineRequest]) -> tuple[
    dict[str, list[int]], dict[str, BaseException]
]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    failures: dict[str, BaseException] = {}
    for request in requests:
        core.add_request(request)
    for _ in range(1000):
        if not core.has_unfinished_requests():
            break
        result = core.step()
        for out in result.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        failures.update(result.failures)
        assert result.fatal is None
    assert not core.has_unfinished_requests()
    return tokens, failures


def _good_requests(adapter: str | None) -> list[EngineRequest]:
    return [
        _greedy("a", random_prompt(12, seed=1)),
        _greedy("b", random_prompt(30, seed=2), adapter=adapter),
        _greedy("c", PREFIX + random_prompt(5, seed=3)),
    ]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    return tiny_model_factory("llama_gqa")


@pytest.fixture(scope="module")
def adapter_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(model_dir, tmp_path_factory.mktemp("adapter") / "a", seed=4)


@pytest.fixture(scope="module")
def reference(model_dir: Path, adapter_dir: Path) -> dict[str, list[int]]:
    """Greedy tokens of the good requests on an engine that never fails."""
    core = EngineCore(_config(model_dir))
    core.add_adapter("ad", adapter_dir)
    tokens, failures = _run(core, _good_requests("ad"))
    assert not failures
    return tokens


def test_fault_plan_parses_and_refuses() -> None:
    assert FaultPlan.parse("poison=7.8.9, broken-after=3") == FaultPlan((7, 8, 9), 3)
    with pytest.raises(ValueError, match="unknown rule"):
        FaultPlan.parse("poison")
    with pytest.raises(ValueError, match="unknown rule"):
        FaultPlan.parse("explode=1")


def test_a_poisoned_request_fails_alone_and_frees_what_it_held(
    model_dir: Path, adapter_dir: Path, reference: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(FAULTS_ENV, "poison=" + ".".join(map(str, POISON)))
    core = EngineCore(_config(model_dir))
    core.add_adapter("ad", adapter_dir)
    # The poisoned prompt shares PREFIX with "c" and the adapter with "b", in one step.
    poisoned = _greedy("poison", PREFIX + list(POISON), adapter="ad")
    tokens, failures = _run(core, [*_good_requests("ad"), poisoned])

    assert set(failures) == {"poison"}
    assert isinstance(failures["poison"], EngineStepError)
    assert "poisoned prompt" in str(failures["poison"])
    for rid in ("a", "b", "c"):
        assert tokens[rid] == reference[rid], rid
    assert core.num_step_failures >= 1 and core.consecutive_failures == 0
    assert core.block_manager.num_free_blocks == core.runner.num_blocks
    assert core.adapter_cache is not None
    assert all(r.pins == 0 and r.reservations == 0 for r in core.adapter_cache.resident())

    # The poisoned request's blocks never got their KV: nothing may hit them later.
    again, failures = _run(core, [_greedy("c", PREFIX + random_prompt(5, seed=3))])
    assert not failures and again["c"] == reference["c"]


def test_a_failure_in_sampling_fails_only_its_row(
    model_dir: Path, adapter_dir: Path, reference: dict[str, list[int]],
) -> None:
    core = EngineCore(_config(model_dir))
    core.add_adapter("ad", adapter_dir)
    sampler = core.sampler

    def sample_or_fail(logits: Any, requests: list[Request]) -> Any:
        if any(r.request_id == "bad" for r in requests):
            raise FloatingPointError("a row the sampler cannot handle")
        return sampler(logits, requests)

    core.sampler = sample_or_fail  # type: ignore[assignment]
    tokens, failures = _run(core, [*_good_requests("ad"), _greedy("bad", [5, 6])])
    assert set(failures) == {"bad"}
    assert {rid: tokens[rid] for rid in reference} == reference
    assert core.block_manager.num_free_blocks == core.runner.num_blocks


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_a_broken_device_fails_the_engine_for_good(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, engine_process: bool
) -> None:
    monkeypatch.setenv(FAULTS_ENV, "broken-after=0")  # a spawned engine process reads it too
    config = _config(model_dir, max_consecutive_step_failures=2, engine_process=engine_process)
    engine = ProcessEngine(config) if engine_process else AsyncEngine(config)
    engine.start_sync()
    # What the engine reported when each request's error reached its stream: whoever hears
    # of the fatal step's error and asks at once (as /health does) must find it failed.
    failure_at_delivery: dict[str, str | None] = {}
    deliver = engine._streams.deliver

    def recording(outputs: list[RequestOutput], errors: dict[str, BaseException]) -> None:
        failure_at_delivery.update({rid: engine.failure() for rid in errors})
        deliver(outputs, errors)

    monkeypatch.setattr(engine._streams, "deliver", recording)

    async def one(rid: str) -> list[RequestOutput]:
        return [o async for o in engine.generate(
            EngineRequest(rid, (5, 6, 7), SamplingParams(max_tokens=2))
        )]

    async def scenario() -> None:
        with pytest.raises(EngineStepError):
            await one("r1")
        assert engine.failure() is None and engine.is_ready()
        with pytest.raises(EngineStepError):  # its own error, not the dead engine's
            await one("r2")
        assert failure_at_delivery["r1"] is None
        reason = failure_at_delivery["r2"]
        assert reason is not None and reason == engine.failure()
        assert reason is not None and "2 engine steps in a row failed" in reason
        assert "device is broken" in reason
        assert not engine.is_ready()
        with pytest.raises(EngineDeadError):
            await one("r3")
        assert engine.stats().num_step_failures == 2
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_stream_opened_after_the_engine_died_ends_with_its_death() -> None:
    """The engine can die between a caller's check and the open of its stream (the engine
    process's generate sends the request after the open and checks nothing after, so that
    a request whose own step killed the engine gets its own error): a stream opened after
    fail_all ends with fail_all's error at once instead of waiting for ever; one opened
    before ends with it too."""

    async def scenario() -> None:
        table = StreamTable()
        live = table.open("before")
        table.fail_all(EngineDeadError("engine failed: gone"))
        late = table.open("after")
        assert late.finished and "after" not in table and "before" not in table
        for stream in (live, late):
            with pytest.raises(EngineDeadError, match="gone"):
                await asyncio.wait_for(anext(read_stream(stream)), timeout=5)

    asyncio.run(scenario())


def test_requests_that_break_the_model_alone_never_fail_the_engine(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One poisoned request after another, with nothing else running: each fails, and the
    device probe keeps the engine serving."""
    monkeypatch.setenv(FAULTS_ENV, "poison=" + ".".join(map(str, POISON)))
    engine = AsyncEngine(_config(model_dir, max_consecutive_step_failures=2))
    engine.start_sync()

    async def scenario() -> None:
        for i in range(4):
            with pytest.raises(EngineStepError):
                async for _ in engine.generate(
                    EngineRequest(f"p{i}", (1, *POISON), SamplingParams())
                ):
                    pass
        assert engine.failure() is None
        outs = [o async for o in engine.generate(
            EngineRequest("ok", (1, 2, 3), SamplingParams(max_tokens=3, ignore_eos=True))
        )]
        assert outs[-1].finished and outs[-1].num_output_tokens == 3
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_request_reading_blocks_a_failed_request_was_computing_fails_too(
    model_dir: Path, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admitted after the poisoned request in one step, "c" hits the prefix blocks that the
    poisoned request was to compute: they never got their KV, so "c" cannot run on them."""
    monkeypatch.setenv(FAULTS_ENV, "poison=" + ".".join(map(str, POISON)))
    core = EngineCore(_config(model_dir))
    poisoned = _greedy("poison", PREFIX + list(POISON))
    c = _greedy("c", PREFIX + random_prompt(5, seed=3))
    _, failures = _run(core, [poisoned, c])
    assert set(failures) == {"poison", "c"}
    assert "cached prompt prefix" in str(failures["c"])
    assert core.block_manager.num_free_blocks == core.runner.num_blocks
    again, failures = _run(core, [_greedy("c", PREFIX + random_prompt(5, seed=3))])
    assert not failures and again["c"] == reference["c"]
