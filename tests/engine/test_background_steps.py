"""Background steps cut short (engine/core/background.py): a step of background rows only
(decodes or prompt chunks) stops between layers when a foreground request is queued
meanwhile; nothing of it is applied, a block it would have filled leaves the prefix cache
until a step writes it, and every request's tokens (and prompt logprobs) stay those it gets
uncut, which for greedy tokens are Hugging Face's for it alone. Steps with a foreground row,
and engines without a background priority, are never cut."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from torch import nn

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.state import Request
from engine.request import EngineRequest, SamplingParams
from tests.utils.hf_oracle import hf_greedy

BACKGROUND, FOREGROUND = 2, 0
BLOCK = 16


def _request(rid: str, ids: list[int], n: int, priority: int) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=tuple(ids),
                         sampling=SamplingParams(max_tokens=n, temperature=0),
                         priority=priority)


def _on_layer(core: EngineCore, index: int, fn: Callable[[], None]) -> None:
    """fn runs before layer `index` of every forward, after the engine's own check there."""
    layer: nn.Module = core.runner.model.layers[index]
    layer.register_forward_pre_hook(lambda *_: fn())


def _state(core: EngineCore, rid: str) -> Request:
    request = core.scheduler.get_request(rid)
    assert request is not None
    return request


def _run(core: EngineCore, tokens: dict[str, list[int]]) -> None:
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def _cut_once(core: EngineCore, priority: int = FOREGROUND) -> list[bool]:
    """An arrival of `priority` noted during the next forward's first layer; the flag
    says whether it is still to come."""
    armed = [True]

    def arrive() -> None:
        if armed[0]:
            armed[0] = False
            core.background.note_arrival(priority)

    _on_layer(core, 0, arrive)
    return armed


@pytest.fixture
def model(tiny_model_factory) -> Path:
    return tiny_model_factory("llama_gqa")


def test_a_background_step_is_cut_by_a_foreground_arrival_and_nothing_of_it_applied(
    model: Path,
) -> None:
    core = EngineCore(EngineConfig(model=str(model), block_size=BLOCK))
    # 15 prompt tokens: the first decode computes position 15 and fills block 0.
    bg_ids, fg_ids = list(range(300, 315)), list(range(500, 509))
    core.add_request(_request("bg", bg_ids, 12, BACKGROUND))
    tokens: dict[str, list[int]] = {}
    for out in core.step().outputs:  # the prefill samples the first token
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    bg = _state(core, "bg")
    assert bg.num_computed_tokens == 15 and len(tokens["bg"]) == 1

    armed = _cut_once(core)  # a foreground request queued while layer 0 runs
    result = core.step()
    assert not armed[0]
    assert result.outputs == [] and not result.idle and not result.failures
    assert core.background.num_cut == 1
    assert bg.num_computed_tokens == 15  # nothing applied
    block0 = bg.block_ids[0]
    assert not core.block_manager.is_cached(block0)  # not written whole: not a cache hit

    core.add_request(_request("fg", fg_ids, 8, FOREGROUND))
    core.background.take_in()
    _run(core, tokens)
    assert core.background.num_cut == 1
    assert tokens["bg"] == hf_greedy(model, bg_ids, 12)
    assert tokens["fg"] == hf_greedy(model, fg_ids, 8)


def test_the_cut_tokens_block_is_cached_again_once_written(model: Path) -> None:
    core = EngineCore(EngineConfig(model=str(model), block_size=BLOCK))
    core.add_request(_request("bg", list(range(300, 315)), 4, BACKGROUND))
    core.step()
    bg = _state(core, "bg")
    _cut_once(core)
    core.step()  # cut
    assert not core.block_manager.is_cached(bg.block_ids[0])
    core.background.take_in()
    core.step()  # the same decode, whole
    assert bg.num_computed_tokens == 16
    assert core.block_manager.is_cached(bg.block_ids[0])


