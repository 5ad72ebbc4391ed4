"""Segmented multi-LoRA expand (Punica SGMV style): y rows += scaling * shrunk @ B^T, in place.

Layout of the slot-stacked buffers and of LoRASegments: loraplex_kernels/reference.py, "multi-LoRA".
"""

from __future__ import annotations

import functools
from itertools import pairwise

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - only on machines without triton
    raise ImportError(
        "loraplex_kernels.lora_expand needs the `triton` package (CUDA machines); "
        "the CPU path uses loraplex_kernels.reference.lora_expand"
    ) from exc

from loraplex_kernels.lora_shrink import (
    check_contiguous,
    check_devices,
    check_float_matrix,
    check_same_dtype,
    check_segments,
    check_table,
    dot_dtype,
    row_block_size,
)
from loraplex_kernels.reference import LoRASegments


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, OUT], rows y_row_stride apart
    shrunk_ptr,  # [N, NSL, R] float32 contiguous
    b_ptr,  # [NS, OUT, R] contiguous
    ranks_ptr,  # [NS, NSL] int32
    scalings_ptr,  # [NS, NSL] float32
    slice_offsets_ptr,  # [NSL + 1] int32
    token_indices_ptr,  # [N] int64
    seg_starts_ptr,  # [G + 1] int32
    seg_slots_ptr,  # [G] int32
    y_row_stride,
    out_features,
    row_blocks,  # row blocks per segment: cdiv(max_seg_len, BLOCK_M)
    NUM_SLICES: tl.constexpr,
    MAX_RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = pid_m // row_blocks
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    row_start = tl.load(seg_starts_ptr + seg) + (pid_m % row_blocks) * BLOCK_M
    if row_start >= seg_end:
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    slice_id = tl.program_id(2)
    rank = tl.minimum(tl.load(ranks_ptr + slot * NUM_SLICES + slice_id), MAX_RANK)
    # A slice the slot's adapter does not touch: y keeps its exact bits there.
    if rank <= 0:
        return
    slice_end = tl.load(slice_offsets_ptr + slice_id + 1)
    col_start = tl.load(slice_offsets_ptr + slice_id) + tl.program_id(1) * BLOCK_N
    if col_start >= slice_end:
        return

    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_end
    tokens = tl.load(token_indices_ptr + rows, mask=row_mask, other=0)
    cols = col_start + tl.arange(0, BLOCK_N)
    col_mask = cols < slice_end
    s_rows = shrunk_ptr + rows[:, None] * (NUM_SLICES * MAX_RANK) + slice_id * MAX_RANK
    b_cols = b_ptr + (slot * out_features + cols[None, :]) * MAX_RANK  # [1, BN]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Rank-aware: the loop stops at this slot's rank, not at R.
    for r0 in range(0, rank, BLOCK_K):
        offs = r0 + tl.arange(0, BLOCK_K)
        r_mask = offs < rank
        s = tl.load(s_rows + offs[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(b_cols + offs[:, None], mask=r_mask[:, None] & col_mask[None, :], other=0.0)
        # NOTE: the float32 shrink output is cast to B's dtype (DOT_DTYPE), so 16-bit
        # adapters run on the tensor cores; products still accumulate in float32.
        acc = tl.dot(s.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision="ieee")  # [BM, BN]

    scaling = tl.load(scalings_ptr + slot * NUM_SLICES + slice_id)
    y_tile = y_ptr + tokens[:, None] * y_row_stride + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    # NOTE: a plain read-modify-write: segments partition the adapter rows and
    # token_indices are unique, so exactly one program owns each element of y.
    y = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (y.to(tl.float32) + acc * scaling).to(y.dtype), mask=mask)


def lora_expand(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    slice_offsets: tuple[int, ...],
    segs: LoRASegments,
) -> None:
    """In place: y[token_indices[i], slice k] += scalings[s, k] * shrunk[i, k, :r] @ B_{s,k}^T
    for every adapter row i (slot s, r = ranks[s, k]), all NSL slices in one launch;
    accumulates in float32 and stores in y's dtype. Rows outside the segments and slices
    of rank 0 are not written.

    Semantics (loraplex_kernels.reference.lora_expand)::

        rank_table, scale_table = ranks.tolist(), scalings.tolist()
        delta = torch.zeros(segs.num_tokens, y.shape[1], dtype=torch.float32)
        for start, end, slot in segs.segments:
            for k, r in enumerate(rank_table[slot]):
                if r:
                    lo, hi = slice_offsets[k], slice_offsets[k + 1]
                    b = lora_b[slot, lo:hi, :r].float()
                    delta[start:end, lo:hi] = (
                        shrunk[start:end, k, :r] @ b.t()
                    ) * scale_table[slot][k]
        y.index_add_(0, segs.token_indices, delta.to(y.dtype))

    y [T, OUT]: float32/bfloat16/float16, last dim contiguous; shrunk [N, NSL, R] float32
    contiguous (lora_shrink's output); lora_b [NS, OUT, R] contiguous, y's dtype; ranks
    [NS, NSL] int32 (values above R act as R); scalings [NS, NSL] float32; slice_offsets
    NSL + 1 column offsets from 0 to OUT.
    """
    check_float_matrix("lora_expand", "y", y)
    out_features = y.shape[1]
    if lora_b.dim() != 3 or lora_b.shape[1] != out_features:
        raise ValueError(
            f"lora_expand: lora_b must be [NS, OUT={out_features}, R], got {tuple(lora_b.shape)}"
        )
    num_slots, _, max_rank = lora_b.shape
    if num_slots == 0 or max_rank == 0:
        raise ValueError(f"lora_expand: lora_b has an empty dimension: {tuple(lora_b.shape)}")
    check_same_dtype("lora_expand", "lora_b", lora_b, y)
    check_contiguous("lora_expand", "lora_b", lora_b)
    num_slices = len(slice_offsets) - 1
    check_slice_offsets(slice_offsets, out_features)
    shape = (segs.num_tokens, num_slices, max_rank)
    if tuple(shrunk.shape) != shape or shrunk.dtype != torch.float32:
        raise ValueError(
            f"lora_expand: shrunk must be float32 [N, NSL, R] = {shape}, "
            f"got {shrunk.dtype} {tuple(shrunk.shape)}"
        )
    check_contiguous("lora_expand", "shrunk", shrunk)
    check_table("lora_expand", "ranks", ranks, (num_slots, num_slices), torch.int32)
    check_table("lora_expand", "scalings", scalings, (num_slots, num_slices), torch.float32)
    check_segments("lora_expand", segs)
    check_devices("lora_expand", y, shrunk, lora_b, ranks, scalings, segs)

    num_tokens, num_segments = segs.num_tokens, int(segs.seg_slots.shape[0])
    if num_tokens == 0 or num_segments == 0:
        return
    widest = max(hi - lo for lo, hi in pairwise(slice_offsets))
    if widest == 0:
        return
    block_m, block_n, block_k = expand_block_sizes(segs.max_seg_len, widest)
    row_blocks = triton.cdiv(segs.max_seg_len, block_m)
    grid = (num_segments * row_blocks, triton.cdiv(widest, block_n), num_slices)
    _lora_expand_kernel[grid](
        y,
        shrunk,
        lora_b,
        ranks,
        scalings,
        _offsets_tensor(tuple(slice_offsets), y.device),
        segs.token_indices,
        segs.seg_starts,
        segs.seg_slots,
        y.stride(0),
        out_features,
        row_blocks,
        NUM_SLICES=num_slices,
        MAX_RANK=max_rank,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(lora_b.dtype),
    )


def expand_block_sizes(max_seg_len: int, widest_slice: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for lora_expand: rows per program, output columns per
    program, rank step. tl.dot needs every dimension >= 16."""
    # NOTE: rank steps of 16 (the smallest tl.dot depth): a rank-r slot loops ceil(r / 16)
    # times, whatever the buffers' R.
    block_n = min(128, max(16, triton.next_power_of_2(widest_slice)))
    return row_block_size(max_seg_len), block_n, 16


def check_slice_offsets(slice_offsets: tuple[int, ...], out_features: int) -> None:
    offsets = list(slice_offsets)
    if (
        len(offsets) < 2
        or offsets[0] != 0
        or offsets[-1] != out_features
        or any(hi < lo for lo, hi in pairwise(offsets))
    ):
        raise ValueError(
            "lora_expand: slice_offsets must rise from 0 to OUT="
            f"{out_features} with one more entry than slices, got {tuple(offsets)}"
        )


@functools.lru_cache(maxsize=64)
def _offsets_tensor(slice_offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # NOTE: one host-to-device copy per (group shape, device), then reused: a step's
    # launches then read no host memory (and can be captured in a CUDA graph once warm).
    return torch.tensor(slice_offsets, dtype=torch.int32, device=device)
