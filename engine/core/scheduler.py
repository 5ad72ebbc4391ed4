"""Continuous batching: which requests run in the next step, and how many tokens each.

No prefill and decode phases: every step has a token budget (`max_num_batched_tokens`) and a
cap on running sequences (`max_num_seqs`). Running requests past their prompt are served
first, one token each, in admission order (decodes); then prefills, of running requests
(the rest of a prompt, or a recompute) and of waiting ones (admitted), merged in one queue
order (NOTE: prefills), each chunked to what is left of the budget (chunked prefill).

NOTE: prefills. A running request's next prefill chunk is ordered as if it waited, with its
tenant's counter, ahead of its tenant's waiting requests of the same priority: with fairness
"vtc", a tenant served less, or a higher tier, gets its prompt into the very next step
however many prefills of another tenant are running; with "fcfs" running prefills go before
waiting requests of their priority, as in arrival order. Chunks are charged to the tenant
the moment they are scheduled, so the order moves within the step.

NOTE: long prefills (vLLM's names). A prefill with more than `long_prefill_token_threshold`
tokens left is long: in the step's first pass it gets at most that many tokens, and at most
`max_long_partial_prefills` long ones are served; at most `max_num_partial_prefills` chunks
stop short of their prompt's end. The caps only decide who goes first: what the first pass
leaves of the budget goes back to the long chunks it capped, then to the prefills it left
out, uncapped. So a short prompt arriving behind 8k-token prompts starts in the next step,
and a step is as full as before.

Waiting queue order (engine/core/fairness.py): effective priority (lower value first; waiting
requests age towards 0), then the tenant's virtual token counter (fairness "vtc"; "fcfs"
leaves it out), then preempted requests before new ones, then arrival, then insertion.

NOTE: max_loras. A step holds at most `max_loras` distinct adapters, and a waiting request is
admitted only if the adapters of ALL running requests, plus its own, stay within that limit.
So the running set never spans more than max_loras adapters, and every adapter a running
request pins fits the device slots at once. A waiting request blocked by this rule is skipped
and others may go ahead, until it is the oldest waiting request (the head of the queue when
a step starts): while the head is blocked, no request with an adapter is admitted, so the
running adapters drain and the head takes the first free adapter slot. Base-model requests
never take a slot and keep flowing. This cannot deadlock: with nothing running, the head
always fits. A request whose adapter is still loading from disk is skipped without holding
anybody (see AdapterHooks): requests for resident adapters never wait on another one's load.

NOTE: preemption by recompute. When a running request cannot get blocks, the worst running
request (highest priority value, then highest tenant counter under "vtc", then latest
arrival) loses its blocks and goes back to the front of its tenant's requests of its priority
in the waiting queue; it keeps its output tokens and is re-prefilled over prompt + output
(the prefix cache usually returns most of it). No waiting request is admitted once a running
request preempted in a step: memory is short, admitting would only thrash. A waiting request
that cannot get blocks preempts the worst running request only if that one's own priority is
strictly lower (a larger value); otherwise admission stops there. With every seat taken
(`max_num_seqs`), the worst running request gives its seat to a waiting request only if its
effective priority is strictly lower; a same-tier tenant waits for a seat.

NOTE: per-tenant caps (TenantContext). A tenant with `max_running` requests running is
skipped, others are admitted. A tenant whose running requests hold at least `max_kv_fraction`
of the KV blocks is deferred: its waiting requests are considered only after every other
tenant's waiting request was admitted or skipped in that step, so alone (or when the others
cannot run) it may still fill the cache. Neither cap preempts anything.

Contract with the engine: `abort_request` and `finish_request` are called between steps, never
between `schedule()` and `update_after_step()`.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.fairness import FairQueue, Gate, TenantState
from engine.core.state import Request, RequestStatus, ScheduledChunk, SchedulerOutput


class Admission(enum.Enum):
    """What `Scheduler._try_admit` did with the waiting request at the head of the queue."""

    ADMITTED = enum.auto()  # it runs in this step
    # Not this step (its adapter is loading or does not fit, the prefill caps leave it
    # out, it just gave its blocks away); the requests behind it may still be admitted.
    PASSED_OVER = enum.auto()
    # Not this step, and nobody behind it either: no seat or no memory for it (strict
    # queue order: letting smaller requests pass would starve a large one for ever).
    BLOCKED = enum.auto()


class AdapterHooks(Protocol):
    """What the scheduler tells the adapter cache (engine/lora/cache.py AdapterCache).

    A waiting request reserves its adapter (the cache starts loading it); a running one
    pins it in a device slot (acquire) until it finishes or is preempted (release).
    """

    def is_ready(self, key: str) -> bool: ...

    def reserve(self, key: str) -> None: ...

    def unreserve(self, key: str) -> None: ...

    def acquire(self, key: str) -> int: ...

    def release(self, key: str) -> None: ...


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        adapters: AdapterHooks | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,  # the clock of Request.arrival_time
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.adapters = adapters
        self.clock = clock
        # Running requests in admission order.
        self.running: list[Request] = []
        self.fair = FairQueue(config)
        self._requests: dict[str, Request] = {}
        self._seq: dict[str, int] = {}
        self._counter = itertools.count()
        self.num_preemptions = 0

    # ---- queries ----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.fair)

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests in the order the next step considers them (before its charges)."""
        return self.fair.ordered(self.clock())

    @property
    def max_tokens_capacity(self) -> int:
        """KV tokens the whole cache holds: the most one sequence can ever need."""
        return self.block_manager.num_token_slots

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or len(self.fair))

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # ---- request lifecycle --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        # The last sampled token never needs KV, hence the - 1.
        num_needed = request.num_prompt_tokens + request.sampling.max_tokens - 1
        if num_needed > self.max_tokens_capacity:
            raise ValueError(
                f"request {request.request_id!r} needs up to {num_needed} tokens of KV cache, "
                f"the cache holds {self.max_tokens_capacity}"
            )
        if request.adapter_key is not None and self.config.max_loras < 1:
            raise ValueError("LoRA adapters are disabled on this engine (max_loras = 0)")
        assert request.status == RequestStatus.WAITING and not request.block_ids
        if request.adapter_key is not None and self.adapters is not None:
            self.adapters.reserve(request.adapter_key)
        self._requests[request.request_id] = request
        self._seq[request.request_id] = next(self._counter)
        self.fair.push(request, self._seq[request.request_id])

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a live request, free its blocks; None if it is unknown or already finished."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        assert status.finished, status
        assert self._requests.get(request.request_id) is request, request.request_id
        was_running = request.status == RequestStatus.RUNNING
        if was_running:
            self.running.remove(request)
            self.fair.stop(request)
        else:
            self.fair.remove(request)
        self.block_manager.free(request)
        if request.adapter_key is not None and self.adapters is not None:
            if was_running:
                self.adapters.release(request.adapter_key)
            else:
                self.adapters.unreserve(request.adapter_key)
        request.status = status
        del self._requests[request.request_id]
        del self._seq[request.request_id]

    # ---- the step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.config.max_num_batched_tokens, self.clock())
        for running in self.running:
            plan.held_blocks[running.tenant_id] += len(running.block_ids)
            if running.adapter_key is not None:
                plan.running_adapters[running.adapter_key] += 1
        self._schedule_decodes(plan)
        self._schedule_prefills(plan)
        self._spend_leftover(plan)

        decodes = [c for c in plan.chunks.values() if _is_decode(c)]
        prefills = [c for c in plan.chunks.values() if not _is_decode(c)]
        output = SchedulerOutput(chunks=decodes + prefills, preempted=plan.preempted)
        assert (
            output.chunks or plan.preempted or plan.loading
            or not self.has_unfinished_requests()
        ), "scheduler made no progress: a request cannot fit in the KV cache"
        return output

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The forward ran: the KV of every scheduled token is now in the cache."""
        for chunk in output.chunks:
            request = chunk.request
            assert request.num_computed_tokens == chunk.start, request.request_id
            request.num_computed_tokens += chunk.num_tokens

    # ---- internals --------------------------------------------------------------------

    def _schedule_decodes(self, plan: _StepPlan) -> None:
        """One token for every running request past its prompt, in admission order."""
        for request in [r for r in self.running if _is_decoding(r)]:
            if plan.budget == 0:
                return
            if request.status != RequestStatus.RUNNING:
                continue  # preempted for a request served before it
            if not self._adapter_fits(request.adapter_key, plan.step_adapters):
                continue
            if self._allocate_running(plan, request, lambda: 1) is not None:
                self._add_chunk(plan, request, request.num_computed_tokens, 1)

    def _schedule_prefills(self, plan: _StepPlan) -> None:
        """Running prefills and waiting requests, merged in queue order (NOTE: prefills)."""
        running = [
            r for r in self.running if not _is_decoding(r) and r.request_id not in plan.chunks
        ]
        cursor = self.fair.cursor(plan.now, self._gate(plan.held_blocks))
        while plan.budget > 0:
            keyed = [
                (self.fair.running_key(r, plan.now, self._seq[r.request_id]), r)
                for r in running if r.status == RequestStatus.RUNNING
            ]
            best = min(keyed, key=lambda kr: kr[0], default=None)
            peeked = cursor.peek() if plan.admitting and not plan.memory_short else None
            if peeked is not None and (best is None or peeked[0] < best[0]):
                cursor.advance()
                plan.admitting = self._try_admit(plan, peeked[1]) is not Admission.BLOCKED
                continue
            if best is None:
                return
            running.remove(best[1])
            self._schedule_running_prefill(plan, best[1])

    def _schedule_running_prefill(self, plan: _StepPlan, request: Request) -> None:
        if not self._adapter_fits(request.adapter_key, plan.step_adapters):
            return
        num_left = request.num_tokens - request.num_computed_tokens
        num_new = self._allocate_running(plan, request, lambda: self._chunk_size(plan, num_left))
        if num_new is not None:
            self._add_chunk(plan, request, request.num_computed_tokens, num_new)

    def _allocate_running(
        self, plan: _StepPlan, request: Request, size: Callable[[], int | None]
    ) -> int | None:
        """Blocks for the next `size()` tokens of a running request, preempting the worst
        running request while they are short; the chunk size, or None: not this step (the
        caps refuse it, or it was the worst and lost its own blocks)."""
        while True:
            # Recomputed each round: a victim scheduled earlier in this step gives its
            # tokens back to the budget.
            num_new = size()
            if num_new is None:
                return None
            if self.block_manager.allocate_slots(request, num_new):
                return num_new
            victim = max(self.running, key=self._eviction_rank)
            plan.memory_short = True
            self._preempt_in_step(plan, victim)
            if victim is request:
                return None

    def _try_admit(self, plan: _StepPlan, request: Request) -> Admission:
        """Admit one waiting request if it may run (see Admission)."""
        if request.status == RequestStatus.PREEMPTED and any(
            victim is request for victim in plan.preempted
        ):
            return Admission.PASSED_OVER  # it just gave its blocks to a more urgent request
        adapter_key = request.adapter_key
        if (
            adapter_key is not None
            and self.adapters is not None
            and not self.adapters.is_ready(adapter_key)
        ):
            plan.loading.add(request.request_id)
            return Admission.PASSED_OVER
        was_head, plan.is_head = plan.is_head, False
        if adapter_key is not None and (
            plan.hold_adapters or not self._adapter_fits(adapter_key, plan.running_adapters)
        ):
            plan.hold_adapters = plan.hold_adapters or was_head
            return Admission.PASSED_OVER
        num_hit = self.block_manager.get_computed_tokens(request)
        if self._chunk_size(plan, request.num_tokens - num_hit) is None:
            return Admission.PASSED_OVER  # the partial-prefill caps leave it for a later step
        if len(self.running) >= self.config.max_num_seqs:
            # Every seat taken: only a strictly lower effective priority gives its seat
            # away (aged on both sides, so an aged request neither takes a seat from its
            # new level nor loses the one it got).
            seat_holder = max(self.running, key=self._eviction_rank)
            if self.fair.effective_priority(
                seat_holder, plan.now
            ) <= self.fair.effective_priority(request, plan.now):
                return Admission.BLOCKED
            self._preempt_in_step(plan, seat_holder)
        while True:
            # Recomputed after each preemption: the victim may have taken cache hits
            # registered this step with it, and its chunk's tokens are back in the budget.
            num_hit = self.block_manager.get_computed_tokens(request)
            num_new = self._chunk_size(plan, request.num_tokens - num_hit)
            if num_new is None:
                return Admission.PASSED_OVER  # the partial-prefill caps leave it for a later step
            if self.block_manager.allocate_slots(request, num_new, num_cached_tokens=num_hit):
                break
            victim = max(self.running, key=self._eviction_rank, default=None)
            if victim is None or victim.priority <= request.priority:
                return Admission.BLOCKED  # strict queue order on memory
            self._preempt_in_step(plan, victim)
        self.fair.admit(request)
        if adapter_key is not None and self.adapters is not None:
            self.adapters.acquire(adapter_key)  # pins it in a device slot
            self.adapters.unreserve(adapter_key)
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.held_blocks[request.tenant_id] += len(request.block_ids)
        if adapter_key is not None:
            plan.running_adapters[adapter_key] += 1
        self._add_chunk(plan, request, num_hit, num_new)
        return Admission.ADMITTED

    def _chunk_size(self, plan: _StepPlan, num_left: int) -> int | None:
        """Tokens a prefill with `num_left` to compute gets in this step's first pass;
        None: the partial-prefill caps leave it out of this step."""
        if plan.uncapped:
            return min(num_left, plan.budget) or None
        cap = self.config.long_prefill_cap
        is_long = cap is not None and num_left > cap
        if is_long and len(plan.long) >= self.config.max_long_partial_prefills:
            return None
        num_new = min(num_left, plan.budget, cap if is_long and cap is not None else num_left)
        if num_new < num_left and len(plan.partial) >= self.config.max_num_partial_prefills:
            return None
        return num_new if num_new > 0 else None

    def _add_chunk(self, plan: _StepPlan, request: Request, start: int, num_new: int) -> None:
        chunk = plan.chunks[request.request_id] = ScheduledChunk(request, start, num_new)
        plan.budget -= num_new
        if request.adapter_key is not None:
            plan.step_adapters[request.adapter_key] += 1
        cost = plan.charges[request.request_id] = self.fair.cost(chunk)
        self.fair.charge(request, cost)
        num_left = request.num_tokens - start
        if num_new < num_left:
            plan.partial.add(request.request_id)
        cap = self.config.long_prefill_cap
        if cap is not None and num_left > cap:
            plan.long.add(request.request_id)
            if num_new == cap:
                plan.capped.append(request.request_id)

    def _spend_leftover(self, plan: _StepPlan) -> None:
        """What the first pass left of the budget goes to the long prefills it capped, then
        to the prefills the caps left out, uncapped."""
        for request_id in plan.capped:
            if plan.budget == 0:
                return
            chunk = plan.chunks.get(request_id)
            if chunk is None:
                continue  # preempted later in the step
            request = chunk.request
            num_extra = min(request.num_tokens - chunk.start - chunk.num_tokens, plan.budget)
            num_new = chunk.num_tokens + num_extra
            if num_extra <= 0 or not self.block_manager.allocate_slots(request, num_new):
                continue  # no preemption for a chunk that already has its share
            grown = plan.chunks[request_id] = ScheduledChunk(request, chunk.start, num_new)
            plan.budget -= num_extra
            cost = self.fair.cost(grown)
            self.fair.charge(request, cost - plan.charges[request_id])
            plan.charges[request_id] = cost
            if grown.samples:
                plan.partial.discard(request_id)
        if plan.budget > 0:
            plan.uncapped = True
            self._schedule_prefills(plan)

    def _preempt_in_step(self, plan: _StepPlan, victim: Request) -> None:
        """Preempt a running request while planning a step, taking back its chunk."""
        plan.held_blocks[victim.tenant_id] -= len(victim.block_ids)
        if victim.adapter_key is not None:
            plan.running_adapters[victim.adapter_key] -= 1
            if not plan.running_adapters[victim.adapter_key]:
                del plan.running_adapters[victim.adapter_key]
        self._preempt(victim)
        plan.preempted.append(victim)
        chunk = plan.chunks.pop(victim.request_id, None)
        if chunk is not None:
            plan.budget += chunk.num_tokens
            self.fair.charge(victim, -plan.charges.pop(victim.request_id))
            if victim.adapter_key is not None:
                plan.step_adapters[victim.adapter_key] -= 1
                if not plan.step_adapters[victim.adapter_key]:
                    del plan.step_adapters[victim.adapter_key]
        plan.partial.discard(victim.request_id)
        plan.long.discard(victim.request_id)

    def _gate(self, held_blocks: Counter[str]) -> Callable[[TenantState], Gate]:
        """The per-tenant caps, read at every pick of an admission pass."""
        num_blocks = self.block_manager.num_blocks

        def gate(state: TenantState) -> Gate:
            context = state.context
            if context is None:
                return Gate.OPEN
            if context.max_running is not None and state.num_running >= context.max_running:
                return Gate.CLOSED
            if (
                context.max_kv_fraction is not None
                and held_blocks[state.tenant_id] >= context.max_kv_fraction * num_blocks
            ):
                return Gate.DEFER
            return Gate.OPEN

        return gate

    def _adapter_fits(self, key: str | None, adapters: Counter[str]) -> bool:
        return key is None or key in adapters or len(adapters) < self.config.max_loras

    def _eviction_rank(self, request: Request) -> tuple[int, float, float, int]:
        """Larger = preempted first."""
        counter = self.fair.counter(request.tenant_id) if self.fair.use_vtc else 0.0
        return (request.priority, counter, request.arrival_time, self._seq[request.request_id])

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        self.block_manager.free(request)  # before the reset: free reads num_computed_tokens
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.adapter_key is not None and self.adapters is not None:
            self.adapters.reserve(request.adapter_key)
            self.adapters.release(request.adapter_key)
        self.fair.requeue(request, self._seq[request.request_id])


@dataclass(slots=True)
class _StepPlan:
    """What one `schedule()` decided so far."""

    budget: int  # tokens left in the step
    now: float
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)  # in scheduling order
    charges: dict[str, float] = field(default_factory=dict)  # what each chunk cost its tenant
    step_adapters: Counter[str] = field(default_factory=Counter)  # adapters of the chunks
    running_adapters: Counter[str] = field(default_factory=Counter)  # of every running request
    held_blocks: Counter[str] = field(default_factory=Counter)  # per tenant, running requests
    preempted: list[Request] = field(default_factory=list)
    memory_short: bool = False  # a running request preempted another: admit nobody
    partial: set[str] = field(default_factory=set)  # chunks that stop short of the end
    long: set[str] = field(default_factory=set)  # chunks of long prefills
    capped: list[str] = field(default_factory=list)  # long chunks cut to the cap
    loading: set[str] = field(default_factory=set)  # skipped: their adapter is loading
    admitting: bool = True  # False: a waiting request must wait, and so do those behind it
    uncapped: bool = False  # the second pass, after the long prefills' leftover
    is_head: bool = True  # no waiting request considered yet (loading ones don't count)
    hold_adapters: bool = False  # the head waits for an adapter slot: nobody takes one first


def _is_decoding(request: Request) -> bool:
    """Past its prompt with one token to compute: its next chunk samples one token."""
    return (
        request.num_tokens - request.num_computed_tokens == 1
        and request.num_computed_tokens >= request.num_prompt_tokens
    )


def _is_decode(chunk: ScheduledChunk) -> bool:
    return chunk.num_tokens == 1 and chunk.start >= chunk.request.num_prompt_tokens
