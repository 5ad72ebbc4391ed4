"""Mixed-rank LoRA batches at serving shapes for the Triton kernels, and the GPU check's
bandwidth step over them (tests/gpu/test_kernel_accuracy.py checks their results)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from bench.kernels import LoRAGroupShape, LoRAProblem, cuda_time_us
from loraplex_kernels.reference import LoRASegments

if TYPE_CHECKING:
    from bench.gpu.models import Plan

RANK_POOL = (8, 16, 32, 64)  # a slot's slice k takes RANK_POOL[(slot + k) % 4]
MAX_RANK = 64
BANDWIDTH_AIM = 0.7  # achieved bytes/s as a share of the device-to-device copy's


def llama_groups(hidden: int, intermediate: int, q: int, kv: int) -> tuple[LoRAGroupShape, ...]:
    """The fused LoRA groups of a Llama layer: qkv, o, gate_up, down."""
    return (
        LoRAGroupShape("qkv", hidden, (q, kv, kv)),
        LoRAGroupShape("o", q, (hidden,)),
        LoRAGroupShape("gate_up", hidden, (intermediate, intermediate)),
        LoRAGroupShape("down", intermediate, (hidden,)),
    )


@dataclass(frozen=True, slots=True)
class BatchSpec:
    """A step's adapter rows: `num_requests` requests of `rows_per_request` rows each
    (1: decode), on distinct slots (one each) or skewed ones (Zipf over num_requests)."""

    name: str
    num_requests: int
    rows_per_request: int
    popularity: str  # "distinct" | "skewed"


def make_mixed_problem(
    group: LoRAGroupShape, spec: BatchSpec, dtype: torch.dtype, device: torch.device, seed: int
) -> LoRAProblem:
    """A batch over slots of mixed ranks (8-64 across slots and slices, buffers zero past
    each rank, as the adapter cache keeps them)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = spec.num_requests
    if spec.popularity == "distinct":
        request_slots = list(range(num_slots))
    else:
        assert spec.popularity == "skewed", spec.popularity
        weights = torch.tensor([1.0 / (i + 1) ** 1.5 for i in range(num_slots)])
        request_slots = torch.multinomial(weights, num_slots, True, generator=gen).tolist()
    token_slots = [s for s in request_slots for _ in range(spec.rows_per_request)]
    num_slices, offsets = len(group.slice_outs), group.slice_offsets
    rank_table = [
        [RANK_POOL[(slot + k) % len(RANK_POOL)] for k in range(num_slices)]
        for slot in range(num_slots)
    ]
    # Drawn in the target dtype on the device: the gate_up buffers of 256 slots are ~1 GB.
    dgen = torch.Generator(device=device).manual_seed(seed)
    a_shape = (num_slots, num_slices, MAX_RANK, group.in_features)
    lora_a = torch.zeros(a_shape, dtype=dtype, device=device)
    lora_b = torch.zeros(num_slots, offsets[-1], MAX_RANK, dtype=dtype, device=device)
    for slot, ranks in enumerate(rank_table):
        for k, r in enumerate(ranks):
            lo, hi = offsets[k], offsets[k + 1]
            a = torch.randn(r, group.in_features, generator=dgen, device=device)
            lora_a[slot, k, :r] = (a / group.in_features**0.5).to(dtype)
            b = torch.randn(hi - lo, r, generator=dgen, device=device)
            lora_b[slot, lo:hi, :r] = (b / r**0.5).to(dtype)
    segs = LoRASegments.from_token_slots(token_slots, device=device)
    assert segs is not None
    row_slots = [slot for start, end, slot in segs.segments for _ in range(start, end)]
    num_tokens = len(token_slots)
    return LoRAProblem(
        x=torch.randn(num_tokens, group.in_features, generator=dgen, device=device).to(dtype),
        y=torch.randn(num_tokens, offsets[-1], generator=dgen, device=device).to(dtype),
        lora_a=lora_a,
        lora_b=lora_b,
        ranks=torch.tensor(rank_table, dtype=torch.int32, device=device),
        scalings=(0.5 + torch.rand(num_slots, num_slices, generator=gen)).to(device),
        slice_offsets=offsets,
        segs=segs,
        row_slots=torch.tensor(row_slots, dtype=torch.int64, device=device),
    )


