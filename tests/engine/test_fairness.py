"""Tenants in the scheduler: VTC admission order, weights, priorities, counter lift,
preemption victims, aging, per-tenant caps, engine-side limits; simulated steps, no model."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.client import RequestRejected
from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.engine_core import EngineCore
from engine.core.scheduler import Scheduler
from engine.core.state import Request, RequestStatus, SchedulerOutput
from engine.limits import ContextLimits, resolve_max_tokens
from engine.request import EngineRequest, TenantContext
from tests.engine.test_scheduler import _check_invariants, chunks, run_all, step
from tests.utils import factories


def make_request(*args: Any, adapter_key: str | None = None, **kwargs: Any) -> Request:
    """A request as the engine admits it: `adapter_key` is its adapter version's key."""
    request = factories.make_request(*args, **kwargs)
    request.adapter_key = adapter_key
    return request


BS = 4
A = TenantContext("A")
B = TenantContext("B")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    num_blocks: int = 64,
    *,
    fairness: str = "vtc",
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    clock: Callable[[], float] | None = None,
    **config: Any,
) -> Scheduler:
    cfg = EngineConfig(
        block_size=BS,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        fairness=fairness,  # type: ignore[arg-type]
        **config,
    )
    return Scheduler(cfg, BlockManager(num_blocks, BS, True), clock=clock or (lambda: 0.0))


_next_token = iter(range(100, 10**9, 100))


def req(
    name: str, tenant: TenantContext | None, prompt: int, *, max_tokens: int = 1, **kwargs: Any
) -> Request:
    """A request of `tenant` whose prompt shares no block with any other request."""
    request = make_request(
        name, prompt, max_tokens=max_tokens, first_token=next(_next_token), **kwargs
    )
    request.tenant = tenant
    return request


def submitted(request: Request) -> EngineRequest:
    """What a caller hands the engine for `request`."""
    return EngineRequest(request.request_id, tuple(request.prompt_token_ids), request.sampling,
                         tenant=request.tenant)


def admitted(out: SchedulerOutput) -> list[str]:
    """Requests whose first chunk ran in this step."""
    return [c.request.request_id for c in out.chunks if c.start == c.request.num_cached_tokens
            and c.request.num_preemptions == 0 and c.start < c.request.num_prompt_tokens]


def admission_order(s: Scheduler, max_steps: int = 500) -> list[str]:
    order: list[str] = []
    while s.has_unfinished_requests():
        assert max_steps > 0, "did not finish"
        max_steps -= 1
        order += admitted(step(s))
    return order


# ---------------------------------------------------------------- order


@pytest.mark.parametrize(
    ("fairness", "expected"),
    [
        ("vtc", ["a0", "b0", "a1", "a2", "a3"]),
        # fcfs: arrival order, B queues behind A's whole backlog.
        ("fcfs", ["a0", "a1", "a2", "a3", "b0"]),
    ],
)
def test_flooding_tenant_does_not_hold_back_the_other(fairness: str, expected: list[str]) -> None:
    s = make_scheduler(fairness=fairness, max_num_seqs=1)
    for i in range(4):
        s.add_request(req(f"a{i}", A, 8, max_tokens=2, arrival_time=float(i)))
    s.add_request(req("b0", B, 8, max_tokens=2, arrival_time=4.0))
    # Equal counters: arrival decides.
    assert [r.request_id for r in s.waiting] == ["a0", "a1", "a2", "a3", "b0"]
    step(s)  # a0: 8 prompt tokens + its first output token
    assert (s.fair.counter("A"), s.fair.counter("B")) == (8 * 1.0 + 2.0, 0.0)
    step(s)  # a0's second output token; it finishes
    assert s.fair.counter("A") == 12.0
    assert s.waiting[0].request_id == expected[1]
    assert ["a0", *admission_order(s)] == expected


