"""`loraplex bench kernels`: the Triton multi-LoRA kernels against torch baselines on one GPU.

For SmolLM2-135M's LoRA groups (qkv, gate_up, down) and T tokens whose adapters are all
the same (identical) or all different (distinct): lora_shrink and lora_expand timed with
CUDA events (warmup, then the median of N runs), against, in the same process and on the
same GPU tensors, the torch reference (loraplex_kernels/reference.py: one matmul per segment and
slice) and a dense "gather-bmm" baseline that copies every token's slot buffers and pads
every adapter to the buffers' max rank.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from bench.harness.options import opt
from bench.harness.report import report_header, save_report
from loraplex_kernels import reference as ref
from loraplex_kernels.reference import LoRASegments

POPULARITIES = ("identical", "distinct", "skewed")


@dataclass(frozen=True, slots=True)
class LoRAGroupShape:
    name: str
    in_features: int
    slice_outs: tuple[int, ...]

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        return (0, *itertools.accumulate(self.slice_outs))


# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536.
SMOLLM2_GROUPS = (
    LoRAGroupShape("qkv", 576, (576, 192, 192)),
    LoRAGroupShape("gate_up", 576, (1536, 1536)),
    LoRAGroupShape("down", 1536, (576,)),
)


@dataclass(slots=True)
class KernelsOptions:
    num_tokens: tuple[int, ...] = opt((16, 64, 256), flag="--tokens")
    popularity: tuple[str, ...] = opt(("identical", "distinct"), choices=POPULARITIES)
    rank: int = opt(16, "every adapter's rank")
    max_rank: int = opt(64, "the slot buffers' R (what gather-bmm pads to)")
    dtype: str = opt("bfloat16", choices=("bfloat16", "float16", "float32"))
    warmup: int = 10
    iters: int = opt(50, "timed runs; the median is kept")
    seed: int = 0
    output: Path | None = opt(None, "JSON report", shown="bench/results/kernels-<timestamp>.json")


@dataclass(slots=True)
class KernelTiming:
    """One op on one (group, T, popularity): median microseconds of each implementation."""

    group: str
    num_tokens: int
    popularity: str
    op: str  # "shrink" or "expand"
    triton_us: float
    reference_us: float
    gather_bmm_us: float
    max_abs_err: float  # triton vs reference on the same inputs

    def summary(self) -> dict[str, object]:
        row = asdict(self)
        row["reference_over_triton"] = round(self.reference_us / self.triton_us, 2)
        row["gather_bmm_over_triton"] = round(self.gather_bmm_us / self.triton_us, 2)
        return row


@dataclass(slots=True)
class LoRAProblem:
    """One step's inputs for a group, on the GPU."""

    x: torch.Tensor  # [T, IN]
    y: torch.Tensor  # [T, OUT]
    lora_a: torch.Tensor  # [NS, NSL, R, IN], zero past each rank
    lora_b: torch.Tensor  # [NS, OUT, R], zero past each rank
    ranks: torch.Tensor  # [NS, NSL] int32
    scalings: torch.Tensor  # [NS, NSL] float32
    slice_offsets: tuple[int, ...]
    segs: LoRASegments
    row_slots: torch.Tensor  # [N] int64: the slot of each adapter row, in segment order
    shrunk: torch.Tensor = field(init=False)  # the reference's [N, NSL, R] float32

    def __post_init__(self) -> None:
        self.shrunk = ref.lora_shrink(self.x, self.lora_a, self.ranks, self.segs)


# One implementation of an op on a problem: shrink returns [N, NSL, R], expand updates p.y.
ProblemOp = Callable[[LoRAProblem], "torch.Tensor | None"]


def run_kernels(opts: KernelsOptions) -> dict[str, object]:
    if not torch.cuda.is_available():
        print(
            "loraplex bench kernels needs a CUDA GPU (the Triton kernels run compiled); "
            "the kernels' correctness tests run anywhere: pytest tests/gpu",
            file=sys.stderr,
        )
        raise SystemExit(2)
    from loraplex_kernels.lora_expand import lora_expand
    from loraplex_kernels.lora_shrink import lora_shrink

    dtype = getattr(torch, opts.dtype)
    report = report_header("kernels", opts)
    # Each op's implementations: Triton, the torch reference, gather-bmm.
    ops: dict[str, tuple[ProblemOp, ProblemOp, ProblemOp]] = {
        "shrink": (lambda p: lora_shrink(p.x, p.lora_a, p.ranks, p.segs),
                   reference_shrink, gather_bmm_shrink),
        "expand": (lambda p: lora_expand(p.y, p.shrunk, p.lora_b, p.ranks, p.scalings,
                                         p.slice_offsets, p.segs),
                   reference_expand, gather_bmm_expand),
    }
    rows: list[KernelTiming] = []
    _print_cells(_COLUMNS)
    cases = itertools.product(SMOLLM2_GROUPS, opts.num_tokens, opts.popularity)
    for group, num_tokens, popularity in cases:
        problem = make_problem(group, num_tokens, popularity, opts, dtype)
        for op, fns in ops.items():
            err = max_difference(problem, fns[0], fns[1])
            triton_us, ref_us, bmm_us = (
                round(cuda_time_us(functools.partial(fn, problem), opts.warmup, opts.iters), 2)
                for fn in fns
            )
            rows.append(KernelTiming(group.name, num_tokens, popularity, op, triton_us, ref_us,
                                     bmm_us, max_abs_err=err))
            _print_row(rows[-1])
    report["rows"] = [row.summary() for row in rows]
    save_report(report, "kernels", opts.output)
    return report


