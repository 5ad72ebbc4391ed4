"""Adapters on two LRU tiers: device slots and host copies, with pins, reservations and
background loads.

Device tier: `max_loras` slots (0..max_loras-1); `acquire` pins an adapter in a slot for a
running request, installing it from its host copy on a miss. Host tier: at most
`max_cpu_loras` adapters in host memory, counting loads in flight; `reserve` (a waiting
request needs the adapter) starts a load from disk on a miss. The cache reads no files: it is
given `load` (runs on a loader thread), `install` and `evict` (run under the lock, on the
thread that calls `acquire`).

Eviction. Each tier evicts its least recently used evictable entry; use = acquire, release
(both tiers), reserve, load completion and preload (host tier). A pinned adapter is never
evicted from either tier, a reserved one never from the host tier.

NOTE: a reserved adapter CAN lose its device slot, but only when every unpinned slot holds a
reserved adapter: the scheduler only promises that running (pinned) adapters fit the slots,
and waiting requests may reserve any number of adapters, so refusing would fail `acquire`.
If the evicted adapter has no host copy left, its load is queued again so that its waiting
requests do not wait forever.

NOTE: host capacity is backpressure, not a hard limit on preloads. A load starts only when
the host tier has room (a free place or an evictable entry, evicted then); otherwise it waits
in a FIFO queue and starts when room appears. A preload (`add` with weights) never waits: if
nothing is evictable, the host tier holds more than `max_cpu_loras` until entries become
evictable again (the next load to start evicts them first).

NOTE: `remove` of an adapter that is pinned or reserved retires it: it is forgotten for new
calls (KeyError), `release`/`unreserve` still balance, and its slot and host copy are freed
when the last pin is released. `add` of a retired key revives it (a key names one adapter
version). A load in flight for a removed adapter is discarded when it completes.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.lora.weights import LoRAWeights
from engine.runtime.threads import single_core_executor
from engine.stats import AdapterCacheStats, LatencyHistogram

# Upper bounds (seconds) of the load-latency histogram buckets; +Inf is added after them.
LOAD_LATENCY_BOUNDS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class AdapterResidency:
    """Where one adapter is, for the admin view."""

    key: str
    slot: int | None
    on_host: bool
    loading: bool
    queued: bool
    pins: int  # running requests
    reservations: int  # waiting requests
    removed: bool  # removed while in use: freed at the last release
    load_error: str | None


@dataclass(slots=True, eq=False)
class _Entry:
    key: str
    weights: LoRAWeights | None = None  # the host copy
    slot: int | None = None
    pins: int = 0
    reservations: int = 0
    loading: bool = False
    queued: bool = False
    retired: bool = False
    error: BaseException | None = None

    @property
    def is_ready(self) -> bool:
        return self.slot is not None or self.weights is not None


class AdapterCache:
    def __init__(
        self,
        *,
        max_loras: int,
        max_cpu_loras: int,
        load: Callable[[str], LoRAWeights],
        install: Callable[[int, LoRAWeights], None],
        evict: Callable[[int], None] | None = None,
        on_ready: Callable[[str], None] | None = None,
        executor: concurrent.futures.Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {max_cpu_loras}")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._load = load
        self._install = install
        self._evict = evict
        self._on_ready = on_ready
        self._clock = clock
        # NOTE: only an executor the cache created is shut down by close(); a given one may
        # be shared, so close() only cancels the loads the cache submitted to it.
        self._owns_executor = executor is None
        self._executor = executor or single_core_executor(1, "loraplex-adapter-load")
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._retired: dict[str, _Entry] = {}  # removed, still pinned or reserved
        self._slots: list[_Entry | None] = [None] * max_loras
        self._device_lru: OrderedDict[str, _Entry] = OrderedDict()  # least recent first
        self._host_lru: OrderedDict[str, _Entry] = OrderedDict()
        self._queue: deque[_Entry] = deque()
        self._num_loading = 0
        self._futures: set[concurrent.futures.Future[None]] = set()
        self._closed = False
        self._device_hits = 0
        self._device_misses = 0
        self._loads = 0
        self._load_failures = 0
        self._device_evictions = 0
        self._host_evictions = 0
        self._latency_counts = [0] * (len(LOAD_LATENCY_BOUNDS) + 1)  # per bucket, +Inf last
        self._latency_sum = 0.0

    # ---- registry ---------------------------------------------------------------------

    def add(self, key: str, weights: LoRAWeights | None = None) -> None:
        """Make `key` known; with `weights`, also put them on the host tier (a preload)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._retired.pop(key, None) or _Entry(key)
                entry.retired = False
                self._entries[key] = entry
            if weights is not None:
                entry.error = None
                if entry.weights is None:
                    self._make_host_room()  # may fail: then the tier runs over capacity
                    self._host_lru[key] = entry
                entry.weights = weights
                self._host_lru.move_to_end(key)
                self._dequeue(entry)
            self._want_load(entry)  # a revived entry may have lost its memory
            started = self._start_queued()
        self._submit(started)

    def remove(self, key: str) -> None:
        """Forget `key`; if pinned or reserved, retire it (see the module docstring)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                raise KeyError(f"unknown adapter {key!r}")
            entry.retired = True
            self._dequeue(entry)
            if entry.pins == 0:
                self._drop_memory(entry)
            if entry.pins or entry.reservations:
                self._retired[key] = entry
            started = self._start_queued()
        self._submit(started)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    # ---- waiting requests ---------------------------------------------------------------

    def reserve(self, key: str) -> None:
        """A waiting request needs `key`: keep its host copy, load it if it is nowhere."""
        with self._lock:
            entry = self._lookup(key)
            entry.reservations += 1
            entry.error = None
            if entry.weights is not None:
                self._host_lru.move_to_end(key)
            self._want_load(entry)
            started = self._start_queued()
        self._submit(started)

    def unreserve(self, key: str) -> None:
        with self._lock:
            entry = self._lookup_held(key)
            assert entry.reservations > 0, f"unreserve of unreserved adapter {key!r}"
            entry.reservations -= 1
            if entry.reservations == 0:
                self._dequeue(entry)  # nobody waits for it any more
                if entry.retired and entry.pins == 0:
                    del self._retired[key]
            started = self._start_queued()
        self._submit(started)

    def is_ready(self, key: str) -> bool:
        """On a device slot or on the host tier: `acquire` will not fail for lack of it."""
        with self._lock:
            return self._lookup(key).is_ready

    def load_error(self, key: str) -> BaseException | None:
        """Why the last load of `key` failed; cleared when it is reserved again."""
        with self._lock:
            return self._lookup(key).error

    # ---- running requests ---------------------------------------------------------------

    def acquire(self, key: str) -> int:
        """Pin `key` in a device slot for a running request; returns the slot."""
        with self._lock:
            entry = self._lookup(key)
            slot = entry.slot
            if slot is None:
                if entry.weights is None:
                    raise RuntimeError(f"adapter {key!r} is not loaded")
                slot = self._take_slot()
                # If install fails the slot stays free; the next install overwrites it.
                self._install(slot, entry.weights)
                self._slots[slot] = entry
                entry.slot = slot
                self._device_lru[key] = entry
                self._device_misses += 1
            else:
                self._device_hits += 1
            entry.pins += 1
            self._touch(entry)
            # Evicting a reserved adapter from its slot may have queued its reload.
            started = self._start_queued()
        self._submit(started)
        return slot

    def release(self, key: str) -> None:
        with self._lock:
            entry = self._lookup_held(key)
            assert entry.pins > 0, f"release of unpinned adapter {key!r}"
            entry.pins -= 1
            if entry.retired and entry.pins == 0:
                self._drop_memory(entry)
                if entry.reservations == 0:
                    del self._retired[key]
            else:
                self._touch(entry)
            started = self._start_queued()
        self._submit(started)

    def slot_of(self, key: str) -> int | None:
        with self._lock:
            return self._lookup(key).slot

    # ---- views ------------------------------------------------------------------------

    def device_eviction_order(self) -> list[str]:
        """Keys in device slots in the order they would be evicted (first = next)."""
        with self._lock:
            return [entry.key for entry in self._device_victims()]

    def host_eviction_order(self) -> list[str]:
        """Keys on the host tier in the order they would be evicted (first = next)."""
        with self._lock:
            return [e.key for e in self._host_lru.values() if e.pins == 0 and not e.reservations]

    def resident(self) -> list[AdapterResidency]:
        """Every adapter that holds memory, a load, pins or reservations, by key."""
        with self._lock:
            entries = [*self._entries.values(), *self._retired.values()]
            return [
                AdapterResidency(
                    key=e.key,
                    slot=e.slot,
                    on_host=e.weights is not None,
                    loading=e.loading,
                    queued=e.queued,
                    pins=e.pins,
                    reservations=e.reservations,
                    removed=e.retired,
                    load_error=None if e.error is None else str(e.error),
                )
                for e in sorted(entries, key=lambda e: e.key)
                if e.is_ready or e.loading or e.queued or e.pins or e.reservations
            ]

    def stats(self) -> AdapterCacheStats:
        with self._lock:
            cumulative: list[int] = []
            total = 0
            for n in self._latency_counts:
                total += n
                cumulative.append(total)
            return AdapterCacheStats(
                device_hits=self._device_hits,
                device_misses=self._device_misses,
                loads=self._loads,
                load_failures=self._load_failures,
                device_evictions=self._device_evictions,
                host_evictions=self._host_evictions,
                num_device=sum(1 for entry in self._slots if entry is not None),
                num_host=len(self._host_lru),
                num_loading=self._num_loading,
                num_queued=len(self._queue),
                load_latency=LatencyHistogram(
                    finite_bounds=LOAD_LATENCY_BOUNDS,
                    cumulative_counts=tuple(cumulative),
                    sum=self._latency_sum,
                    count=total,
                ),
                device_slots=self.max_loras,
                host_capacity=self.max_cpu_loras,
            )

    def close(self, timeout: float = 1.0) -> None:
        """Cancel queued loads and stop the loader; waits at most `timeout` s for a running one."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for entry in self._queue:
                entry.queued = False
            self._queue.clear()
            futures = list(self._futures)
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
        else:
            for future in futures:
                future.cancel()
        concurrent.futures.wait(futures, timeout=timeout)

    # ---- internals (under the lock unless said otherwise) -----------------------------

    def _lookup(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"unknown adapter {key!r}")
        return entry

    def _lookup_held(self, key: str) -> _Entry:
        """Also finds a removed adapter that pins or reservations still hold."""
        entry = self._entries.get(key) or self._retired.get(key)
        if entry is None:
            raise KeyError(f"unknown adapter {key!r}")
        return entry

    def _touch(self, entry: _Entry) -> None:
        if entry.slot is not None:
            self._device_lru.move_to_end(entry.key)
        if entry.weights is not None:
            self._host_lru.move_to_end(entry.key)

    def _device_victims(self) -> list[_Entry]:
        unpinned = [e for e in self._device_lru.values() if e.pins == 0]
        return [e for e in unpinned if not e.reservations] + [e for e in unpinned if e.reservations]

    def _take_slot(self) -> int:
        for slot, occupant in enumerate(self._slots):
            if occupant is None:
                return slot
        victims = self._device_victims()
        if not victims:
            raise RuntimeError(f"all {self.max_loras} adapter slots are pinned")
        victim = victims[0]
        slot = self._free_slot(victim)
        self._device_evictions += 1
        self._want_load(victim)
        return slot

    def _free_slot(self, entry: _Entry) -> int:
        slot = entry.slot
        assert slot is not None
        self._slots[slot] = None
        entry.slot = None
        del self._device_lru[entry.key]
        if self._evict is not None:
            self._evict(slot)
        return slot

    def _drop_memory(self, entry: _Entry) -> None:
        if entry.slot is not None:
            self._free_slot(entry)
        if entry.weights is not None:
            entry.weights = None
            del self._host_lru[entry.key]

    def _make_host_room(self) -> bool:
        """Evict LRU host entries until one more fits; False (nothing evicted) if it cannot."""
        num_over = len(self._host_lru) + self._num_loading + 1 - self.max_cpu_loras
        if num_over <= 0:
            return True
        victims = [e for e in self._host_lru.values() if e.pins == 0 and not e.reservations]
        if len(victims) < num_over:
            return False
        for victim in victims[:num_over]:
            victim.weights = None
            del self._host_lru[victim.key]
            self._host_evictions += 1
        return True

    def _want_load(self, entry: _Entry) -> None:
        """Queue a load if a reservation needs the adapter and it is nowhere."""
        if entry.retired or not entry.reservations:
            return
        if not (entry.is_ready or entry.loading or entry.queued):
            entry.queued = True
            self._queue.append(entry)

    def _dequeue(self, entry: _Entry) -> None:
        if entry.queued:
            entry.queued = False
            self._queue.remove(entry)

    def _start_queued(self) -> list[_Entry]:
        """Take queued loads, in order, while the host tier has room; the caller submits them."""
        started: list[_Entry] = []
        while self._queue and not self._closed and self._make_host_room():
            entry = self._queue.popleft()
            entry.queued = False
            entry.loading = True
            self._num_loading += 1
            self._loads += 1
            started.append(entry)
        return started

    def _submit(self, entries: list[_Entry]) -> None:
        # Outside the lock: an executor may run the load (and its completion) right away.
        for entry in entries:
            try:
                future = self._executor.submit(self._run_load, entry)
            except RuntimeError as exc:  # the executor was shut down
                self._finish(entry, None, exc, None)
                continue
            with self._lock:
                self._futures.add(future)
            future.add_done_callback(self._forget_future)  # runs now if already done

    def _forget_future(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    def _run_load(self, entry: _Entry) -> None:
        # On the loader thread, outside the lock: disk reads never block the step loop.
        start = self._clock()
        try:
            weights = self._load(entry.key)
        except BaseException as exc:
            self._finish(entry, None, exc, None)
        else:
            self._finish(entry, weights, None, self._clock() - start)

    def _finish(
        self,
        entry: _Entry,
        weights: LoRAWeights | None,
        error: BaseException | None,
        seconds: float | None,
    ) -> None:
        """A load completed (outside the lock): update the tiers, then call on_ready."""
        with self._lock:
            self._num_loading -= 1
            entry.loading = False
            if error is not None:
                self._load_failures += 1
            if seconds is not None:
                self._latency_counts[bisect.bisect_left(LOAD_LATENCY_BOUNDS, seconds)] += 1
                self._latency_sum += seconds
            notify = not entry.retired and not self._closed
            if entry.retired:
                pass  # removed while loading: the result is dropped
            elif error is not None:
                entry.error = error
            elif entry.weights is None:
                assert weights is not None
                entry.weights = weights
                self._host_lru[entry.key] = entry
            else:
                self._host_lru.move_to_end(entry.key)  # preloaded meanwhile: keep that copy
            started = self._start_queued()
        if notify and self._on_ready is not None:
            self._on_ready(entry.key)
        self._submit(started)
