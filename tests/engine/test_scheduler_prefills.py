"""Scheduler: long prefills capped, running prefills ordered with waiting requests, seats.

No model: simulated steps (tests/engine/test_scheduler.py's `step`). The figures a flood
gives on the real engine are in `loraplex bench prefill` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.state import Request, SchedulerOutput
from engine.request import TenantContext
from tests.engine.test_scheduler import _check_invariants, chunks, run_all, step
from tests.utils import factories

BS = 4
A = TenantContext("A")
B = TenantContext("B")
PREMIUM, BATCH = 0, 2


def make_scheduler(
    num_blocks: int = 256, *, max_num_batched_tokens: int = 32, **config: Any
) -> Scheduler:
    cfg = EngineConfig(
        block_size=BS, max_num_batched_tokens=max_num_batched_tokens, **config
    )
    return Scheduler(cfg, BlockManager(num_blocks, BS, True), clock=lambda: 0.0)


_next_token = iter(range(1000, 10**9, 1000))


def req(
    name: str,
    prompt: int | list[int],
    *,
    tenant: TenantContext | None = None,
    max_tokens: int = 4,
    **kwargs: Any,
) -> Request:
    """A request whose prompt shares nothing with another's unless given as token ids."""
    request = factories.make_request(
        name, prompt, max_tokens=max_tokens, first_token=next(_next_token), **kwargs
    )
    request.tenant = tenant
    return request


def first_token_step(s: Scheduler, request: Request, max_steps: int = 200) -> int:
    """Steps until `request` samples its first token (1: the next step)."""
    for n in range(1, max_steps + 1):
        step(s)
        if request.num_output_tokens:
            return n
    raise AssertionError(f"{request.request_id} got no token in {max_steps} steps")


def served(out: SchedulerOutput) -> dict[str, int]:
    return {c.request.request_id: c.num_tokens for c in out.chunks}


# ---------------------------------------------------------------- long prefills


def test_config_caps() -> None:
    assert EngineConfig(max_num_batched_tokens=2048).long_prefill_cap == 512
    assert EngineConfig(long_prefill_token_threshold=300).long_prefill_cap == 300
    assert EngineConfig(long_prefill_token_threshold=0).long_prefill_cap is None
    with pytest.raises(ValueError, match="cannot exceed"):
        EngineConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match=">= 1"):
        EngineConfig(max_num_partial_prefills=0)
    with pytest.raises(ValueError, match=">= 0"):
        EngineConfig(long_prefill_token_threshold=-1)


def test_lone_long_prompt_still_fills_every_step() -> None:
    """The cap decides who goes first, not how full a step is."""
    capped = make_scheduler(long_prefill_token_threshold=8)
    plain = make_scheduler(long_prefill_token_threshold=0)
    long = req("long", 100, max_tokens=2)
    capped.add_request(long)
    plain.add_request(req("long", list(long.prompt_token_ids), max_tokens=2))
    capped_steps = [served(o)["long"] for o in run_all(capped)]
    plain_steps = [served(o)["long"] for o in run_all(plain)]
    assert capped_steps == plain_steps == [32, 32, 32, 4, 1]


def test_short_prompt_goes_before_the_rest_of_a_long_one() -> None:
    s = make_scheduler(long_prefill_token_threshold=16)
    long = req("long", 200)
    s.add_request(long)
    step(s)  # long is running now, 32 tokens in
    short = req("short", 12)
    s.add_request(short)
    out = step(s)
    # long's capped chunk (16), short whole (12), then long takes what is left (4).
    assert served(out) == {"long": 20, "short": 12}
    assert short.num_output_tokens == 1
    assert out.num_tokens == 32


def test_without_the_cap_the_short_prompt_waits_for_the_long_one() -> None:
    s = make_scheduler(long_prefill_token_threshold=0)
    long = req("long", 200)
    s.add_request(long)
    step(s)
    short = req("short", 12)
    s.add_request(short)
    assert first_token_step(s, short) == 6  # 168 tokens of long first, 32 a step


def test_long_prompts_arriving_ahead_do_not_hold_back_short_ones() -> None:
    """Queue order says long, long, short; only one long is served in the first pass."""
    s = make_scheduler(long_prefill_token_threshold=12)
    s.add_request(req("long1", 100))
    s.add_request(req("long2", 100))
    s.add_request(req("short", 10))
    out = step(s)
    # long1 12, long2 left out (one long at a time), short 10; long1 takes the 10 left.
    assert chunks(out) == [("long1", 0, 22), ("short", 0, 10)]


def test_prefills_the_caps_left_out_take_what_is_left() -> None:
    s = make_scheduler(long_prefill_token_threshold=8, max_num_batched_tokens=64)
    s.add_request(req("long1", 30))
    s.add_request(req("long2", 100))
    out = step(s)
    # long1 gets 8, long2 is left out (one long at a time); leftover: long1's 22 more, then
    # long2, uncapped, the last 34.
    assert chunks(out) == [("long1", 0, 30), ("long2", 0, 34)]