def shrink(p: LoRAProblem) -> torch.Tensor:
    from loraplex_kernels.lora_shrink import lora_shrink

    return lora_shrink(p.x, p.lora_a, p.ranks, p.segs)


def expand(p: LoRAProblem) -> None:
    from loraplex_kernels.lora_expand import lora_expand

    lora_expand(p.y, p.shrunk, p.lora_b, p.ranks, p.scalings, p.slice_offsets, p.segs)


# ---------------------------------------------------------------------------- bandwidth


def time_op(fn: Callable[[], object], warmup: int, iters: int, on_cuda: bool) -> float:
    """Median seconds per call: CUDA events on a GPU, a wall clock on the CPU."""
    if on_cuda:
        return cuda_time_us(fn, warmup, iters) / 1e6
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int, device: torch.device, warmup: int, iters: int) -> float:
    """Bytes/s of a device-to-device copy, counting what it reads and what it writes."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = time_op(lambda: dst.copy_(src), warmup, iters, device.type == "cuda")
    return 2 * src.numel() * src.element_size() / seconds


def _min_bytes(p: LoRAProblem, op: str) -> int:
    """Shrink: the adapter rows of x, each segment's A up to its ranks, the float32 output.
    Expand: the shrunk rows up to their ranks, each segment's B up to its ranks, and the
    adapted slices of the y rows read and written."""
    es = p.x.element_size()
    ranks = p.ranks.tolist()
    slice_outs = [hi - lo for lo, hi in zip(p.slice_offsets, p.slice_offsets[1:], strict=False)]
    in_features = p.x.shape[1]
    total = 0
    for start, end, slot in p.segs.segments:
        rows = end - start
        slot_ranks = ranks[slot]
        if op == "shrink":
            total += rows * in_features * es + sum(slot_ranks) * in_features * es
        else:
            adapted = sum(o for o, r in zip(slice_outs, slot_ranks, strict=True) if r > 0)
            total += rows * sum(slot_ranks) * 4
            total += sum(o * r for o, r in zip(slice_outs, slot_ranks, strict=True)) * es
            total += 2 * rows * adapted * es
    if op == "shrink":
        total += p.segs.num_tokens * p.shrunk.shape[1] * p.shrunk.shape[2] * 4
    return total


def measure_bandwidth(plan: Plan, device: torch.device) -> dict[str, Any]:
    """The kernel_bandwidth step: shrink and expand in bfloat16 over the plan's bandwidth
    batches, each case's bytes/s as a share of a device-to-device copy's."""
    on_cuda = device.type == "cuda"
    warmup, iters = plan.timing_warmup, plan.timing_iters
    copy_bps = copy_bandwidth(plan.copy_bytes, device, warmup, iters)
    ops: dict[str, Callable[[LoRAProblem], object]] = {"shrink": shrink, "expand": expand}
    cases: list[dict[str, Any]] = []
    for gi, group in enumerate(llama_groups(*plan.kernel_dims)):
        for bi, spec in enumerate(BatchSpec(*batch) for batch in plan.bandwidth_batches):
            p = make_mixed_problem(group, spec, torch.bfloat16, device, seed=7 + 100 * gi + bi)
            # Expand adds into y in place: timed over and over, y only grows.
            for op, fn in ops.items():
                seconds = time_op(functools.partial(fn, p), warmup, iters, on_cuda)
                moved = _min_bytes(p, op)
                bps = moved / seconds
                cases.append({
                    "group": group.name,
                    "batch": spec.name,
                    "op": op,
                    "bytes_moved": moved,  # the least the op must read and write
                    "seconds": seconds,
                    "bytes_per_s": bps,
                    "fraction_of_copy": round(bps / copy_bps, 4),
                    "meets_aim": bps / copy_bps >= BANDWIDTH_AIM,
                })
            del p
    return {
        "timer": "cuda events" if on_cuda else "wall clock (interpreter: not a bandwidth)",
        "copy_bytes_per_s": copy_bps,
        "aim_fraction": BANDWIDTH_AIM,
        "best_fraction": {
            op: max(c["fraction_of_copy"] for c in cases if c["op"] == op) for op in ops
        },
        "cases": cases,
    }
