"""Triton lora_shrink / lora_expand against their torch reference
(loraplex_kernels/reference.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise

import pytest
import torch

from loraplex_kernels import reference as ref
from loraplex_kernels.lora_expand import lora_expand
from loraplex_kernels.lora_shrink import lora_shrink
from loraplex_kernels.reference import LoRASegments

# Mixed ranks in one batch; a slot's slice k takes RANK_POOL[(3 * slot + k) % 8].
RANK_POOL = (1, 2, 7, 13, 64, 16, 33, 5)
MAX_RANK = 64
# Output slices of the group shapes: fused qkv (GQA-like), gate_up, a single-slice group.
SLICE_SHAPES = {"qkv": (48, 16, 16), "gate_up": (24, 40), "single": (40,)}
# (rtol, atol) per dtype. 16-bit: y is stored rounded (the reference rounds its delta too),
# and compiled expand multiplies the shrunk rows rounded to the adapter's dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


@dataclass(slots=True)
class LoRABatch:
    """One step's inputs: slot buffers padded with NaN past each rank, tokens with and
    without adapters (no-adapter rows of x are NaN too: the kernels must not read them)."""

    x: torch.Tensor  # [T, IN]
    lora_a: torch.Tensor  # [NS, NSL, R, IN]
    lora_b: torch.Tensor  # [NS, OUT, R]
    ranks: torch.Tensor  # [NS, NSL] int32
    scalings: torch.Tensor  # [NS, NSL] float32
    slice_offsets: tuple[int, ...]
    token_slots: list[int]
    segs: LoRASegments

    @property
    def out_features(self) -> int:
        return self.slice_offsets[-1]


def offsets_of(slice_outs: tuple[int, ...]) -> tuple[int, ...]:
    offsets = [0]
    for width in slice_outs:
        offsets.append(offsets[-1] + width)
    return tuple(offsets)


def make_batch(
    token_slots: list[int],
    rank_table: list[list[int]],
    in_features: int,
    slice_outs: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    max_rank: int = MAX_RANK,
    seed: int = 0,
) -> LoRABatch:
    gen = torch.Generator().manual_seed(seed)
    num_slots, num_slices = len(rank_table), len(slice_outs)
    offsets = offsets_of(slice_outs)
    nan = float("nan")
    lora_a = torch.full((num_slots, num_slices, max_rank, in_features), nan)
    lora_b = torch.full((num_slots, offsets[-1], max_rank), nan)
    for slot, slot_ranks in enumerate(rank_table):
        for k, r in enumerate(slot_ranks):
            lo, hi = offsets[k], offsets[k + 1]
            a = torch.randn(r, in_features, generator=gen) / math.sqrt(in_features)
            lora_a[slot, k, :r] = a
            lora_b[slot, lo:hi, :r] = torch.randn(hi - lo, r, generator=gen) / math.sqrt(max(r, 1))
    x = torch.randn(len(token_slots), in_features, generator=gen)
    x[torch.tensor([s < 0 for s in token_slots], dtype=torch.bool)] = nan
    segs = LoRASegments.from_token_slots(token_slots, device=device)
    assert segs is not None
    return LoRABatch(
        x=x.to(device, dtype),
        lora_a=lora_a.to(device, dtype),
        lora_b=lora_b.to(device, dtype),
        ranks=torch.tensor(rank_table, dtype=torch.int32, device=device),
        scalings=(0.5 + torch.rand(num_slots, num_slices, generator=gen)).to(device),
        slice_offsets=offsets,
        token_slots=token_slots,
        segs=segs,
    )


def mixed_rank_table(num_slots: int, num_slices: int) -> list[list[int]]:
    """Mixed ranks; every third slot leaves its second slice alone (an adapter without
    k_proj), and for single-slice groups every fourth slot targets nothing in the group."""
    table = [
        [RANK_POOL[(3 * s + k) % len(RANK_POOL)] for k in range(num_slices)]
        for s in range(num_slots)
    ]
    for s, row in enumerate(table):
        if num_slices > 1 and s % 3 == 1:
            row[1] = 0
        if num_slices == 1 and s % 4 == 3:
            row[0] = 0
    return table


def request_token_slots(num_tokens: int, popularity: str, seed: int) -> tuple[list[int], int]:
    """Rows of a step as requests (a few decode tokens, some prefill chunks); every fourth
    request has no adapter. Returns (slot or -1 per row, number of slots)."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < num_tokens:
        long_chunk = len(lengths) % 3 == 2
        length = int(torch.randint(5, 12, (1,), generator=gen)) if long_chunk else 1
        lengths.append(min(length, num_tokens - sum(lengths)))
    num_requests = len(lengths)
    num_slots = num_requests + 1  # the last slot is never used: all NaN but its ranks
    if popularity == "distinct":
        request_slots = list(range(num_requests))
    elif popularity == "skewed":
        # Zipf-like: slot i drawn with probability proportional to 1 / (i + 1)^1.5.
        weights = torch.tensor([1.0 / (i + 1) ** 1.5 for i in range(num_requests)])
        draws = torch.multinomial(weights, num_requests, replacement=True, generator=gen)
        request_slots = draws.tolist()
    else:
        assert popularity == "identical", popularity
        request_slots = [1] * num_requests  # slot 1 has a rank-0 slice in 2- and 3-slice groups
    slots: list[int] = []
    for i, (length, slot) in enumerate(zip(lengths, request_slots, strict=True)):
        no_adapter = i % 4 == 3 and num_requests > 1
        slots += [-1 if no_adapter else slot] * length
    return slots, num_slots


