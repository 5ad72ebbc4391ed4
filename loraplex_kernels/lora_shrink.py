"""Segmented multi-LoRA shrink (Punica SGMV style): x rows times their slot's A, all slices.

Layout of the slot-stacked buffers and of LoRASegments: loraplex_kernels/reference.py, "multi-LoRA".
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - only on machines without triton
    raise ImportError(
        "loraplex_kernels.lora_shrink needs the `triton` package (CUDA machines); "
        "the CPU path uses loraplex_kernels.reference.lora_shrink"
    ) from exc

from loraplex_kernels.reference import LoRASegments

LORA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, IN], rows x_row_stride apart
    a_ptr,  # [NS, NSL, R, IN] contiguous
    ranks_ptr,  # [NS, NSL] int32
    token_indices_ptr,  # [N] int64
    seg_starts_ptr,  # [G + 1] int32
    seg_slots_ptr,  # [G] int32
    out_ptr,  # [N, NSL, R] float32, zero-filled
    x_row_stride,
    in_features,
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
    # Rank-aware: rank blocks past this (slot, slice)'s rank do nothing at all.
    rank = tl.minimum(tl.load(ranks_ptr + slot * NUM_SLICES + slice_id), MAX_RANK)
    rank_start = tl.program_id(1) * BLOCK_N
    if rank_start >= rank:
        return

    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_end
    tokens = tl.load(token_indices_ptr + rows, mask=row_mask, other=0)
    cols = rank_start + tl.arange(0, BLOCK_N)
    col_mask = cols < rank
    x_rows = x_ptr + tokens[:, None] * x_row_stride  # [BM, 1]
    a_rows = a_ptr + ((slot * NUM_SLICES + slice_id) * MAX_RANK + cols[None, :]) * in_features

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        in_mask = offs < in_features
        xs = tl.load(x_rows + offs[None, :], mask=row_mask[:, None] & in_mask[None, :], other=0.0)
        # A rows at or past the rank are masked out: never read.
        a = tl.load(a_rows + offs[:, None], mask=in_mask[:, None] & col_mask[None, :], other=0.0)
        # NOTE: "ieee" only matters for float32 inputs (no TF32 rounding, like the float32
        # reference); 16-bit inputs take the tensor cores with float32 accumulation.
        acc = tl.dot(xs.to(DOT_DTYPE), a.to(DOT_DTYPE), acc, input_precision="ieee")  # [BM, BN]

    out = out_ptr + rows[:, None] * (NUM_SLICES * MAX_RANK) + slice_id * MAX_RANK + cols[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & col_mask[None, :])


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    segs: LoRASegments,
) -> torch.Tensor:
    """x [T, IN] -> float32 [N, NSL, R]: every adapter row of x times its slot's A, for all
    NSL slices in one launch; reads ranks on the device (no host sync).

    Semantics (loraplex_kernels.reference.lora_shrink)::

        out = torch.zeros(segs.num_tokens, num_slices, max_rank, dtype=torch.float32)
        rows = x.index_select(0, segs.token_indices)
        for start, end, slot in segs.segments:
            xs = rows[start:end].float()
            for k, r in enumerate(ranks.tolist()[slot]):
                if r:
                    out[start:end, k, :r] = xs @ lora_a[slot, k, :r].float().t()

    x: float32/bfloat16/float16, last dim contiguous; lora_a [NS, NSL, R, IN] contiguous, x's
    dtype; ranks [NS, NSL] int32 (values above R act as R).
    """
    check_float_matrix("lora_shrink", "x", x)
    if lora_a.dim() != 4 or lora_a.shape[3] != x.shape[1]:
        raise ValueError(
            f"lora_shrink: lora_a must be [NS, NSL, R, IN={x.shape[1]}], got {tuple(lora_a.shape)}"
        )
    num_slots, num_slices, max_rank, in_features = lora_a.shape
    if num_slots == 0 or num_slices == 0 or max_rank == 0:
        raise ValueError(f"lora_shrink: lora_a has an empty dimension: {tuple(lora_a.shape)}")
    check_same_dtype("lora_shrink", "lora_a", lora_a, x)
    check_contiguous("lora_shrink", "lora_a", lora_a)
    check_table("lora_shrink", "ranks", ranks, (num_slots, num_slices), torch.int32)
    check_segments("lora_shrink", segs)
    check_devices("lora_shrink", x, lora_a, ranks, segs)

    num_tokens, num_segments = segs.num_tokens, int(segs.seg_slots.shape[0])
    out = torch.zeros(num_tokens, num_slices, max_rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_segments == 0:
        return out
    block_m, block_n, block_k = shrink_block_sizes(segs.max_seg_len, in_features)
    row_blocks = triton.cdiv(segs.max_seg_len, block_m)
    grid = (num_segments * row_blocks, triton.cdiv(max_rank, block_n), num_slices)
    _lora_shrink_kernel[grid](
        x,
        lora_a,
        ranks,
        segs.token_indices,
        segs.seg_starts,
        segs.seg_slots,
        out,
        x.stride(0),
        in_features,
        row_blocks,
        NUM_SLICES=num_slices,
        MAX_RANK=max_rank,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(x.dtype),
    )
    return out


# NOTE: triton's interpreter multiplies bfloat16 blocks as their raw uint16 bits, so under
# TRITON_INTERPRET=1 bfloat16 operands are widened to float32 first (exact: a bf16 product
# fits a float32). Compiled kernels multiply in the inputs' own dtype.
_INTERPRETED = not isinstance(_lora_shrink_kernel, triton.JITFunction)
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype the kernels' tl.dot operands are cast to for inputs of `dtype`."""
    if _INTERPRETED and dtype == torch.bfloat16:
        return tl.float32
    return _DOT_DTYPES[dtype]


