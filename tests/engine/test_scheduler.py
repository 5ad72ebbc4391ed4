"""Scheduler: budgets, chunked prefill, order, preemption, max_loras; no model, simulated steps."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.state import Request, RequestStatus, SchedulerOutput
from tests.utils import factories


def make_request(*args: Any, adapter_key: str | None = None, **kwargs: Any) -> Request:
    """A request as the engine admits it: `adapter_key` is its adapter version's key."""
    request = factories.make_request(*args, **kwargs)
    request.adapter_key = adapter_key
    return request


BS = 4


def make_scheduler(
    num_blocks: int = 16,
    *,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_loras: int = 2,
    enable_prefix_caching: bool = True,
    long_prefill_token_threshold: int | None = 0,
    max_num_partial_prefills: int = 1,
    max_long_partial_prefills: int = 1,
) -> Scheduler:
    """By default without the long-prefill cap: plain chunking, one budget filled in order
    (tests/engine/test_scheduler_prefills.py tests the caps)."""
    config = EngineConfig(
        block_size=BS,
        long_prefill_token_threshold=long_prefill_token_threshold,
        max_num_partial_prefills=max_num_partial_prefills,
        max_long_partial_prefills=max_long_partial_prefills,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_loras=max_loras,
        enable_prefix_caching=enable_prefix_caching,
    )
    # A clock standing still at 0: the arrival times below (seconds) never age.
    return Scheduler(
        config, BlockManager(num_blocks, BS, enable_prefix_caching), clock=lambda: 0.0
    )


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step without a model: the n-th sampled token (from 0) is 1000 + n; finish
    at max_tokens."""
    out = s.schedule()
    sampling = [c.request for c in out.chunks if c.samples]
    s.update_after_step(out)
    for request in sampling:
        request.output_token_ids.append(1000 + request.num_output_tokens)
        if request.num_output_tokens >= request.sampling.max_tokens:
            s.finish_request(request, RequestStatus.FINISHED_LENGTH)
    return out


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def run_all(s: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
    outs: list[SchedulerOutput] = []
    while s.has_unfinished_requests():
        assert len(outs) < max_steps, "did not finish"
        outs.append(step(s))
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    return outs


def test_chunked_prefill_budget_and_decodes_first() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 20, max_tokens=2)
    b = make_request("b", 6, max_tokens=2, first_token=100)
    s.add_request(a)
    s.add_request(b)
    assert [chunks(step(s)) for _ in range(5)] == [
        [("a", 0, 8)],
        [("a", 8, 8)],
        [("a", 16, 4), ("b", 0, 4)],
        [("a", 20, 1), ("b", 4, 2)],
        [("b", 6, 1)],
    ]
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [1000, 1001]
    assert not s.has_unfinished_requests()
    assert s.block_manager.num_free_blocks == 16


def test_decodes_listed_before_prefills_whatever_the_running_order() -> None:
    s = make_scheduler(max_num_batched_tokens=40)
    s.add_request(make_request("a", 3, max_tokens=4))
    s.add_request(make_request("b", 50, max_tokens=4, first_token=100))
    assert chunks(step(s)) == [("a", 0, 3), ("b", 0, 37)]
    s.running.reverse()  # b is served first now, yet a's decode must come first
    out = step(s)
    assert chunks(out) == [("a", 3, 1), ("b", 37, 13)]
    run_all(s)


def test_max_num_seqs_caps_running_requests() -> None:
    s = make_scheduler(max_num_seqs=2)
    for name, max_tokens in (("a", 1), ("b", 3), ("c", 1)):
        s.add_request(make_request(name, 4, max_tokens=max_tokens, first_token=ord(name)))
    assert chunks(step(s)) == [("a", 0, 4), ("b", 0, 4)]
    assert (s.num_running, s.num_waiting) == (1, 1)  # a finished after its first token
    assert chunks(step(s)) == [("b", 4, 1), ("c", 0, 4)]
    assert chunks(step(s)) == [("b", 5, 1)]
    assert not s.has_unfinished_requests()


def test_waiting_order_priority_then_arrival_then_insertion() -> None:
    s = make_scheduler(max_num_seqs=1)
    specs = [("a", 1, 1.0), ("b", 0, 2.0), ("c", 0, 3.0), ("d", 1, 0.5), ("e", 0, 2.0)]
    for name, priority, arrival in specs:
        s.add_request(make_request(name, 4, max_tokens=1, priority=priority, arrival_time=arrival))
    assert [r.request_id for r in s.waiting] == ["b", "e", "c", "d", "a"]
    order = [chunks(out)[0][0] for out in run_all(s)]
    assert order == ["b", "e", "c", "d", "a"]


def test_same_step_prefix_hit_and_fully_cached_prompt() -> None:
    s = make_scheduler()
    a = make_request("a", 10, max_tokens=1)
    b = make_request("b", 10, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    # b hits the two full blocks a registers in the very same step.
    assert chunks(step(s)) == [("a", 0, 10), ("b", 8, 2)]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    c = make_request("c", 8, max_tokens=1)
    d = make_request("d", 9, max_tokens=1)
    s.add_request(c)
    s.add_request(d)
    # c is fully cached but must compute its last token: one block hits, not two.
    assert chunks(step(s)) == [("c", 4, 4), ("d", 8, 1)]
    assert c.block_ids == [] and c.num_cached_tokens == 4
    assert d.num_cached_tokens == 8
    bm = s.block_manager
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (37, 20)
    assert bm.num_free_blocks == 16


def test_preemption_picks_latest_arrival_and_it_recomputes() -> None:
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=32, max_num_seqs=2)
    a = make_request("a", 7, max_tokens=6, arrival_time=1.0)
    b = make_request("b", 7, max_tokens=6, arrival_time=2.0, first_token=100)
    s.add_request(a)
    s.add_request(b)
    bm = s.block_manager
    assert chunks(step(s)) == [("a", 0, 7), ("b", 0, 7)]
    # c arrived before b but found no free sequence slot.
    c = make_request("c", 3, max_tokens=1, arrival_time=1.5, first_token=200)
    s.add_request(c)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    assert chunks(step(s)) == [("a", 7, 1), ("b", 7, 1)]
    out = step(s)  # both need a third block; none is free
    assert chunks(out) == [("a", 8, 1)]
    assert out.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.block_ids, b.num_preemptions) == (0, [], 1)
    assert s.num_preemptions == 1
    assert b.output_token_ids == [1000, 1001]  # kept: re-prefilled over prompt + output
    # b freed tail first: 3 then 2, both cached; a took block 3, evicting b's second block.
    assert a.block_ids == [0, 1, 3]
    assert bm.free_block_ids() == [2]
    # A preempted request goes to the front of its priority, before the older c; c may not
    # pass b while b waits for blocks.
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    outs = run_all(s)
    # b comes back once a is done, hits its first block and recomputes the rest.
    resumed = next(out for out in outs if "b" in [c[0] for c in chunks(out)])
    assert chunks(resumed) == [("b", 4, 5), ("c", 0, 3)]
    assert b.block_ids == [] and s.num_preemptions == 1
    assert b.num_cached_tokens == 0  # counted at first admission only
    assert b.output_token_ids == [1000, 1001, 1002, 1003, 1004, 1005]


def test_preempting_itself_when_it_is_the_worst() -> None:
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    a = make_request("a", 7, max_tokens=6, priority=1, arrival_time=1.0)
    b = make_request("b", 7, max_tokens=6, priority=0, arrival_time=2.0, first_token=100)
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)
    assert [r.request_id for r in s.running] == ["b", "a"]
    s.running.reverse()  # a asks first, and a is the victim: it gives way to b
    out = step(s)
    assert chunks(out) == [("b", 8, 1)]
    assert out.preempted == [a]
    assert b.block_ids == [0, 1, 3]
    assert s.block_manager.free_block_ids() == [2]
    run_all(s)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH


def test_victim_scheduled_earlier_in_the_step_is_unscheduled() -> None:
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    bm = s.block_manager
    b = make_request("b", 6, max_tokens=6, priority=1)
    s.add_request(b)
    step(s)
    a = make_request("a", 8, max_tokens=6, priority=0, first_token=100)
    s.add_request(a)
    assert chunks(step(s)) == [("b", 6, 1), ("a", 0, 8)]
    assert (b.block_ids, a.block_ids) == ([0, 1], [2, 3])
    c = make_request("c", 3, max_tokens=1, first_token=200)
    s.add_request(c)
    # b's decode fits in block 1 and fills it; then a needs a block and b is the victim.
    # No admission in a step that preempted, although c would fit in the last free block.
    out = step(s)
    assert chunks(out) == [("a", 8, 1)]
    assert out.preempted == [b]
    assert [r.request_id for r in s.waiting] == ["c", "b"]
    # b's block 1 was registered for KV the step never wrote: forgotten, reused first.
    assert a.block_ids == [2, 3, 1]
    assert bm.free_block_ids() == [0]
    assert bm.is_cached(0)
    run_all(s)


def test_victim_scheduled_earlier_gives_its_tokens_back() -> None:
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=8)
    b = make_request("b", 6, max_tokens=4, priority=1)
    s.add_request(b)
    step(s)
    a = make_request("a", 17, max_tokens=1, first_token=100)
    s.add_request(a)
    assert chunks(step(s)) == [("b", 6, 1), ("a", 0, 7)]
    # a needs 10 more; after b's decode 7 fit the budget, and they need 2 blocks, 1 is free.
    # b is preempted, its token goes back to the budget: a gets 8.
    out = step(s)
    assert chunks(out) == [("a", 7, 8)]
    assert out.preempted == [b]
    assert a.block_ids == [2, 3, 1, 4]
    assert s.block_manager.free_block_ids() == [0]
    run_all(s)


def test_abort_frees_blocks_and_leaves_queues() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 12)
    b = make_request("b", 4, first_token=50)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert a.block_ids == [0, 1]
    assert s.abort_request("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.block_ids == []
    assert s.abort_request("b") is b
    assert s.abort_request("b") is None
    assert s.abort_request("nope") is None
    assert s.get_request("a") is None
    assert (s.num_running, s.num_waiting) == (0, 0)
    assert s.block_manager.num_free_blocks == 16
    assert s.schedule().is_empty


def test_max_loras_skips_then_holds_for_the_head() -> None:
    s = make_scheduler(max_loras=1)
    specs = [("a", "x", 2), ("b", "y", 1), ("c", "x", 1), ("d", None, 3)]
    for i, (name, adapter, max_tokens) in enumerate(specs):
        s.add_request(
            make_request(name, 4, max_tokens=max_tokens, adapter_key=adapter, first_token=10 * i)
        )
    # b is blocked but not yet the head: c (same adapter as a) and d (base model) pass.
    assert chunks(step(s)) == [("a", 0, 4), ("c", 0, 4), ("d", 0, 4)]
    s.add_request(make_request("e", 4, max_tokens=1, adapter_key="x", first_token=40))
    # b is the head now and still blocked: e (adapter x, which fits) is held back.
    assert chunks(step(s)) == [("a", 4, 1), ("d", 4, 1)]
    assert chunks(step(s)) == [("d", 5, 1), ("b", 0, 4)]
    assert chunks(step(s)) == [("e", 0, 4)]
    assert not s.has_unfinished_requests()


def test_adapter_stream_does_not_starve_the_head() -> None:
    s = make_scheduler(max_loras=1)
    s.add_request(make_request("x0", 4, max_tokens=3, adapter_key="x"))
    s.add_request(make_request("y", 4, max_tokens=1, adapter_key="y", first_token=50))
    admitted_at: dict[str, int] = {}
    for n in range(1, 12):
        s.add_request(make_request(f"x{n}", 4, max_tokens=3, adapter_key="x"))
        out = step(s)
        adapters = {c.request.adapter_key for c in out.chunks}
        assert len(adapters) <= 1
        for c in out.chunks:
            admitted_at.setdefault(c.request.request_id, n)
    # x0 and x1 (admitted with x0 before y became the head) finish in step 3; new x
    # requests are held meanwhile, so y gets the slot in step 4.
    assert admitted_at["y"] == 4
    assert min(n for name, n in admitted_at.items() if name not in ("x0", "x1", "y")) == 5
    run_all(s)


def test_add_request_rejects_what_cannot_fit_and_duplicates() -> None:
    s = make_scheduler(num_blocks=4)
    s.add_request(make_request("ok", 8, max_tokens=9))  # 16 tokens of KV at most
    with pytest.raises(ValueError, match="17 tokens of KV"):
        s.add_request(make_request("big", 8, max_tokens=10))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("ok", 4))
    assert s.max_tokens_capacity == 16
    run_all(s)


def _check_invariants(s: Scheduler, out: SchedulerOutput) -> None:
    cfg = s.config
    assert out.num_tokens <= cfg.max_num_batched_tokens
    assert s.num_running <= cfg.max_num_seqs
    assert len({c.request.adapter_key for c in out.chunks} - {None}) <= cfg.max_loras
    assert len({r.adapter_key for r in s.running} - {None}) <= cfg.max_loras
    kinds = [c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens for c in out.chunks]
    assert kinds == sorted(kinds, reverse=True)  # decodes, then prefills
    bm = s.block_manager
    holders = [0] * bm.num_blocks
    for r in s.running:
        assert len(r.block_ids) * BS >= r.num_computed_tokens
        for b in r.block_ids:
            holders[b] += 1
    assert all(not r.block_ids for r in s.waiting)
    assert holders == [bm.ref_count(b) for b in range(bm.num_blocks)]
    assert sorted(bm.free_block_ids()) == [b for b in range(bm.num_blocks) if not holders[b]]


# (long_prefill_token_threshold, max_num_partial_prefills, max_long_partial_prefills)
CAPS = [(0, 1, 1), (4, 1, 1), (6, 3, 2)]


@pytest.mark.parametrize("caps", CAPS, ids=[f"caps{c}" for c in CAPS])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_invariants_and_frees_everything(
    seed: int, caps: tuple[int, int, int]
) -> None:
    rng = random.Random(seed)
    threshold, num_partial, num_long = caps
    s = make_scheduler(
        num_blocks=8, max_num_batched_tokens=16, max_num_seqs=4,
        enable_prefix_caching=seed % 3 != 2, long_prefill_token_threshold=threshold,
        max_num_partial_prefills=num_partial, max_long_partial_prefills=num_long,
    )
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    requests: list[Request] = []
    for n in range(300):
        if n < 120 and rng.random() < 0.4:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 9)] + [
                rng.randrange(50) for _ in range(rng.randrange(0, 12))
            ]
            request = make_request(
                f"r{n}",
                prompt,
                max_tokens=rng.randrange(1, 10),
                priority=rng.randrange(2),
                adapter_key=rng.choice([None, "x", "y", "z"]),
                salt=rng.choice([None, "t"]),
            )
            s.add_request(request)
            requests.append(request)
        if s.running and rng.random() < 0.05:
            s.abort_request(rng.choice(s.running).request_id)
        if not s.has_unfinished_requests():
            continue
        out = step(s)
        _check_invariants(s, out)
    run_all(s)
    for r in requests:
        assert r.is_finished
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.sampling.max_tokens
    assert s.num_preemptions > 0  # the workload is sized to run out of blocks