def assert_zero_past_ranks(shrunk: torch.Tensor, batch: LoRABatch) -> None:
    ranks = batch.ranks.tolist()
    for start, end, slot in batch.segs.segments:
        for k, r in enumerate(ranks[slot]):
            beyond = shrunk[start:end, k, r:]
            assert torch.equal(beyond, torch.zeros_like(beyond)), (slot, k, r)


def untouched_mask(batch: LoRABatch) -> torch.Tensor:
    """[T, OUT] bool: elements lora_expand must leave bit-identical (no adapter on the row,
    or the row's adapter has rank 0 on that slice)."""
    ranks = batch.ranks.tolist()
    mask = torch.ones(len(batch.token_slots), batch.out_features, dtype=torch.bool)
    for row, slot in enumerate(batch.token_slots):
        if slot < 0:
            continue
        for k, (lo, hi) in enumerate(pairwise(batch.slice_offsets)):
            if ranks[slot][k] > 0:
                mask[row, lo:hi] = False
    return mask


def poison_past_ranks(shrunk: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """shrunk with NaN in every column at or past its rank: lora_expand must not read them."""
    poisoned = shrunk.clone()
    ranks = batch.ranks.tolist()
    for start, end, slot in batch.segs.segments:
        for k, r in enumerate(ranks[slot]):
            poisoned[start:end, k, r:] = float("nan")
    return poisoned


def check_kernels(batch: LoRABatch, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCES[dtype]
    shrunk = lora_shrink(batch.x, batch.lora_a, batch.ranks, batch.segs)
    want_shrunk = ref.lora_shrink(batch.x, batch.lora_a, batch.ranks, batch.segs)
    assert shrunk.dtype == torch.float32
    assert shrunk.shape == (batch.segs.num_tokens, len(batch.slice_offsets) - 1, MAX_RANK)
    assert torch.isfinite(want_shrunk).all()
    torch.testing.assert_close(shrunk, want_shrunk, rtol=rtol, atol=atol)
    assert_zero_past_ranks(shrunk, batch)

    gen = torch.Generator().manual_seed(1)
    y0 = torch.randn(len(batch.token_slots), batch.out_features, generator=gen)
    y0 = y0.to(batch.x.device, dtype)
    y, want = y0.clone(), y0.clone()
    lora_expand(
        y,
        poison_past_ranks(want_shrunk, batch),
        batch.lora_b,
        batch.ranks,
        batch.scalings,
        batch.slice_offsets,
        batch.segs,
    )
    ref.lora_expand(
        want,
        want_shrunk,
        batch.lora_b,
        batch.ranks,
        batch.scalings,
        batch.slice_offsets,
        batch.segs,
    )
    torch.testing.assert_close(y, want, rtol=rtol, atol=atol)
    same = untouched_mask(batch).to(y.device)
    assert torch.equal(y[same], y0[same])
    assert not torch.equal(y[~same], y0[~same])


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("group", sorted(SLICE_SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("popularity", ["distinct", "skewed", "identical"])
def test_kernels_match_reference(
    popularity: str, num_tokens: int, group: str, dtype: torch.dtype, device: torch.device
) -> None:
    slice_outs = SLICE_SHAPES[group]
    token_slots, num_slots = request_token_slots(num_tokens, popularity, seed=num_tokens)
    rank_table = mixed_rank_table(num_slots, len(slice_outs))
    batch = make_batch(token_slots, rank_table, 40, slice_outs, dtype, device, seed=num_tokens)
    check_kernels(batch, dtype)


def test_rank_and_row_block_boundaries(device: torch.device) -> None:
    """R = 128 buffers with ranks at the edges of the 16-wide rank blocks (shrink) and rank
    steps (expand), IN = 72 (a ragged second IN step), segments of ~50 rows (two row
    blocks each)."""
    rank_table = [[1, 128], [65, 0], [64, 63], [16, 17]]
    token_slots = [-1 if row % 7 == 6 else row % 4 for row in range(200)]
    batch = make_batch(
        token_slots, rank_table, 72, (40, 24), torch.float32, device, max_rank=128, seed=3
    )
    assert batch.segs.max_seg_len > 32
    shrunk = lora_shrink(batch.x, batch.lora_a, batch.ranks, batch.segs)
    want_shrunk = ref.lora_shrink(batch.x, batch.lora_a, batch.ranks, batch.segs)
    torch.testing.assert_close(shrunk, want_shrunk, rtol=1e-5, atol=1e-5)
    assert_zero_past_ranks(shrunk, batch)
    y = torch.zeros(len(token_slots), batch.out_features, device=device)
    want = y.clone()
    args = (batch.lora_b, batch.ranks, batch.scalings, batch.slice_offsets, batch.segs)
    lora_expand(y, poison_past_ranks(shrunk, batch), *args)
    ref.lora_expand(want, shrunk, *args)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_slot_without_any_adapted_slice_is_a_no_op(device: torch.device) -> None:
    """A slot whose adapter targets none of the group's slices: zero shrink rows, y rows
    bit-identical."""
    token_slots = [0, 1, 1, 0, -1, 1]
    batch = make_batch(token_slots, [[0, 0], [7, 2]], 40, (24, 40), torch.bfloat16, device)
    shrunk = lora_shrink(batch.x, batch.lora_a, batch.ranks, batch.segs)
    assert torch.equal(shrunk[:2], torch.zeros_like(shrunk[:2]))  # slot 0's rows come first
    y0 = torch.randn(
        len(token_slots), batch.out_features, generator=torch.Generator().manual_seed(2)
    )
    y0 = y0.to(device, torch.bfloat16)
    y = y0.clone()
    lora_expand(
        y, shrunk, batch.lora_b, batch.ranks, batch.scalings, batch.slice_offsets, batch.segs
    )
    rows = torch.tensor([0, 3, 4], device=device)
    assert torch.equal(y[rows], y0[rows])
    assert not torch.equal(y[1], y0[1])


def test_strided_activation_views(device: torch.device) -> None:
    """x and y may be column windows of wider buffers (row stride != width); the columns
    outside y's window keep their bits."""
    token_slots = [2, 0, -1, 2, 1, 0, 2]
    batch = make_batch(token_slots, mixed_rank_table(3, 3), 40, (48, 16, 16), torch.float32, device)
    wide_x = torch.randn(len(token_slots), 100, device=device)
    x = wide_x[:, 30:70]
    x.copy_(batch.x)
    assert x.stride() == (100, 1)
    shrunk = lora_shrink(x, batch.lora_a, batch.ranks, batch.segs)
    want_shrunk = ref.lora_shrink(batch.x, batch.lora_a, batch.ranks, batch.segs)
    torch.testing.assert_close(shrunk, want_shrunk, rtol=1e-5, atol=1e-5)

    wide_y0 = torch.randn(len(token_slots), 128, device=device)
    wide_y = wide_y0.clone()
    want = wide_y0[:, 20:100].clone()
    args = (batch.lora_b, batch.ranks, batch.scalings, batch.slice_offsets, batch.segs)
    lora_expand(wide_y[:, 20:100], want_shrunk, *args)
    ref.lora_expand(want, want_shrunk, *args)
    torch.testing.assert_close(wide_y[:, 20:100], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(wide_y[:, :20], wide_y0[:, :20])
    assert torch.equal(wide_y[:, 100:], wide_y0[:, 100:])


# ---- launcher checks ------------------------------------------------------------------


@pytest.fixture
def small_batch(device: torch.device) -> LoRABatch:
    return make_batch([0, 1, -1, 1], [[3, 0], [2, 5]], 40, (24, 40), torch.float32, device)


ShrinkArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, LoRASegments]


SHRINK_ERRORS: dict[str, tuple[Callable[[ShrinkArgs], ShrinkArgs], str]] = {
    "x 1-D": (lambda a: (a[0][0], *a[1:]), "x must be 2-D"),
    "x float64": (lambda a: (a[0].double(), *a[1:]), "x must be float32, bfloat16 or float16"),
    "x int": (lambda a: (a[0].long(), *a[1:]), "x must be float32"),
    "x column stride": (lambda a: (a[0].t().contiguous().t(), *a[1:]), "contiguous last dim"),
    "a wrong IN": (
        lambda a: (a[0], a[1][..., :32], *a[2:]),
        r"lora_a must be \[NS, NSL, R, IN=40\]",
    ),
    "a 3-D": (lambda a: (a[0], a[1][0], *a[2:]), "lora_a must be"),
    "a dtype": (
        lambda a: (a[0], a[1].bfloat16(), *a[2:]),
        "lora_a must have the activations' dtype",
    ),
    "a strided": (
        lambda a: (a[0], a[1].transpose(0, 1).contiguous().transpose(0, 1), *a[2:]),
        "lora_a must be contiguous",
    ),
    "ranks int64": (lambda a: (*a[:2], a[2].long(), a[3]), "ranks must be torch.int32"),
    "ranks shape": (lambda a: (*a[:2], a[2][:1], a[3]), r"ranks must have shape \(2, 2\)"),
    "token_indices int32": (
        lambda a: (*a[:3], replace(a[3], token_indices=a[3].token_indices.int())),
        "segs.token_indices must be torch.int64",
    ),
    "seg_starts short": (
        lambda a: (*a[:3], replace(a[3], seg_starts=a[3].seg_starts[:-1])),
        "segs.seg_starts must be torch.int32 of shape",
    ),
    "max_seg_len short": (
        lambda a: (*a[:3], replace(a[3], max_seg_len=1)),
        "max_seg_len 1 < a segment of 2",
    ),
    "device mismatch": (lambda a: (a[0].to("meta"), *a[1:]), "must be on one device"),
}


@pytest.mark.parametrize("case", sorted(SHRINK_ERRORS))
def test_shrink_rejects_bad_arguments(case: str, small_batch: LoRABatch) -> None:
    b = small_batch
    change, message = SHRINK_ERRORS[case]
    args = change((b.x, b.lora_a, b.ranks, b.segs))
    with pytest.raises(ValueError, match=message):
        lora_shrink(*args)


@dataclass(slots=True)
class ExpandArgs:
    y: torch.Tensor
    shrunk: torch.Tensor
    lora_b: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    slice_offsets: tuple[int, ...]
    segs: LoRASegments


EXPAND_ERRORS: dict[str, tuple[Callable[[ExpandArgs], ExpandArgs], str]] = {
    "y float64": (lambda a: replace(a, y=a.y.double()), "y must be float32, bfloat16 or float16"),
    "y 3-D": (lambda a: replace(a, y=a.y[None]), "y must be 2-D"),
    "b wrong OUT": (
        lambda a: replace(a, lora_b=a.lora_b[:, :60]),
        r"lora_b must be \[NS, OUT=64, R\]",
    ),
    "b dtype": (lambda a: replace(a, lora_b=a.lora_b.half()), "lora_b must have the activations'"),
    "b strided": (
        lambda a: replace(a, lora_b=a.lora_b.transpose(1, 2).contiguous().transpose(1, 2)),
        "lora_b must be contiguous",
    ),
    "shrunk bf16": (lambda a: replace(a, shrunk=a.shrunk.bfloat16()), "shrunk must be float32"),
    "shrunk rows": (
        lambda a: replace(a, shrunk=a.shrunk[:2]),
        r"shrunk must be float32 \[N, NSL, R\]",
    ),
    "shrunk strided": (
        lambda a: replace(a, shrunk=a.shrunk.transpose(0, 1).contiguous().transpose(0, 1)),
        "shrunk must be contiguous",
    ),
    "scalings float64": (
        lambda a: replace(a, scalings=a.scalings.double()),
        "scalings must be torch.float32",
    ),
    "ranks shape": (lambda a: replace(a, ranks=a.ranks[:1]), r"ranks must have shape \(2, 2\)"),
    "offsets end": (lambda a: replace(a, slice_offsets=(0, 24, 60)), "slice_offsets must rise"),
    "offsets order": (lambda a: replace(a, slice_offsets=(0, 70, 64)), "slice_offsets must rise"),
    "offsets count": (
        lambda a: replace(a, slice_offsets=(0, 24, 40, 64)),
        r"shrunk must be float32 \[N, NSL, R\] = \(3, 3, 64\)",
    ),
    "device mismatch": (lambda a: replace(a, scalings=a.scalings.to("meta")), "one device"),
}


@pytest.mark.parametrize("case", sorted(EXPAND_ERRORS))
def test_expand_rejects_bad_arguments(case: str, small_batch: LoRABatch) -> None:
    b = small_batch
    shrunk = torch.zeros(b.segs.num_tokens, 2, MAX_RANK, device=b.x.device)
    y = torch.zeros(len(b.token_slots), b.out_features, device=b.x.device)
    change, message = EXPAND_ERRORS[case]
    args = change(ExpandArgs(y, shrunk, b.lora_b, b.ranks, b.scalings, b.slice_offsets, b.segs))
    with pytest.raises(ValueError, match=message):
        lora_expand(
            args.y,
            args.shrunk,
            args.lora_b,
            args.ranks,
            args.scalings,
            args.slice_offsets,
            args.segs,
        )


def test_kernels_bench_refuses_to_run_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from bench.cli import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(bench, ["kernels"])
    assert result.exit_code == 2, result.output
    assert "needs a CUDA GPU" in result.output


@pytest.mark.parametrize("popularity", ["identical", "distinct", "skewed"])
def test_bench_gather_bmm_baseline_matches_reference(popularity: str, device: torch.device) -> None:
    """The benchmark's dense baseline computes what the kernels compute (ranks < R, buffers
    zero past each rank), so its timings compare like with like."""
    from bench.kernels import (
        KernelsOptions,
        LoRAGroupShape,
        gather_bmm_expand,
        gather_bmm_shrink,
        make_problem,
        reference_expand,
    )

    group = LoRAGroupShape("qkv", 40, (48, 16, 16))
    opts = KernelsOptions(rank=7, max_rank=16)
    p = make_problem(group, 9, popularity, opts, torch.float32, device)
    num_segments = {"identical": 1, "distinct": 9}.get(popularity)
    assert num_segments is None or len(p.segs.segments) == num_segments
    torch.testing.assert_close(gather_bmm_shrink(p), p.shrunk, rtol=1e-5, atol=1e-5)
    y0 = p.y.clone()
    gather_bmm_expand(p)
    got, p.y = p.y, y0.clone()
    reference_expand(p)
    torch.testing.assert_close(got, p.y, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, y0)