def shrink_block_sizes(max_seg_len: int, in_features: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for lora_shrink: rows per program, rank columns per
    program, IN step. tl.dot needs every dimension >= 16."""
    # NOTE: 16 rank columns per program, the smallest tl.dot width: a rank-r slot runs
    # ceil(r / 16) programs and never multiplies past the next multiple of 16. Shrink is
    # bound by reading A and x (2 * IN * r flops per row), not by the tensor cores, and the
    # x tile each extra program re-reads comes from L2.
    block_k = min(64, max(16, triton.next_power_of_2(in_features)))
    return row_block_size(max_seg_len), 16, block_k


def row_block_size(max_seg_len: int) -> int:
    """Token rows per program: small for decode-sized segments, larger for prefill."""
    if max_seg_len <= 16:
        return 16
    return 32 if max_seg_len <= 64 else 64


# ---- launcher checks, shared with loraplex_kernels.lora_expand ----------------------------------


def check_float_matrix(op: str, name: str, t: torch.Tensor) -> None:
    """2-D, a LoRA dtype, unit stride along its last dim (rows may be a strided view)."""
    if t.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D [tokens, features], got {tuple(t.shape)}")
    if t.dtype not in LORA_DTYPES:
        raise ValueError(f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{op}: {name} needs a contiguous last dim, got strides {t.stride()}")


def check_same_dtype(op: str, name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.dtype != like.dtype:
        raise ValueError(
            f"{op}: {name} must have the activations' dtype {like.dtype}, got {t.dtype}"
        )


def check_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous, got strides {t.stride()}")


def check_table(
    op: str, name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """A small per-slot table such as ranks [NS, NSL] int32 or scalings [NS, NSL] float32."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{op}: {name} must be {dtype}, got {t.dtype}")
    check_contiguous(op, name, t)


def check_segments(op: str, segs: LoRASegments) -> None:
    num_segments = int(segs.seg_slots.shape[0])
    expected = (
        ("token_indices", segs.token_indices, torch.int64, (segs.num_tokens,)),
        ("seg_starts", segs.seg_starts, torch.int32, (num_segments + 1,)),
        ("seg_slots", segs.seg_slots, torch.int32, (num_segments,)),
    )
    for name, t, dtype, shape in expected:
        if t.dim() != 1 or tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"{op}: segs.{name} must be {dtype} of shape {shape}, "
                f"got {t.dtype} of shape {tuple(t.shape)}"
            )
        check_contiguous(op, f"segs.{name}", t)
    if len(segs.segments) != num_segments:
        raise ValueError(
            f"{op}: segs.segments lists {len(segs.segments)} segments, seg_slots {num_segments}"
        )
    # The grid covers max_seg_len rows per segment: a longer segment would lose rows.
    longest = max((end - start for start, end, _ in segs.segments), default=0)
    if longest > segs.max_seg_len:
        raise ValueError(f"{op}: segs.max_seg_len {segs.max_seg_len} < a segment of {longest}")


def check_devices(op: str, *tensors: torch.Tensor | LoRASegments) -> None:
    flat: list[torch.Tensor] = []
    for t in tensors:
        if isinstance(t, LoRASegments):
            flat += [t.token_indices, t.seg_starts, t.seg_slots]
        else:
            flat.append(t)
    devices = {t.device for t in flat}
    if len(devices) != 1:
        names = sorted(str(d) for d in devices)
        raise ValueError(f"{op}: all tensors must be on one device, got {', '.join(names)}")