def test_a_background_prompt_chunk_is_cut_and_resumes_with_the_same_prompt_logprobs(
    model: Path,
) -> None:
    ids = list(range(300, 340))

    def run(cut: bool) -> tuple[list[int], list[object], int]:
        core = EngineCore(EngineConfig(model=str(model), block_size=BLOCK))
        core.add_request(EngineRequest(
            request_id="bg", prompt_token_ids=tuple(ids),
            sampling=SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=2),
            priority=BACKGROUND))
        if cut:
            armed = _cut_once(core)
            result = core.step()  # the prompt's forward, cut
            assert not armed[0] and result.outputs == []
            bg = _state(core, "bg")
            assert bg.num_computed_tokens == 0 and not any(
                core.block_manager.is_cached(b) for b in bg.block_ids)
            core.background.take_in()
        tokens: list[int] = []
        prompt_logprobs: list[object] = []
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens.extend(out.new_token_ids)
                if out.prompt_logprobs is not None:
                    prompt_logprobs = list(out.prompt_logprobs)
        return tokens, prompt_logprobs, core.background.num_cut

    cut_tokens, cut_logprobs, cuts = run(cut=True)
    tokens, logprobs, no_cuts = run(cut=False)
    assert (cuts, no_cuts) == (1, 0)
    assert cut_tokens == tokens == hf_greedy(model, ids, 5)
    assert len(logprobs) == len(ids) and cut_logprobs == logprobs


@pytest.mark.parametrize("case", ["foreground_row", "foreground_prefill",
                                  "no_background_priority", "background_arrival"])
def test_steps_that_are_not_cut(model: Path, case: str) -> None:
    background_priority = None if case == "no_background_priority" else BACKGROUND
    core = EngineCore(EngineConfig(model=str(model), block_size=BLOCK,
                                   background_priority=background_priority))
    requests = [_request("bg", list(range(300, 320)), 6, BACKGROUND)]
    if case == "foreground_row":  # a foreground decode in the same step
        requests.append(_request("fg", list(range(400, 410)), 6, FOREGROUND))
    for request in requests:
        core.add_request(request)
    core.step()  # prefills; every row decodes from here on
    if case == "foreground_prefill":  # a foreground prompt beside the background decode
        requests.append(_request("fg", list(range(400, 410)), 6, FOREGROUND))
        core.add_request(requests[-1])
        core.background.take_in()
    armed = _cut_once(core, BACKGROUND if case == "background_arrival" else FOREGROUND)
    result = core.step()  # the step an arrival lands in
    assert not armed[0] and core.background.num_cut == 0
    assert {out.request_id for out in result.outputs} == {r.request_id for r in requests}
    core.background.take_in()
    tokens: dict[str, list[int]] = {}
    _run(core, tokens)
    assert core.background.num_cut == 0


async def test_a_foreground_request_cuts_an_eval_like_stream_through_the_async_engine(
    model: Path,
) -> None:
    engine = AsyncEngine(EngineConfig(model=str(model), block_size=BLOCK))
    engine.start_sync()
    core = engine.core
    reached, hold = threading.Event(), threading.Event()

    def wait_for_an_arrival() -> None:  # on the step thread, inside a background step
        if hold.is_set():
            hold.clear()
            reached.set()
            deadline = time.monotonic() + 10
            while core.background._arrivals == core.background._taken_in:
                assert time.monotonic() < deadline, "no arrival was noted"
                time.sleep(0.001)

    _on_layer(core, 0, wait_for_an_arrival)
    bg_ids, fg_ids = list(range(300, 330)), list(range(600, 612))

    async def collect(request: EngineRequest, first: asyncio.Event | None = None) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(request):
            tokens.extend(out.new_token_ids)
            if first is not None:
                first.set()
        return tokens

    try:
        first = asyncio.Event()
        bg = asyncio.create_task(collect(_request("bg", bg_ids, 40, BACKGROUND), first))
        await first.wait()  # decoding
        hold.set()
        assert await asyncio.to_thread(reached.wait, 10)
        fg = await collect(_request("fg", fg_ids, 6, FOREGROUND))
        background = await bg
        assert engine.stats().num_steps_cut == 1
    finally:
        await engine.shutdown()
    assert core.background.num_cut == 1
    assert fg == hf_greedy(model, fg_ids, 6)
    assert background == hf_greedy(model, bg_ids, 40)