def test_charges_count_prompt_tokens_computed_and_output_tokens() -> None:
    s = make_scheduler(max_num_batched_tokens=8, vtc_prompt_weight=0.5, vtc_output_weight=3.0)
    a = req("a", A, 12, max_tokens=3)
    s.add_request(a)
    assert chunks(step(s)) == [("a", 0, 8)]
    assert s.fair.counter("A") == 4.0
    assert chunks(step(s)) == [("a", 8, 4)]  # the rest of the prompt, then a sample
    assert s.fair.counter("A") == 4.0 + 2.0 + 3.0
    # Same prompt, tenant A again: the two full cached blocks are not computed, not charged.
    a2 = make_request("a2", a.prompt_token_ids, max_tokens=1)
    a2.tenant = A
    s.add_request(a2)
    out = step(s)
    assert chunks(out) == [("a", 12, 1), ("a2", 8, 4)]
    assert s.fair.counter("A") == 9.0 + 3.0 + (4 * 0.5 + 3.0)


def test_weight_two_tenant_gets_twice_the_service() -> None:
    s = make_scheduler(max_num_seqs=1)
    heavy = TenantContext("H", weight=2.0)
    for i in range(40):
        s.add_request(req(f"h{i}", heavy, 4, arrival_time=float(i)))
        s.add_request(req(f"l{i}", B, 4, arrival_time=i + 0.5))
    served = ""
    for _ in range(30):
        served += "".join(name[0] for name in admitted(step(s)))
    # Every request costs 4 + 2 = 6; H pays 3 of it.
    assert served == "hlhlhhlhhlhhlhhlhhlhhlhhlhhlhh"
    assert (served.count("h"), served.count("l")) == (20, 10)
    assert s.fair.counter("H") == s.fair.counter("B") == 60.0


def test_priorities_come_before_counters() -> None:
    s = make_scheduler(max_num_seqs=1)
    premium, standard, batch = (TenantContext(name) for name in ("P", "S", "X"))
    warm = req("p-warm", premium, 8, max_tokens=2, priority=0, arrival_time=0.0)
    s.add_request(warm)
    s.add_request(req("x", batch, 4, priority=2, arrival_time=1.0))
    s.add_request(req("s", standard, 4, priority=1, arrival_time=2.0))
    assert admitted(step(s)) == ["p-warm"]
    s.fair.charge(warm, 100.0)  # P has been served a lot more than S and X
    s.add_request(req("p", premium, 4, priority=0, arrival_time=3.0))
    assert s.fair.counter("P") > s.fair.counter("S") == s.fair.counter("X") == 0
    assert [r.request_id for r in s.waiting] == ["p", "s", "x"]
    assert admission_order(s) == ["p", "s", "x"]


def test_returning_tenant_is_lifted_to_the_smallest_active_counter() -> None:
    s = make_scheduler(max_num_seqs=4)
    c = TenantContext("C")
    s.add_request(req("a0", A, 8, max_tokens=50))
    s.add_request(req("c0", c, 20, max_tokens=50))
    step(s)
    step(s)
    assert (s.fair.counter("A"), s.fair.counter("C")) == (8 + 2 + 2, 20 + 2 + 2)
    # B never ran: it comes in at the smallest active counter, not at 0.
    b0 = req("b0", B, 4, max_tokens=1)
    s.add_request(b0)
    assert s.fair.counter("B") == 12.0
    step(s)
    assert b0.is_finished and s.fair.counter("B") == 12.0 + 4 + 2
    # B left with more than A has; coming back it keeps its own counter (no debt forgiven).
    s.add_request(req("b1", B, 4, max_tokens=1))
    assert s.fair.counter("B") == 18.0 > s.fair.counter("A") == 14.0
    # Time away banks nothing: A comes back at C's counter (the only active tenant), far
    # above its own; forgotten tenants are not kept.
    s.abort_request("a0")
    step(s)
    assert [s.fair.tenant(t) is None for t in "ABC"] == [True, True, False]
    s.add_request(req("a1", A, 4, max_tokens=1))
    assert s.fair.counter("A") == s.fair.counter("C") == 20 + 2 * 4
    # Nobody active: a tenant comes back at the counter of the last one to leave.
    s.abort_request("c0")
    s.abort_request("a1")
    assert not s.has_unfinished_requests()
    s.add_request(req("d0", TenantContext("D"), 4))
    assert s.fair.counter("D") == 28.0


# ---------------------------------------------------------------- preemption