def make_problem(
    group: LoRAGroupShape,
    num_tokens: int,
    popularity: str,
    opts: KernelsOptions,
    dtype: torch.dtype,
    device: torch.device | str = "cuda",
) -> LoRAProblem:
    """T decode-like rows, each its own request. identical: one adapter for all; distinct:
    one adapter per row (T slots); skewed: T slots drawn Zipf-like (p ~ 1 / (i + 1)^1.5)."""
    gen = torch.Generator().manual_seed(opts.seed)
    num_slots = num_tokens
    if popularity == "identical":
        token_slots = [0] * num_tokens
    elif popularity == "distinct":
        token_slots = list(range(num_tokens))
    else:
        assert popularity == "skewed", popularity
        weights = torch.tensor([1.0 / (i + 1) ** 1.5 for i in range(num_slots)])
        token_slots = torch.multinomial(weights, num_tokens, True, generator=gen).tolist()
    num_slices, rank, max_rank = len(group.slice_outs), opts.rank, opts.max_rank
    offsets = group.slice_offsets
    # Slot buffers as an adapter cache keeps them: zeros past each adapter's rank.
    lora_a = torch.zeros(num_slots, num_slices, max_rank, group.in_features)
    lora_a[:, :, :rank] = torch.randn(num_slots, num_slices, rank, group.in_features, generator=gen)
    lora_a /= group.in_features**0.5
    lora_b = torch.zeros(num_slots, offsets[-1], max_rank)
    lora_b[:, :, :rank] = torch.randn(num_slots, offsets[-1], rank, generator=gen) / rank**0.5
    segs = LoRASegments.from_token_slots(token_slots, device=device)
    assert segs is not None
    row_slots = [slot for start, end, slot in segs.segments for _ in range(start, end)]
    return LoRAProblem(
        x=torch.randn(num_tokens, group.in_features, generator=gen).to(device, dtype),
        y=torch.randn(num_tokens, offsets[-1], generator=gen).to(device, dtype),
        lora_a=lora_a.to(device, dtype),
        lora_b=lora_b.to(device, dtype),
        ranks=torch.full((num_slots, num_slices), rank, dtype=torch.int32, device=device),
        scalings=torch.full((num_slots, num_slices), 2.0, device=device),
        slice_offsets=offsets,
        segs=segs,
        row_slots=torch.tensor(row_slots, dtype=torch.int64, device=device),
    )


def reference_shrink(p: LoRAProblem) -> torch.Tensor:
    return ref.lora_shrink(p.x, p.lora_a, p.ranks, p.segs)


def reference_expand(p: LoRAProblem) -> None:
    ref.lora_expand(p.y, p.shrunk, p.lora_b, p.ranks, p.scalings, p.slice_offsets, p.segs)


def gather_bmm_shrink(p: LoRAProblem) -> torch.Tensor:
    """Dense baseline: copy each row's A (all R rows, zero-padded) and batch-multiply."""
    rows = p.x.index_select(0, p.segs.token_indices)  # [N, IN]
    a = p.lora_a.index_select(0, p.row_slots)  # [N, NSL, R, IN]
    n, num_slices, max_rank, in_features = a.shape
    out = torch.bmm(a.view(n, num_slices * max_rank, in_features), rows[:, :, None])
    return out.view(n, num_slices, max_rank).float()


def gather_bmm_expand(p: LoRAProblem) -> None:
    """Dense baseline: copy each row's B (all R columns) and batch-multiply per slice."""
    b = p.lora_b.index_select(0, p.row_slots)  # [N, OUT, R]
    scalings = p.scalings.index_select(0, p.row_slots)  # [N, NSL]
    shrunk = p.shrunk.to(b.dtype)
    delta = torch.empty(p.segs.num_tokens, p.y.shape[1], dtype=p.y.dtype, device=p.y.device)
    for k in range(len(p.slice_offsets) - 1):
        lo, hi = p.slice_offsets[k], p.slice_offsets[k + 1]
        part = torch.bmm(b[:, lo:hi], shrunk[:, k, :, None])[:, :, 0]  # [N, OUT_k]
        delta[:, lo:hi] = part * scalings[:, k : k + 1].to(part.dtype)
    p.y.index_add_(0, p.segs.token_indices, delta)


def max_difference(p: LoRAProblem, triton_op: ProblemOp, reference_op: ProblemOp) -> float:
    """Max |triton - reference| over one call of each; in-place ops run on copies of y."""
    results: list[torch.Tensor] = []
    for op in (triton_op, reference_op):
        copy = replace(p, y=p.y.clone())
        out = op(copy)
        results.append(copy.y if out is None else out)
    return (results[0].float() - results[1].float()).abs().max().item()


def cuda_time_us(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median microseconds between CUDA events around one call (host overhead included
    where it leaves the GPU idle, as the reference's per-segment loop does)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1000.0


_COLUMNS = ("group", "T", "popularity", "op", "triton us", "ref us", "bmm us", "ref/tri", "bmm/tri")


def _print_cells(cells: tuple[object, ...]) -> None:
    print(" ".join(f"{c:>10}" for c in cells), flush=True)


def _print_row(row: KernelTiming) -> None:
    s = row.summary()
    times = (row.triton_us, row.reference_us, row.gather_bmm_us)
    ratios = (s["reference_over_triton"], s["gather_bmm_over_triton"])
    _print_cells((row.group, row.num_tokens, row.popularity, row.op,
                  *(f"{t:.1f}" for t in times), *(f"{r:.2f}x" for r in ratios)))
