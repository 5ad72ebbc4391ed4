"""Who is admitted next: per-tenant waiting queues, virtual token counters, aging.

Order of waiting requests: effective priority (lower first), then, with fairness "vtc", the
tenant's virtual token counter (lower first), then preempted requests before new ones, then
arrival time, then insertion order. With fairness "fcfs" the counter is left out, which is
the engine's order before tenants existed.

Virtual token counters ("Fairness in Serving Large Language Models", Sheng et al., OSDI'24):
every tenant has a counter; each scheduled chunk adds (w_p * prompt tokens it computes +
w_q * the output token it samples) / weight to it, so the tenant served least, relative to
its weight, goes first. A request without a tenant belongs to one shared anonymous tenant
(ANONYMOUS_TENANT): anonymous requests are served in arrival order among themselves and, as
a group, fairly against named tenants.

NOTE: counter lift. A tenant with nothing waiting or running that comes back gets
max(own counter, smallest counter of the active tenants) (with none active: the counter of
the last tenant to leave), as in the paper: idle time is not banked as credit, and service
received before is not forgiven. The smallest active counter never decreases, so an
inactive tenant whose counter is at or below it can be forgotten: it would be lifted anyway.

NOTE: charges. Prompt tokens are charged when computed, including recomputation after a
preemption (the cache hits it gets are not computed, hence not charged); an output token is
charged in the step that samples it. The scheduler charges a chunk when it is scheduled, so
later admissions of the same step already see it.

NOTE: aging. A waiting request's effective priority improves by one level per `aging_s`
seconds since its arrival, down to 0: a batch request waiting long enough competes with
standard, then premium ones. Only the queue order ages; preemption compares the requests'
own priorities, so an aged request never pushes out a running one of its original level.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from engine.config import EngineConfig
from engine.core.state import Request, RequestStatus, ScheduledChunk
from engine.request import TenantContext

# Order within one tenant and priority: (0 = preempted / 1 = new, arrival time, insertion).
_QueueKey = tuple[int, float, int]
_Entry = tuple[_QueueKey, Request]
# (gate, effective priority, counter, -1 running / 0 preempted / 1 new, arrival, insertion)
SortKey = tuple[int, int, float, int, float, int]
_K = TypeVar("_K")


class Gate(enum.IntEnum):
    """What an admission pass does with a tenant's waiting requests right now."""

    OPEN = 0
    DEFER = 1  # considered only after every other tenant's waiting requests
    CLOSED = 2  # not considered


@dataclass(slots=True)
class TenantState:
    tenant_id: str
    context: TenantContext | None  # as the tenant's latest request carried it
    counter: float = 0.0
    # priority -> waiting requests of that priority, sorted by _QueueKey
    queues: dict[int, list[_Entry]] = field(default_factory=dict)
    num_waiting: int = 0
    num_running: int = 0

    @property
    def is_active(self) -> bool:
        return bool(self.num_waiting or self.num_running)


