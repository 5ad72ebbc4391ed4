"""Fault injection: engine steps that fail on purpose, to drill how failures are contained.

Off unless `LORAPLEX_FAULTS` is set (chaos tests and operators' drills). It holds
comma-separated rules:

- `poison=ID.ID...`: the forward of any step that runs a request whose prompt contains
  these token ids, in this order, raises (a request that breaks the model);
- `broken-after=N`: every forward after the first N raises, probes included (a device
  that breaks and stays broken).

NOTE: the faults raise from inside `ModelRunner.execute`, where a real device error would,
so the engine's handling of them is the production path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.core.state import SchedulerOutput

FAULTS_ENV = "LORAPLEX_FAULTS"

Execute = Callable[[SchedulerOutput, Mapping[str, int] | None], torch.Tensor]


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


@dataclass(frozen=True, slots=True)
class FaultPlan:
    poison: tuple[int, ...] | None = None
    broken_after: int | None = None

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        poison: tuple[int, ...] | None = None
        broken_after: int | None = None
        for rule in filter(None, (r.strip() for r in spec.split(","))):
            name, sep, value = rule.partition("=")
            try:
                if name == "poison" and sep:
                    poison = tuple(int(t) for t in value.split("."))
                elif name == "broken-after" and sep:
                    broken_after = int(value)
                else:
                    raise ValueError(rule)
            except ValueError:
                raise ValueError(
                    f"{FAULTS_ENV}: unknown rule {rule!r} (poison=ID.ID..., broken-after=N)"
                ) from None
        return cls(poison=poison, broken_after=broken_after)

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        spec = os.environ.get(FAULTS_ENV, "")
        return cls.parse(spec) if spec.strip() else None

    def wrap(self, execute: Execute) -> Execute:
        num_calls = 0

        def faulty(output: SchedulerOutput, slots: Mapping[str, int] | None = None) -> torch.Tensor:
            nonlocal num_calls
            num_calls += 1
            if self.broken_after is not None and num_calls > self.broken_after:
                raise InjectedFault("injected fault: the device is broken")
            if self.poison is not None and any(
                _contains(c.request.prompt_token_ids, self.poison) for c in output.chunks
            ):
                raise InjectedFault("injected fault: a poisoned prompt")
            return execute(output, slots)

        return faulty


def _contains(tokens: list[int], needle: tuple[int, ...]) -> bool:
    n = len(needle)
    return any(tuple(tokens[i : i + n]) == needle for i in range(len(tokens) - n + 1))
