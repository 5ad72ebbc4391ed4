"""After a batched step raised: which of its requests it failed on, and does the device work.

NOTE: one request must not take down the others that share its step. When the batched
forward (or sampling) raises, the step is run again one request at a time: the requests
that pass go on as if nothing happened (their KV slots are written again with the same
values), and only those that fail on their own are failed. A request admitted in the same
step may have hit prefix-cache blocks that a failed request was computing; those blocks
never got their KV, so such a request fails too (the prefix cache is salted per tenant
and adapter, so this stays within the failed request's tenant). When no request passes on
its own, a one-token probe tells a broken device from requests that break the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.core.block_manager import BlockManager
from engine.core.sampler import SampleResult
from engine.core.state import Request, ScheduledChunk, SchedulerOutput
from engine.request import SamplingParams

log = logging.getLogger("loraplex.engine")

Execute = Callable[[SchedulerOutput, Mapping[str, int] | None], Tensor]
Sample = Callable[[Tensor, list[Request]], list[SampleResult]]

_PROBE_ID = "\x00probe"  # no request id from outside contains a NUL


@dataclass(slots=True)
class Isolated:
    output: SchedulerOutput  # the chunks that ran on their own, in step order
    logits: Tensor  # [S, V] of those that sample, in chunk order
    failed: list[tuple[Request, BaseException]] = field(default_factory=list)


def forward_one_by_one(
    execute: Execute,
    scheduled: SchedulerOutput,
    adapter_slots: Mapping[str, int],
    block_size: int,
) -> Isolated:
    passed: list[ScheduledChunk] = []
    rows: list[Tensor] = []
    failed: list[tuple[Request, BaseException]] = []
    unwritten: set[int] = set()  # blocks that failed chunks were to fill this step
    for chunk in scheduled.chunks:
        request = chunk.request
        if unwritten.intersection(request.block_ids):
            failed.append((request, RuntimeError(
                "its cached prompt prefix was being computed by a request that failed"
            )))
            continue
        slots = {} if request.adapter_key is None else {
            request.adapter_key: adapter_slots[request.adapter_key]
        }
        try:
            logits = execute(SchedulerOutput(chunks=[chunk]), slots)
        except Exception as exc:
            log.warning("engine request %s failed on its own: %r", request.request_id, exc)
            failed.append((request, exc))
            unwritten.update(request.block_ids[chunk.start // block_size :])
            continue
        passed.append(chunk)
        rows.append(logits)
    # With no rows the width is never read: no request samples.
    logits = torch.cat(rows) if rows else torch.empty(0, 0)
    return Isolated(SchedulerOutput(chunks=passed, preempted=scheduled.preempted), logits, failed)


def sample_one_by_one(
    sample: Sample, logits: Tensor, requests: list[Request]
) -> tuple[list[SampleResult | None], list[tuple[Request, BaseException]]]:
    results: list[SampleResult | None] = []
    failed: list[tuple[Request, BaseException]] = []
    for i, request in enumerate(requests):
        try:
            results.append(sample(logits[i : i + 1], [request])[0])
        except Exception as exc:
            log.warning("sampling for engine request %s failed: %r", request.request_id, exc)
            failed.append((request, exc))
            results.append(None)
    return results, failed


def probe_device(execute: Execute, block_manager: BlockManager, token_id: int) -> bool:
    """Run one base-model token through the model; False if it raises or no KV block is
    free to run it in (a device that cannot run that is as good as broken)."""
    probe = Request(_PROBE_ID, [token_id], SamplingParams(max_tokens=1), salt=_PROBE_ID)
    if not block_manager.allocate_slots(probe, 1):
        return False
    try:
        execute(SchedulerOutput(chunks=[ScheduledChunk(probe, 0, 1)]), {})
    except Exception as exc:
        log.error("engine device probe failed: %r", exc)
        return False
    finally:
        block_manager.free(probe)
    return True