class FairQueue:
    """The waiting requests and the tenants' counters. The scheduler owns the running list
    and reports every move: push (new), admit, requeue (preempted), remove / stop (finished
    while waiting / running)."""

    def __init__(self, config: EngineConfig) -> None:
        self.use_vtc = config.fairness == "vtc"
        self.prompt_weight = config.vtc_prompt_weight
        self.output_weight = config.vtc_output_weight
        self.aging_s = config.aging_s
        self._tenants: dict[str, TenantState] = {}
        self._active: dict[str, TenantState] = {}
        self._keys: dict[str, _QueueKey] = {}  # request id -> its key, while it waits
        self._last_counter = 0.0  # of the last tenant that went inactive with nobody left

    def __len__(self) -> int:
        return len(self._keys)

    def tenant(self, tenant_id: str) -> TenantState | None:
        return self._tenants.get(tenant_id)

    def counter(self, tenant_id: str) -> float:
        state = self._tenants.get(tenant_id)
        return 0.0 if state is None else state.counter

    # ---- membership ---------------------------------------------------------------

    def push(self, request: Request, seq: int) -> None:
        """A new request starts waiting; `seq` breaks ties between equal arrival times."""
        self._enqueue(self._activate(request), request, seq)

    def admit(self, request: Request) -> None:
        """A waiting request starts running."""
        state = self._dequeue(request)
        state.num_running += 1

    def requeue(self, request: Request, seq: int) -> None:
        """A running request was preempted and waits again (status PREEMPTED)."""
        state = self._tenants[request.tenant_id]
        assert state.num_running > 0, request.request_id
        state.num_running -= 1
        self._enqueue(state, request, seq)

    def remove(self, request: Request) -> None:
        """A waiting request finished (aborted) without running again."""
        self._maybe_deactivate(self._dequeue(request))

    def stop(self, request: Request) -> None:
        """A running request finished."""
        state = self._tenants[request.tenant_id]
        assert state.num_running > 0, request.request_id
        state.num_running -= 1
        self._maybe_deactivate(state)

    # ---- counters -----------------------------------------------------------------

    def cost(self, chunk: ScheduledChunk) -> float:
        """What a chunk adds to its tenant's counter (before the tenant's weight)."""
        request = chunk.request
        end = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens)
        num_prompt = max(0, end - chunk.start)
        return self.prompt_weight * num_prompt + (self.output_weight if chunk.samples else 0.0)

    def charge(self, request: Request, cost: float) -> None:
        """Add `cost` (negative: give back) to the request's tenant, divided by its weight."""
        weight = 1.0 if request.tenant is None else request.tenant.weight
        self._tenants[request.tenant_id].counter += cost / weight

    # ---- order --------------------------------------------------------------------

    def effective_priority(self, request: Request, now: float) -> int:
        if self.aging_s is None or request.priority <= 0:
            return request.priority
        levels = math.floor(max(0.0, now - request.arrival_time) / self.aging_s)
        return max(0, request.priority - levels)

    def ordered(self, now: float) -> list[Request]:
        """Every waiting request, best first, as counters stand now."""
        entries = [
            (self._sort_key(state, key, request, now), request)
            for state in self._active.values()
            for queue in state.queues.values()
            for key, request in queue
        ]
        entries.sort(key=_first)
        return [request for _, request in entries]

    def cursor(self, now: float, gate: Callable[[TenantState], Gate]) -> AdmissionCursor:
        """The waiting requests, best first, for one admission pass (see AdmissionCursor)."""
        return AdmissionCursor(self, now, gate)

    def running_key(self, request: Request, now: float, seq: int) -> SortKey:
        """Where a running request's next prefill chunk stands against waiting requests
        (AdmissionCursor.peek): with its tenant's counter, before the tenant's waiting ones."""
        counter = self.counter(request.tenant_id) if self.use_vtc else 0.0
        return (int(Gate.OPEN), self.effective_priority(request, now), counter, -1,
                request.arrival_time, seq)

    # ---- internals ----------------------------------------------------------------

    def _sort_key(
        self, state: TenantState, key: _QueueKey, request: Request, now: float
    ) -> tuple[int, float, int, float, int]:
        counter = state.counter if self.use_vtc else 0.0
        return (self.effective_priority(request, now), counter, *key)

    def _enqueue(self, state: TenantState, request: Request, seq: int) -> None:
        key = (0 if request.status == RequestStatus.PREEMPTED else 1, request.arrival_time, seq)
        queue = state.queues.setdefault(request.priority, [])
        bisect.insort(queue, (key, request), key=_first)
        self._keys[request.request_id] = key
        state.num_waiting += 1

    def _dequeue(self, request: Request) -> TenantState:
        key = self._keys.pop(request.request_id)
        state = self._tenants[request.tenant_id]
        queue = state.queues[request.priority]
        index = bisect.bisect_left(queue, key, key=_first)
        assert queue[index][1] is request, request.request_id
        del queue[index]
        if not queue:
            del state.queues[request.priority]
        state.num_waiting -= 1
        return state

    def _activate(self, request: Request) -> TenantState:
        state = self._tenants.get(request.tenant_id)
        if state is None:
            state = self._tenants[request.tenant_id] = TenantState(
                request.tenant_id, request.tenant
            )
        elif request.tenant is not None:
            state.context = request.tenant
        if not state.is_active:
            state.counter = max(state.counter, self._floor())
            self._active[state.tenant_id] = state
        return state

    def _maybe_deactivate(self, state: TenantState) -> None:
        if state.is_active:
            return
        del self._active[state.tenant_id]
        if not self._active:
            self._last_counter = max(self._last_counter, state.counter)
        if state.counter <= self._floor():
            del self._tenants[state.tenant_id]

    def _floor(self) -> float:
        """What a returning tenant's counter is lifted to."""
        if not self._active:
            return self._last_counter
        return min(state.counter for state in self._active.values())


class AdmissionCursor:
    """One admission pass over the waiting requests: `peek` names the best one not yet
    passed, as counters and gates stand at that moment (charges made between calls count
    at once); `advance` passes it, whether the caller admitted it or left it waiting.
    O(tenants x priorities x log n) per peek."""

    def __init__(
        self, fair: FairQueue, now: float, gate: Callable[[TenantState], Gate]
    ) -> None:
        self._fair = fair
        self._now = now
        self._gate = gate
        self._seen: dict[tuple[str, int], _QueueKey] = {}  # last key passed per queue
        self._best: tuple[SortKey, str, int, _QueueKey, Request] | None = None

    def peek(self) -> tuple[SortKey, Request] | None:
        fair, best = self._fair, None
        for state in fair._active.values():
            state_gate = self._gate(state)
            if state_gate == Gate.CLOSED:
                continue
            for priority, queue in state.queues.items():
                last = self._seen.get((state.tenant_id, priority))
                index = 0 if last is None else bisect.bisect_right(queue, last, key=_first)
                if index == len(queue):
                    continue
                key, request = queue[index]
                sort_key = (int(state_gate), *fair._sort_key(state, key, request, self._now))
                if best is None or sort_key < best[0]:
                    best = (sort_key, state.tenant_id, priority, key, request)
        self._best = best
        return None if best is None else (best[0], best[4])

    def advance(self) -> None:
        """Pass the request the last `peek` named."""
        assert self._best is not None, "advance() without a peek() naming a request"
        _, tenant_id, priority, key, _ = self._best
        self._seen[(tenant_id, priority)] = key
        self._best = None


def _first(entry: tuple[_K, Request]) -> _K:
    return entry[0]
