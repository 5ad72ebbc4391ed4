"""Background steps: a CPU step whose rows all belong to background requests (priority
number `EngineConfig.background_priority` or more: the batch tier, adapter evals; decodes
and prompt chunks alike) is cut short between two layers when a request of a lower number is
queued meanwhile, so that request starts in the next step instead of waiting out the rest
of this one.

NOTE: why. On a CPU a decode step of even one row reads every weight: 12-26 ms for SmolLM2 on
two cores, a third to a half of a short chat request's whole time to first token. Priority
orders the queue but cannot shorten the step in progress, so an adapter eval that kept the
engine busy with one row at a time raised other tenants' TTFT p99 by 1.2-1.8x (docs/
BENCHMARKS.md, "What an adapter eval costs other tenants").

NOTE: what a cut step leaves. The scheduler's bookkeeping is applied only after a step
(`Scheduler.update_after_step`), so a cut step computed nothing as far as it is concerned:
its rows are scheduled again, with the newcomer's prefill beside them, and write the same
K/V into the same slots (a prompt chunk resumes where the cut one started; its prompt
logprobs are recorded only after a whole forward, and no token was sampled). Their blocks
keep their slots; a full block the cut step would have written is unregistered from the
prefix cache (`BlockManager.forget_unwritten`) until a step writes it whole. The tenant was
charged for the step once more than it ran (its own fair-share account only). A step with a
foreground row is never cut, so a cut cannot repeat without a new arrival, and nothing
starves: each arrival cuts at most the one step in progress.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from engine.core.state import ScheduledChunk


class StepCutShort(Exception):
    """Raised between two layers of a background step that a foreground arrival cut short."""


class BackgroundSteps:
    def __init__(self, background_priority: int | None) -> None:
        self.background_priority = background_priority
        # Foreground arrivals queued for the engine (counted by note_arrival), and how many
        # of them the step loop had taken in when the step in progress began.
        self._arrivals = 0
        self._taken_in = 0
        self._cuttable = False
        self.num_cut = 0  # steps cut short so far

    def note_arrival(self, priority: int) -> None:
        """A request was queued for the engine (any thread; callers serialize, as
        AsyncEngine does under its lock)."""
        if self.background_priority is not None and priority < self.background_priority:
            self._arrivals += 1

    def take_in(self) -> None:
        """The step loop took every queued request in (under the same lock as note_arrival's
        callers): an arrival from now on is one the next step has not seen."""
        self._taken_in = self._arrivals

    @contextlib.contextmanager
    def forward(self, chunks: Sequence[ScheduledChunk]) -> Iterator[None]:
        """Around a step's forward over `chunks`: cuttable inside if every row is a
        background request's (never outside: a failed step's retries are not cut)."""
        self._cuttable = self.background_priority is not None and bool(chunks) and all(
            c.request.priority >= self.background_priority for c in chunks
        )
        try:
            yield
        finally:
            self._cuttable = False

    def check(self) -> None:
        """Between two layers (the step thread): raise StepCutShort if this step is a
        background step and a foreground request arrived since the step loop took its queue
        in."""
        if self._cuttable and self._arrivals != self._taken_in:
            self._cuttable = False
            self.num_cut += 1
            raise StepCutShort
