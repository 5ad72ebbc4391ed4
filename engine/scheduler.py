"""Continuous batching: which requests run in the next step, and how many tokens each.

No prefill and decode phases: every step has a token budget (`max_num_batched_tokens`) and a
cap on running sequences (`max_num_seqs`). Running requests are served first, in admission
order, each with what it still needs (1 token for a decode, the rest of its prompt, chunked to
the budget, for an unfinished prefill); then waiting requests are admitted in queue order and
may be chunked too (chunked prefill).

Waiting queue order (engine/fairness.py): effective priority (lower value first; waiting
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
(the prefix cache usually returns most of it). No waiting request is admitted in a step that
preempted: memory is short, admitting would only thrash. A waiting request that cannot get
blocks preempts the worst running request only if that one's own priority is strictly lower
(a larger value); otherwise admission stops there.

NOTE: per-tenant caps (TenantContext). A tenant with `max_running` requests running is
skipped, others are admitted. A tenant whose running requests hold at least `max_kv_fraction`
of the KV blocks is deferred: its waiting requests are considered only after every other
tenant's waiting request was admitted or skipped in that step, so alone (or when the others
cannot run) it may still fill the cache. Neither cap preempts anything.

Contract with the engine: `abort_request` and `finish_request` are called between steps, never
between `schedule()` and `update_after_step()`.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.fairness import FairQueue, Gate, TenantState
from engine.request import Request, RequestStatus, ScheduledChunk, SchedulerOutput


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
        now = self.clock()
        budget = self.config.max_num_batched_tokens
        chunks: dict[str, ScheduledChunk] = {}  # insertion order = scheduling order
        step_adapters: Counter[str] = Counter()
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_needed = request.num_tokens - request.num_computed_tokens
            assert num_needed > 0, f"running request {request.request_id} has nothing to compute"
            if not self._adapter_fits(request.adapter_key, step_adapters):
                index += 1
                continue
            while True:
                # Recomputed each round: a victim scheduled earlier in this step gives its
                # tokens back to the budget.
                num_new = min(num_needed, budget)
                if self.block_manager.allocate_slots(request, num_new):
                    break
                victim = max(self.running, key=self._eviction_rank)
                victim_index = self.running.index(victim)
                self._preempt(victim)
                preempted.append(victim)
                budget += _unschedule(victim, chunks, step_adapters)
                if victim is request:
                    break
                if victim_index < index:
                    index -= 1
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; the list shrank, `index` names the next one
            chunks[request.request_id] = ScheduledChunk(
                request, request.num_computed_tokens, num_new
            )
            budget -= num_new
            if request.adapter_key is not None:
                step_adapters[request.adapter_key] += 1
            index += 1

        # Charged once no running chunk can be taken back by the loop above.
        charges = {rid: self.fair.cost(chunk) for rid, chunk in chunks.items()}
        for rid, cost in charges.items():
            self.fair.charge(chunks[rid].request, cost)

        num_loading = 0
        if not preempted:
            num_loading = self._admit_waiting(
                budget, chunks, step_adapters, charges, preempted, now
            )

        decodes = [c for c in chunks.values() if _is_decode(c)]
        prefills = [c for c in chunks.values() if not _is_decode(c)]
        output = SchedulerOutput(chunks=decodes + prefills, preempted=preempted)
        assert output.chunks or preempted or num_loading or not self.has_unfinished_requests(), (
            "scheduler made no progress: a request cannot fit in the KV cache"
        )
        return output

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The forward ran: the KV of every scheduled token is now in the cache."""
        for chunk in output.chunks:
            request = chunk.request
            assert request.num_computed_tokens == chunk.start, request.request_id
            request.num_computed_tokens += chunk.num_tokens

    # ---- internals --------------------------------------------------------------------

    def _admit_waiting(
        self,
        budget: int,
        chunks: dict[str, ScheduledChunk],
        step_adapters: Counter[str],
        charges: dict[str, float],
        preempted: list[Request],
        now: float,
    ) -> int:
        """Admit waiting requests in queue order; returns how many were skipped because
        their adapter is still loading. Victims of admission preemption go to `preempted`."""
        num_loading = 0
        running_adapters = Counter(r.adapter_key for r in self.running if r.adapter_key is not None)
        held_blocks: Counter[str] = Counter()
        for running in self.running:
            held_blocks[running.tenant_id] += len(running.block_ids)
        is_head = True  # the first request considered (adapters still loading don't count)
        hold_adapters = False  # the head waits for an adapter slot: nobody takes one first
        for request in self.fair.admission_order(now, self._gate(held_blocks)):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if request.status == RequestStatus.PREEMPTED and any(
                victim is request for victim in preempted
            ):
                continue  # it just gave its blocks to a more urgent request
            adapter_key = request.adapter_key
            if (
                adapter_key is not None
                and self.adapters is not None
                and not self.adapters.is_ready(adapter_key)
            ):
                num_loading += 1
                continue
            was_head, is_head = is_head, False
            if adapter_key is not None and (
                hold_adapters or not self._adapter_fits(adapter_key, running_adapters)
            ):
                hold_adapters = hold_adapters or was_head
                continue
            while True:
                # Recomputed after each preemption: the victim may have taken cache hits
                # registered this step with it, and its chunk's tokens are back in the budget.
                num_hit = self.block_manager.get_computed_tokens(request)
                num_new = min(request.num_tokens - num_hit, budget)
                if self.block_manager.allocate_slots(
                    request, num_new, num_cached_tokens=num_hit
                ):
                    break
                victim = max(self.running, key=self._eviction_rank, default=None)
                if victim is None or victim.priority <= request.priority:
                    # NOTE: strict queue order on memory: letting smaller requests pass would
                    # starve a large one for ever.
                    return num_loading
                held_blocks[victim.tenant_id] -= len(victim.block_ids)
                if victim.adapter_key is not None:
                    running_adapters[victim.adapter_key] -= 1
                    if not running_adapters[victim.adapter_key]:
                        del running_adapters[victim.adapter_key]
                self._preempt(victim)
                preempted.append(victim)
                budget += _unschedule(victim, chunks, step_adapters)
                self.fair.charge(victim, -charges.pop(victim.request_id, 0.0))
            self.fair.admit(request)
            if adapter_key is not None and self.adapters is not None:
                self.adapters.acquire(adapter_key)  # pins it in a device slot
                self.adapters.unreserve(adapter_key)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            held_blocks[request.tenant_id] += len(request.block_ids)
            if adapter_key is not None:
                running_adapters[adapter_key] += 1
                step_adapters[adapter_key] += 1
            chunk = chunks[request.request_id] = ScheduledChunk(request, num_hit, num_new)
            charges[request.request_id] = self.fair.cost(chunk)
            self.fair.charge(request, charges[request.request_id])
            budget -= num_new
        return num_loading

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


def _unschedule(
    request: Request, chunks: dict[str, ScheduledChunk], step_adapters: Counter[str]
) -> int:
    """Take back a chunk scheduled earlier in this step; returns its tokens."""
    chunk = chunks.pop(request.request_id, None)
    if chunk is None:
        return 0
    if request.adapter_key is not None:
        step_adapters[request.adapter_key] -= 1
        if not step_adapters[request.adapter_key]:
            del step_adapters[request.adapter_key]
    return chunk.num_tokens


def _is_decode(chunk: ScheduledChunk) -> bool:
    return chunk.num_tokens == 1 and chunk.start >= chunk.request.num_prompt_tokens