def test_two_long_partial_prefills_share_the_first_pass() -> None:
    s = make_scheduler(
        long_prefill_token_threshold=8, max_num_partial_prefills=2, max_long_partial_prefills=2
    )
    for name in ("l1", "l2", "l3"):
        s.add_request(req(name, 100))
    s.add_request(req("short", 6))
    out = step(s)
    # l1 and l2 get 8 each, l3 is the third long; short whole; leftover 10 to l1.
    assert chunks(out) == [("l1", 0, 18), ("l2", 0, 8), ("short", 0, 6)]


def test_partial_prefill_limit_keeps_a_short_chunk_for_later() -> None:
    """One partial prefill per step (the default): a prompt that would be cut at the
    budget's end waits for the next step while the long one's chunk is partial."""
    s = make_scheduler(long_prefill_token_threshold=8, max_num_batched_tokens=20)
    s.add_request(req("long", 100))
    s.add_request(req("s1", 8))
    s.add_request(req("s2", 8))
    out = step(s)
    # long 8 (partial), s1 8 (whole), s2 would get 4 (partial: refused); leftover to long.
    assert chunks(out) == [("long", 0, 12), ("s1", 0, 8)]


# ---------------------------------------------------------------- fairness inside the step


def _flood(s: Scheduler, tenant: TenantContext, n: int, prefix: list[int], **kw: Any) -> None:
    for i in range(n):
        s.add_request(
            req(f"flood{i}", [*prefix, *range(5000 + 40 * i, 5000 + 40 * i + 24)],
                tenant=tenant, max_tokens=8, **kw)
        )


@pytest.mark.parametrize("fairness", ["vtc", "fcfs"])
def test_another_tenant_is_served_in_the_next_step_of_a_prefix_flood(fairness: str) -> None:
    """A floods with 32 prefill-heavy requests sharing a long prefix; B's short request."""
    s = make_scheduler(
        max_num_batched_tokens=64, max_num_seqs=64, fairness=fairness,
        max_num_partial_prefills=4, max_long_partial_prefills=4,
    )
    _flood(s, A, 32, list(range(200)))
    for _ in range(3):
        step(s)
    # Several of A's requests are running prefills: 16 tokens each per step, then more.
    assert sum(1 for r in s.running if r.num_computed_tokens < r.num_prompt_tokens) >= 3
    probe = req("probe", 10, tenant=B)
    s.add_request(probe)
    steps = first_token_step(s, probe)
    if fairness == "vtc":
        assert steps == 1
    else:
        assert steps > 3  # arrival order: behind the flood's running prefills


@pytest.mark.parametrize("fairness", ["vtc", "fcfs"])
def test_premium_is_served_in_the_next_step_of_a_batch_flood(fairness: str) -> None:
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=64, fairness=fairness)
    for i in range(8):
        s.add_request(req(f"batch{i}", 300, tenant=A, priority=BATCH))
    for _ in range(3):
        step(s)
    probe = req("premium", 40, tenant=B, priority=PREMIUM)
    s.add_request(probe)
    assert first_token_step(s, probe) == 1


def test_same_tenant_running_prefills_go_before_its_waiting_requests() -> None:
    s = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=0)
    first = req("first", 40, tenant=A)
    s.add_request(first)
    step(s)
    s.add_request(req("second", 8, tenant=A))
    assert chunks(step(s)) == [("first", 16, 16)]


def test_vtc_order_moves_within_the_step() -> None:
    """A's decodes are charged first, so B's waiting request passes A's running prefill."""
    s = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=0)
    s.add_request(req("a_decode", 4, tenant=A, max_tokens=10))
    step(s)
    s.add_request(req("a_prefill", 60, tenant=A))
    step(s)  # a_prefill is running now, 15 of 60
    s.add_request(req("b", 6, tenant=B))
    out = step(s)
    assert chunks(out)[:2] == [("a_decode", 5, 1), ("b", 0, 6)]


# ---------------------------------------------------------------- seats


def test_a_higher_tier_takes_the_seat_of_the_worst_running_request() -> None:
    s = make_scheduler(max_num_seqs=2)
    s.add_request(req("b1", 4, tenant=A, priority=BATCH, max_tokens=20, arrival_time=1.0))
    s.add_request(req("b2", 4, tenant=A, priority=BATCH, max_tokens=20, arrival_time=2.0))
    step(s)
    premium = req("p", 4, tenant=B, priority=PREMIUM)
    s.add_request(premium)
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["b2"]
    assert "p" in served(out) and premium.num_output_tokens == 1
    run_all(s)


def test_the_same_tier_waits_for_a_seat() -> None:
    s = make_scheduler(max_num_seqs=2)
    for name in ("a1", "a2"):
        s.add_request(req(name, 4, tenant=A, max_tokens=5))
    step(s)
    other = req("b", 4, tenant=B)
    s.add_request(other)
    out = step(s)
    assert not out.preempted and "b" not in served(out)
    assert first_token_step(s, other) == 4  # a1 and a2 finish at their 5th token
    _check_invariants(s, out)