def _fill(s: Scheduler, specs: list[tuple[str, TenantContext, int, float]]) -> list[Request]:
    """Running requests with 6-token prompts (2 blocks each, room for 2 decodes)."""
    requests = [
        req(name, tenant, 6, max_tokens=20, priority=priority, arrival_time=arrival)
        for name, tenant, priority, arrival in specs
    ]
    for request in requests:
        s.add_request(request)
    out = step(s)
    assert sorted(admitted(out)) == sorted(r.request_id for r in requests)
    return requests


def test_higher_priority_request_preempts_lowest_priority_then_latest() -> None:
    s = make_scheduler(num_blocks=8, fairness="fcfs")
    x = TenantContext("X")
    x1, x2, y = _fill(s, [("x1", x, 2, 1.0), ("x2", x, 2, 2.0), ("y", B, 1, 0.5)])
    assert s.block_manager.num_free_blocks == 2
    p = req("p", A, 12, max_tokens=1, priority=0, arrival_time=3.0)
    s.add_request(p)
    out = step(s)
    assert out.preempted == [x2]
    assert (x2.status, x2.block_ids, x2.num_computed_tokens) == (RequestStatus.PREEMPTED, [], 0)
    # x2's decode was taken back; p got the blocks x2 held.
    assert chunks(out) == [("y", 6, 1), ("x1", 6, 1), ("p", 0, 12)]
    assert [r.request_id for r in s.running] == ["y", "x1"]  # p finished (one token)
    assert x1.status == y.status == RequestStatus.RUNNING
    run_all(s)


def test_equal_priorities_break_ties_by_highest_counter() -> None:
    s = make_scheduler(num_blocks=8)
    heavy, light = TenantContext("H"), TenantContext("L")
    # The heavy tenant's request arrived first, but its tenant has been served more.
    h, light_request, _ = _fill(s, [("h", heavy, 2, 1.0), ("l", light, 2, 2.0), ("y", B, 1, 0.5)])
    s.fair.charge(h, 100.0)
    s.add_request(req("p", A, 12, max_tokens=1, priority=0, arrival_time=3.0))
    out = step(s)
    assert out.preempted == [h]
    assert light_request.status == RequestStatus.RUNNING
    run_all(s)


def test_never_preempts_for_an_equal_or_lower_priority_request() -> None:
    s = make_scheduler(num_blocks=8)
    _fill(s, [("x1", A, 1, 1.0), ("x2", A, 1, 2.0), ("y", B, 1, 0.5)])
    s.add_request(req("z", TenantContext("Z"), 12, max_tokens=1, priority=1, arrival_time=0.0))
    counters = (s.fair.counter("A"), s.fair.counter("B"))
    out = step(s)
    assert out.preempted == []
    assert chunks(out) == [("y", 6, 1), ("x1", 6, 1), ("x2", 6, 1)]
    assert [r.request_id for r in s.waiting] == ["z"]
    # Charges of the step: one output token each.
    assert (s.fair.counter("A"), s.fair.counter("B")) == (counters[0] + 4, counters[1] + 2)
    run_all(s)


def test_victim_charge_is_given_back() -> None:
    s = make_scheduler(num_blocks=8, fairness="fcfs")
    x = TenantContext("X")
    _fill(s, [("x1", x, 2, 1.0), ("x2", x, 2, 2.0), ("y", B, 1, 0.5)])
    before = s.fair.counter("X")
    s.add_request(req("p", A, 12, max_tokens=1, priority=0, arrival_time=3.0))
    step(s)
    # x1's decode ran (2), x2's was scheduled, then taken back (+2 -2).
    assert s.fair.counter("X") == before + 2.0


# ---------------------------------------------------------------- aging


@pytest.mark.parametrize(("aging_s", "admitted_at"), [(30.0, 3), (None, None)])
def test_batch_request_ages_into_service(
    aging_s: float | None, admitted_at: int | None
) -> None:
    clock = Clock()
    s = make_scheduler(max_num_seqs=1, clock=clock, aging_s=aging_s)
    x = req("x", TenantContext("X"), 4, priority=2, arrival_time=0.0)
    s.add_request(x)
    when: int | None = None
    for i in range(8):
        clock.now = 10.0 * i
        # A standard tenant keeps one request waiting at every step.
        s.add_request(req(f"s{i}", A, 4, priority=1, arrival_time=clock.now))
        if "x" in admitted(step(s)):
            when = i
    assert when == admitted_at
    assert [s.fair.effective_priority(x, t) for t in (29.9, 30.0, 60.0, 900.0)] == (
        [2, 1, 0, 0] if aging_s else [2, 2, 2, 2]
    )


