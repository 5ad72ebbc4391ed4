"""AdapterCache: exact eviction order of both tiers, pins, reservations, host backpressure,
load failures, removal, statistics, and loads that never block the step thread."""

from __future__ import annotations

import concurrent.futures
import functools
import math
import random
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import pytest

from engine.lora.cache import AdapterCache, AdapterResidency
from engine.lora.weights import AdapterError, LoRAWeights

P = ParamSpec("P")
T = TypeVar("T")


def make_weights(key: str) -> LoRAWeights:
    return LoRAWeights(name=key, path=None, rank=1, alpha=1.0, use_rslora=False, modules={})


class ManualExecutor(concurrent.futures.Executor):
    """Runs submitted work on the calling thread: at once, or when `run_next` is called."""

    def __init__(self, *, run_at_once: bool) -> None:
        self.run_at_once = run_at_once
        self.pending: list[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = []

    def submit(
        self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.pending.append((future, functools.partial(fn, *args, **kwargs)))
        if self.run_at_once:
            self.run_all()
        return future

    def run_next(self) -> None:
        future, work = self.pending.pop(0)
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as exc:
            future.set_exception(exc)

    def run_all(self) -> None:
        while self.pending:
            self.run_next()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            for future, _ in self.pending:
                future.cancel()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A cache over fake loads, installs and evictions that records what it was asked."""

    def __init__(self, *, max_loras: int, max_cpu_loras: int, run_at_once: bool = True) -> None:
        self.clock = FakeClock()
        self.executor = ManualExecutor(run_at_once=run_at_once)
        self.loads: list[str] = []  # keys, in the order their loads ran
        self.events: list[tuple[str, int, str | None]] = []  # install/evict, slot, key
        self.ready: list[str] = []
        self.failing: set[str] = set()
        self.durations: dict[str, float] = {}
        self.probe: Callable[[str], None] | None = None  # also called from on_ready
        self.cache = AdapterCache(
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            load=self.load,
            install=lambda slot, w: self.events.append(("install", slot, w.name)),
            evict=lambda slot: self.events.append(("evict", slot, None)),
            on_ready=self.on_ready,
            executor=self.executor,
            clock=self.clock,
        )

    def load(self, key: str) -> LoRAWeights:
        self.loads.append(key)
        self.clock.now += self.durations.get(key, 0.0)
        if key in self.failing:
            raise AdapterError(f"{key} is broken")
        return make_weights(key)

    def on_ready(self, key: str) -> None:
        self.ready.append(key)
        if self.probe is not None:
            self.probe(key)

    def run(self, key: str) -> int:
        """A request for `key` arrives, waits, gets scheduled (as the scheduler does it)."""
        self.cache.reserve(key)
        slot = self.cache.acquire(key)
        self.cache.unreserve(key)
        return slot

    def orders(self) -> tuple[list[str], list[str]]:
        return self.cache.device_eviction_order(), self.cache.host_eviction_order()


def test_scripted_eviction_order_of_both_tiers() -> None:
    h = Harness(max_loras=2, max_cpu_loras=3)
    cache = h.cache
    for key in "ABCDE":
        cache.add(key)

    assert h.run("A") == 0
    assert h.run("B") == 1
    assert h.events == [("install", 0, "A"), ("install", 1, "B")]
    assert h.orders() == ([], [])  # both pinned

    cache.release("A")
    assert h.orders() == (["A"], ["A"])

    # C loads into the third host place; on the device it takes A's slot (the only unpinned).
    assert h.run("C") == 0
    assert h.events[2:] == [("evict", 0, None), ("install", 0, "C")]
    assert cache.slot_of("A") is None and cache.is_ready("A")  # still on the host tier
    assert h.orders() == ([], ["A"])

    cache.release("B")
    assert h.orders() == (["B"], ["A", "B"])

    # D: the host tier is full, A (least recently used there) goes; B leaves its slot.
    assert h.run("D") == 1
    assert h.events[4:] == [("evict", 1, None), ("install", 1, "D")]
    assert not cache.is_ready("A")
    assert h.orders() == ([], ["B"])

    cache.release("C")
    cache.release("D")
    assert h.orders() == (["C", "D"], ["B", "C", "D"])

    # A again: a disk load (evicts B from the host), then C's slot (device LRU).
    assert h.run("A") == 0
    assert h.events[6:] == [("evict", 0, None), ("install", 0, "A")]
    assert h.orders() == (["D"], ["C", "D"])

    # D is still in slot 1: a device hit, no load, no install. Reserving D makes it the
    # most recently used host entry.
    cache.reserve("D")
    assert h.orders() == (["D"], ["C"])  # reserved: off the host order, last on the device
    assert cache.acquire("D") == 1
    cache.unreserve("D")
    assert len(h.events) == 8
    assert h.orders() == ([], ["C"])

    cache.release("A")
    assert h.orders() == (["A"], ["C", "A"])

    assert h.run("E") == 0  # host: C evicted for the load; device: A's slot
    assert h.events[8:] == [("evict", 0, None), ("install", 0, "E")]
    cache.release("E")
    cache.release("D")
    assert h.orders() == (["E", "D"], ["A", "E", "D"])

    assert h.loads == ["A", "B", "C", "D", "A", "E"]
    assert h.ready == h.loads
    stats = cache.stats()
    assert (stats.device_hits, stats.device_misses) == (1, 6)
    assert (stats.loads, stats.load_failures) == (6, 0)
    assert (stats.device_evictions, stats.host_evictions) == (4, 3)
    assert (stats.num_device, stats.num_host, stats.num_loading, stats.num_queued) == (2, 3, 0, 0)
    assert cache.resident() == [
        AdapterResidency("A", None, True, False, False, 0, 0, False, None),
        AdapterResidency("D", 1, True, False, False, 0, 0, False, None),
        AdapterResidency("E", 0, True, False, False, 0, 0, False, None),
    ]


def test_pinned_adapter_is_never_evicted_under_churn() -> None:
    h = Harness(max_loras=3, max_cpu_loras=3)
    cache = h.cache
    keys = [f"k{i}" for i in range(8)]
    for key in ["P", *keys]:
        cache.add(key)
    assert h.run("P") == 0  # pinned for the whole test
    rng = random.Random(7)
    for _ in range(200):
        running = rng.sample(keys, 2)  # with P, three adapters run at once
        slots = [h.run(key) for key in running]
        assert 0 not in slots
        assert cache.slot_of("P") == 0
        assert "P" not in cache.device_eviction_order()
        assert "P" not in cache.host_eviction_order()
        for key in running:
            cache.release(key)
    assert [e for e in h.events if e[1] == 0] == [("install", 0, "P")]
    assert cache.stats().device_evictions > 100  # the other two slots really churned
    (p,) = [r for r in cache.resident() if r.key == "P"]
    assert p.on_host and p.slot == 0 and p.pins == 1


def test_reserved_host_entries_are_never_evicted_and_preload_overflows() -> None:
    h = Harness(max_loras=2, max_cpu_loras=2)
    cache = h.cache
    for key in "ABC":
        cache.add(key)
    cache.reserve("A")
    cache.reserve("B")
    assert h.loads == ["A", "B"]
    assert cache.host_eviction_order() == []

    cache.reserve("C")  # no room: both host entries are reserved
    assert h.loads == ["A", "B"]
    assert not cache.is_ready("C")
    assert cache.stats().num_queued == 1

    # A preload never waits: with nothing evictable, the tier runs over capacity.
    cache.add("D", make_weights("D"))
    assert cache.stats().num_host == 3
    assert cache.is_ready("A") and cache.is_ready("B") and cache.is_ready("D")
    assert cache.host_eviction_order() == ["D"]

    # A becomes evictable: the queued load evicts A then D to get back under capacity.
    cache.unreserve("A")
    assert h.loads == ["A", "B", "C"]
    assert not cache.is_ready("A") and not cache.is_ready("D")
    assert cache.is_ready("B") and cache.is_ready("C")
    stats = cache.stats()
    assert (stats.num_host, stats.num_queued, stats.host_evictions) == (2, 0, 2)


def test_reserved_adapter_loses_its_slot_last_and_is_reloaded() -> None:
    h = Harness(max_loras=2, max_cpu_loras=4)
    cache = h.cache
    for key in "ABC":
        cache.add(key, make_weights(key))
    assert cache.acquire("A") == 0
    assert cache.acquire("B") == 1
    cache.release("A")
    cache.release("B")
    cache.reserve("A")  # a waiting request: A stays in its slot while B is evictable
    assert cache.device_eviction_order() == ["B", "A"]
    assert cache.acquire("C") == 1
    assert cache.slot_of("A") == 0

    # One slot, one host place. A's host copy goes to make room for B; A keeps its slot.
    h = Harness(max_loras=1, max_cpu_loras=1)
    cache = h.cache
    cache.add("A", make_weights("A"))
    assert cache.acquire("A") == 0
    cache.release("A")
    cache.add("B", make_weights("B"))
    assert cache.host_eviction_order() == ["B"]
    cache.reserve("A")
    assert cache.is_ready("A") and h.loads == []  # in its slot: no load needed

    # B must run: A leaves the slot, and since it has no host copy its load is queued
    # (no host room while B is pinned), then started when B is released.
    assert cache.acquire("B") == 0
    assert h.events == [("install", 0, "A"), ("evict", 0, None), ("install", 0, "B")]
    assert not cache.is_ready("A")
    assert cache.stats().num_queued == 1
    cache.release("B")
    assert h.loads == ["A"]
    assert cache.is_ready("A") and cache.host_eviction_order() == []
    assert cache.acquire("A") == 0


def test_host_backpressure_starts_loads_in_fifo_order() -> None:
    h = Harness(max_loras=2, max_cpu_loras=2, run_at_once=False)
    cache = h.cache
    for key in "ABXYZ":
        cache.add(key)
    for key in "ABZXY":
        cache.reserve(key)
    stats = cache.stats()
    assert (stats.loads, stats.num_loading, stats.num_queued) == (2, 2, 3)
    h.executor.run_all()
    assert h.loads == ["A", "B"]
    assert h.ready == ["A", "B"]
    assert cache.stats().num_queued == 3  # both loaded adapters are still reserved

    cache.unreserve("B")  # B evicted, the head of the queue starts
    h.executor.run_all()
    assert h.loads == ["A", "B", "Z"]
    assert not cache.is_ready("B")
    cache.unreserve("Y")  # nobody waits for Y any more: it leaves the queue
    cache.unreserve("A")
    h.executor.run_all()
    assert h.loads == ["A", "B", "Z", "X"]
    stats = cache.stats()
    assert (stats.loads, stats.num_loading, stats.num_queued) == (4, 0, 0)
    assert stats.host_evictions == 2

    # A load in flight counts against the host tier.
    cache.unreserve("Z")
    cache.reserve("A")
    cache.reserve("Y")
    assert cache.stats().num_loading == 1
    assert cache.stats().num_queued == 1
    h.executor.run_all()
    assert h.loads == ["A", "B", "Z", "X", "A"]
    assert cache.stats().num_queued == 1  # X and A are reserved
    cache.unreserve("X")
    h.executor.run_all()
    assert h.loads == ["A", "B", "Z", "X", "A", "Y"]
    assert cache.host_eviction_order() == []
    assert [r.key for r in cache.resident()] == ["A", "Y"]


@pytest.mark.timeout(10)  # on_ready under the cache's lock would deadlock
def test_load_failure_sets_error_calls_on_ready_and_retries_on_reserve() -> None:
    h = Harness(max_loras=1, max_cpu_loras=2)
    cache = h.cache
    seen: list[tuple[bool, BaseException | None]] = []
    h.probe = lambda key: seen.append((cache.is_ready(key), cache.load_error(key)))
    cache.add("bad")
    h.failing.add("bad")

    cache.reserve("bad")
    error = cache.load_error("bad")
    assert isinstance(error, AdapterError) and str(error) == "bad is broken"
    assert seen == [(False, error)]
    assert not cache.is_ready("bad")
    with pytest.raises(RuntimeError, match="not loaded"):
        cache.acquire("bad")
    stats = cache.stats()
    assert (stats.loads, stats.load_failures, stats.num_loading, stats.num_host) == (1, 1, 0, 0)
    assert stats.load_latency.count == 0  # only successful loads are timed

    cache.reserve("bad")  # still failing: a new error object
    assert cache.load_error("bad") is not error
    h.failing.clear()
    cache.reserve("bad")  # the retry
    assert cache.load_error("bad") is None
    assert seen[-1] == (True, None)
    assert h.loads == ["bad", "bad", "bad"]
    assert cache.acquire("bad") == 0
    stats = cache.stats()
    assert (stats.loads, stats.load_failures, stats.num_host) == (3, 2, 1)


def test_remove_of_a_pinned_adapter_frees_it_on_the_last_release() -> None:
    h = Harness(max_loras=2, max_cpu_loras=2)
    cache = h.cache
    cache.add("A", make_weights("A"))
    cache.add("B", make_weights("B"))
    assert cache.acquire("A") == 0
    assert cache.acquire("A") == 0  # two running requests
    cache.remove("A")
    assert "A" not in cache
    for call in (cache.acquire, cache.reserve, cache.is_ready, cache.slot_of):
        with pytest.raises(KeyError):
            call("A")
    assert [(r.key, r.slot, r.removed) for r in cache.resident()] == [
        ("A", 0, True),
        ("B", None, False),
    ]
    cache.release("A")
    assert cache.stats().num_device == 1 and h.events == [("install", 0, "A")]
    cache.release("A")
    assert h.events[1:] == [("evict", 0, None)]
    stats = cache.stats()
    assert (stats.num_device, stats.num_host, stats.device_evictions) == (0, 1, 0)
    assert [r.key for r in cache.resident()] == ["B"]
    with pytest.raises(KeyError):
        cache.release("A")
    with pytest.raises(KeyError):
        cache.remove("A")
    assert cache.acquire("B") == 0  # the freed slot is taken first


def test_remove_drops_unpinned_memory_at_once_and_revive() -> None:
    h = Harness(max_loras=2, max_cpu_loras=2)
    cache = h.cache
    cache.add("A", make_weights("A"))
    cache.acquire("A")
    cache.release("A")
    cache.remove("A")
    assert h.events == [("install", 0, "A"), ("evict", 0, None)]
    assert cache.resident() == []

    # Removed while pinned, then added again under the same key: the same entry lives on.
    cache.add("B", make_weights("B"))
    assert cache.acquire("B") == 0
    cache.remove("B")
    cache.add("B")
    assert cache.acquire("B") == 0
    cache.release("B")
    cache.release("B")
    assert cache.device_eviction_order() == ["B"]
    assert h.events[2:] == [("install", 0, "B")]


def test_load_in_flight_for_a_removed_adapter_is_discarded() -> None:
    h = Harness(max_loras=1, max_cpu_loras=1, run_at_once=False)
    cache = h.cache
    cache.add("A")
    cache.add("B")
    cache.reserve("A")
    cache.reserve("B")  # queued behind A's load
    cache.remove("A")  # still reserved: unreserve must balance
    cache.unreserve("A")
    assert cache.stats().num_loading == 1  # the load still holds its host place
    h.executor.run_all()
    assert h.loads == ["A", "B"]
    assert h.ready == ["B"]
    stats = cache.stats()
    assert (stats.num_host, stats.num_loading, stats.num_queued) == (1, 0, 0)
    assert [r.key for r in cache.resident()] == ["B"]


def test_stats_histogram_of_load_latency() -> None:
    h = Harness(max_loras=1, max_cpu_loras=8)
    cache = h.cache
    h.durations = {"D": 0.5, "A": 0.005, "B": 0.3, "C": 45.0, "F": 2.0}
    h.failing.add("F")
    for key in "DABCF":  # D first, at time 0: exactly 0.5 s, on the bucket's upper bound
        cache.add(key)
        cache.reserve(key)
    hist = cache.stats().load_latency
    assert hist.bounds == (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, math.inf)
    assert hist.cumulative_counts == (1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 4)
    assert hist.count == 4
    assert hist.sum == pytest.approx(0.5 + 0.005 + 0.3 + 45.0)
    stats = cache.stats()
    assert (stats.loads, stats.load_failures, stats.num_host) == (5, 1, 4)


def test_invalid_calls() -> None:
    h = Harness(max_loras=1, max_cpu_loras=1)
    cache = h.cache
    with pytest.raises(ValueError):
        AdapterCache(max_loras=0, max_cpu_loras=1, load=make_weights, install=lambda s, w: None)
    for call in (cache.reserve, cache.acquire, cache.remove, cache.load_error):
        with pytest.raises(KeyError):
            call("nope")
    cache.add("A", make_weights("A"))
    cache.reserve("A")
    cache.add("B", make_weights("B"))  # A is not evictable: the preload runs over capacity
    assert cache.is_ready("A") and cache.is_ready("B")
    cache.acquire("A")
    with pytest.raises(RuntimeError, match="pinned"):
        cache.acquire("B")
    with pytest.raises(AssertionError):
        cache.release("B")
    cache.unreserve("A")
    with pytest.raises(AssertionError):
        cache.unreserve("A")


@pytest.mark.timeout(60)  # a deadlock fails the test instead of hanging the run
def test_acquire_never_waits_for_a_load_in_progress() -> None:
    started = threading.Event()
    unblock = threading.Event()
    ready = threading.Event()
    loaded: list[str] = []

    def load(key: str) -> LoRAWeights:
        loaded.append(key)
        started.set()
        assert unblock.wait(timeout=30)
        return make_weights(key)

    cache = AdapterCache(
        max_loras=2,
        max_cpu_loras=4,
        load=load,
        install=lambda slot, w: None,
        on_ready=lambda key: ready.set(),
    )
    try:
        cache.add("A", make_weights("A"))
        cache.add("B")
        cache.reserve("B")
        assert started.wait(timeout=30)
        # B's load is blocked on the loader thread; the step thread carries on with A.
        assert cache.acquire("A") == 0
        cache.release("A")
        assert cache.acquire("A") == 0
        assert not cache.is_ready("B")
        assert cache.stats().num_loading == 1
        unblock.set()
        assert ready.wait(timeout=30)
        assert cache.is_ready("B")
        assert cache.acquire("B") == 1
        assert loaded == ["B"]
    finally:
        unblock.set()
        cache.close()


@pytest.mark.timeout(60)
def test_close_cancels_queued_loads_without_waiting_for_the_running_one() -> None:
    started = threading.Event()
    unblock = threading.Event()
    loaded: list[str] = []
    ready: list[str] = []

    def load(key: str) -> LoRAWeights:
        loaded.append(key)
        started.set()
        assert unblock.wait(timeout=30)
        return make_weights(key)

    cache = AdapterCache(
        max_loras=1, max_cpu_loras=4, load=load, install=lambda s, w: None, on_ready=ready.append
    )
    for key in "BC":
        cache.add(key)
        cache.reserve(key)  # C waits in the executor behind B
    assert started.wait(timeout=30)
    cache.close(timeout=0.01)  # returns while B's load is still blocked
    assert loaded == ["B"]
    unblock.set()
    for thread in threading.enumerate():
        if thread.name.startswith("loraplex-adapter-load"):
            thread.join(timeout=30)
    assert loaded == ["B"]
    assert ready == []  # nothing wakes a closed engine