def test_aged_request_does_not_preempt_its_own_level() -> None:
    clock = Clock()
    s = make_scheduler(num_blocks=8, clock=clock)
    _fill(s, [("x1", A, 2, 1.0), ("x2", A, 2, 2.0), ("y", A, 2, 0.5)])
    s.add_request(req("old", B, 12, max_tokens=1, priority=2, arrival_time=0.0))
    clock.now = 100.0  # effective priority 0 now, own priority still 2
    assert s.fair.effective_priority(s.waiting[0], clock.now) == 0
    assert step(s).preempted == []
    assert [r.request_id for r in s.waiting] == ["old"]


# ---------------------------------------------------------------- per-tenant caps


def test_running_cap_skips_the_tenant_and_admits_others() -> None:
    s = make_scheduler()
    capped = TenantContext("A", max_running=2)
    for i in range(4):
        s.add_request(req(f"a{i}", capped, 4, max_tokens=2 + i, arrival_time=float(i)))
    s.add_request(req("b0", B, 4, max_tokens=5, arrival_time=10.0))
    s.add_request(req("b1", B, 4, max_tokens=5, arrival_time=11.0))
    assert admitted(step(s)) == ["a0", "b0", "a1", "b1"]
    assert admitted(step(s)) == []  # a0 finished in this step: a2 may come next
    assert admitted(step(s)) == ["a2"]
    assert [r.request_id for r in s.running] == ["b0", "b1", "a2"]  # a1 finished
    run_all(s)


def test_kv_share_cap_defers_the_tenant_while_others_wait() -> None:
    s = make_scheduler(num_blocks=16, fairness="fcfs", max_num_seqs=3)
    quarter = TenantContext("A", max_kv_fraction=0.25)  # 4 of 16 blocks
    for i in range(4):
        s.add_request(req(f"a{i}", quarter, 8, max_tokens=3, arrival_time=float(i)))
    s.add_request(req("b0", B, 8, max_tokens=3, arrival_time=10.0))
    s.add_request(req("b1", B, 8, max_tokens=3, arrival_time=11.0))
    # a0 and a1 hold 4 blocks: a2 waits behind B although it arrived first.
    assert admitted(step(s)) == ["a0", "a1", "b0"]
    run_all(s)


def test_kv_share_cap_alone_uses_everything() -> None:
    s = make_scheduler(num_blocks=16, fairness="fcfs")
    quarter = TenantContext("A", max_kv_fraction=0.25)
    for i in range(6):
        s.add_request(req(f"a{i}", quarter, 8, max_tokens=1, arrival_time=float(i)))
    out = step(s)
    assert admitted(out) == [f"a{i}" for i in range(6)]
    assert s.block_manager.num_free_blocks == 16  # all finished after one token


def test_deferred_tenant_goes_when_the_others_cannot() -> None:
    s = make_scheduler(num_blocks=16, fairness="fcfs")
    quarter = TenantContext("A", max_kv_fraction=0.25)
    capped_b = TenantContext("B", max_running=1)
    for i in range(3):
        s.add_request(req(f"a{i}", quarter, 8, max_tokens=3, arrival_time=float(i)))
    s.add_request(req("b0", capped_b, 8, max_tokens=3, arrival_time=10.0))
    s.add_request(req("b1", capped_b, 8, max_tokens=3, arrival_time=11.0))
    # b1 waits for B's own cap, so it does not hold A back.
    assert admitted(step(s)) == ["a0", "a1", "b0", "a2"]
    run_all(s)


# ---------------------------------------------------------------- limits, validation


def test_tenant_limits() -> None:
    limits = ContextLimits.of(10**6, TenantContext("A", max_tokens=100, max_context_tokens=300))
    assert resolve_max_tokens(limits, 200, 100, prompt_param="messages") == 100
    with pytest.raises(RequestRejected, match="limit of 100 tokens per request") as info:
        resolve_max_tokens(limits, 10, 101, prompt_param="messages")
    assert (info.value.code, info.value.param) == ("max_tokens_exceeded", "max_tokens")
    with pytest.raises(RequestRejected, match=r"the prompt has 201 tokens and 'max_tokens' "
                       r"asks for 100 more \(301 in total\)") as info:
        resolve_max_tokens(limits, 201, 100, prompt_param="messages")
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")
    with pytest.raises(RequestRejected, match="the prompt alone has 300 tokens") as info:
        resolve_max_tokens(limits, 300, 1, prompt_param="messages")
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")
    no_limits = ContextLimits.of(10**7, TenantContext("B"))
    assert resolve_max_tokens(no_limits, 10**6, 10**6) == 10**6


def test_engine_rejects_what_the_tenant_may_not_ask(
    tiny_model_factory: Callable[[str], Path],
) -> None:
    core = EngineCore(EngineConfig(model=str(tiny_model_factory("llama_gqa")), max_loras=0))
    limited = TenantContext("A", max_tokens=8, max_context_tokens=20)
    with pytest.raises(RequestRejected) as info:
        core.add_request(submitted(req("r0", limited, 4, max_tokens=9)))
    assert info.value.code == "max_tokens_exceeded"
    with pytest.raises(RequestRejected) as info:
        core.add_request(submitted(req("r1", limited, 13, max_tokens=8)))
    assert info.value.code == "context_length_exceeded"
    assert not core.has_unfinished_requests()
    core.add_request(submitted(req("r2", limited, 12, max_tokens=8)))
    core.add_request(submitted(req("r3", None, 100, max_tokens=50)))  # no tenant, no tenant limits
    assert core.scheduler.num_waiting == 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tenant_id": ""}, "tenant_id"),
        ({"weight": 0.0}, "weight"),
        ({"weight": float("nan")}, "weight"),
        ({"max_running": 0}, "max_running"),
        ({"max_kv_fraction": 0.0}, "max_kv_fraction"),
        ({"max_kv_fraction": 1.5}, "max_kv_fraction"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_tenant_context_validation(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TenantContext(**{"tenant_id": "A", **fields})


def test_engine_config_validation() -> None:
    with pytest.raises(ValueError, match="fairness"):
        EngineConfig(fairness="lottery")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="aging_s"):
        EngineConfig(aging_s=0)


# ---------------------------------------------------------------- random workload


@pytest.mark.parametrize("seed", range(6))
def test_random_tenants_keep_invariants_and_finish(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    s = make_scheduler(
        num_blocks=10, max_num_batched_tokens=16, max_num_seqs=4, clock=clock, aging_s=5.0,
        fairness="vtc" if seed % 2 else "fcfs", max_loras=2,
    )
    tenants = [
        None,
        TenantContext("A", weight=2.0),
        TenantContext("B", max_running=1),
        TenantContext("C", max_kv_fraction=0.3),
    ]
    requests: list[Request] = []
    for n in range(300):
        clock.now = n * 0.5
        if n < 120 and rng.random() < 0.4:
            request = req(
                f"r{n}",
                rng.choice(tenants),
                rng.randrange(1, 16),
                max_tokens=rng.randrange(1, 10),
                priority=rng.randrange(3),
                adapter_key=rng.choice([None, "x", "y", "z"]),
                arrival_time=clock.now,
            )
            s.add_request(request)
            requests.append(request)
        if s.running and rng.random() < 0.05:
            s.abort_request(rng.choice(s.running).request_id)
        if not s.has_unfinished_requests():
            continue
        out = step(s)
        _check_invariants(s, out)
        for tenant in tenants:
            if tenant is not None and tenant.max_running is not None:
                assert sum(r.tenant is tenant for r in s.running) <= tenant.max_running
    run_all(s, max_steps=1000)
    assert all(r.is_finished for r in requests)
    assert len(s.fair) == 0
    for tenant_id in ("-", "A", "B", "C"):
        state = s.fair.tenant(tenant_id)
        assert state is None or (state.num_running, state.num_waiting, state.queues) == (0, 0, {})
