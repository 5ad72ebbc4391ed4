"""Weight-only int8 / int4 linear layers on CUDA (device_quant.DeviceQuantizedWeight).

Each program computes a [BLOCK_M, BLOCK_N] tile of y: for each K tile of the weight it
loads the integers (int4: the byte of each pair of inputs, shifted to its nibble), with
the tile's group scale (and offset) per output column, dequantizes them in float32 as
w = q * scale (+ offset), rounds w to the activations' dtype (the dense path's weight,
and a Hugging Face oracle's on the same dequantized weights) and multiplies on the
tensor cores, summing in float32. BLOCK_K divides the group size, so a K tile lies in one
group. A decode step reads the integers once: half (int8) or a quarter (int4) of the
bytes of the bf16 weight it stands for.

Under TRITON_INTERPRET=1 (the CPU tests) the same kernel runs in triton's interpreter.
"""

from __future__ import annotations

from typing import Protocol

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - only on machines without triton
    raise ImportError(
        "loraplex_kernels.triton_quant needs the `triton` package (CUDA machines); "
        "elsewhere device_quant.linear dequantizes and multiplies in torch"
    ) from exc

from loraplex_kernels.lora_shrink import dot_dtype


class QuantizedTensors(Protocol):
    """What the kernel reads of a device_quant.DeviceQuantizedWeight (which calls this
    module, so it is named here by its fields only)."""

    @property
    def q(self) -> torch.Tensor: ...
    @property
    def scales(self) -> torch.Tensor: ...
    @property
    def offsets(self) -> torch.Tensor | None: ...
    @property
    def bits(self) -> int: ...
    @property
    def group_size(self) -> int: ...
    @property
    def out_features(self) -> int: ...
    @property
    def in_features(self) -> int: ...
    @property
    def kernel_block_k(self) -> int | None: ...


_OUT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# NOTE: the row count is not specialized on (triton would compile a variant for M == 1
# and for multiples of 16 on top of the BLOCK_M ones, each a first-request stall).
@triton.jit(do_not_specialize=["M"])
def _quant_linear_kernel(
    x_ptr,  # [M, K], rows x_stride apart
    q_ptr,  # int8 [N, K] or uint8 [N, K / 2]
    s_ptr,  # float32 [N, K / group]
    m_ptr,  # float32 [N, K / group] (HAS_OFFSETS)
    bias_ptr,  # float32 [N] (HAS_BIAS)
    y_ptr,  # [M, N], rows y_stride apart
    M,
    N,
    K,
    x_stride,
    y_stride,
    group_size,
    BITS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    groups = K // group_size
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :],
                    mask=row_mask[:, None], other=0.0)
        if BITS == 8:
            q = tl.load(q_ptr + cols64[None, :] * K + ks[:, None], mask=col_mask[None, :],
                        other=0)
        else:
            byte = tl.load(q_ptr + cols64[None, :] * (K // 2) + ks[:, None] // 2,
                           mask=col_mask[None, :], other=0).to(tl.int32)
            q = (byte >> ((ks[:, None] % 2) * 4)) & 15
        g = k0 // group_size
        scale = tl.load(s_ptr + cols64 * groups + g, mask=col_mask, other=0.0)
        w = q.to(tl.float32) * scale[None, :]
        if HAS_OFFSETS:
            w += tl.load(m_ptr + cols64 * groups + g, mask=col_mask, other=0.0)[None, :]
        w = w.to(W_DTYPE).to(DOT_DTYPE)
        acc = tl.dot(x.to(DOT_DTYPE), w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0)[None, :]
    out = y_ptr + rows[:, None].to(tl.int64) * y_stride + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def block_sizes(rows: int, out_features: int, block_k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): rows per program (tl.dot's 16 at least), output columns
    per program, the K tile (a divisor of the group)."""
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_n = min(64, max(16, triton.next_power_of_2(out_features)))
    return block_m, block_n, block_k


def quant_linear(x: torch.Tensor, qw: QuantizedTensors,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias): x [M, K] float32/bf16/fp16 with a contiguous last dim, bias
    float32 [N]; y [M, N] in x's dtype."""
    if x.dim() != 2 or x.shape[1] != qw.in_features:
        raise ValueError(f"quant_linear: x must be [M, {qw.in_features}], got {tuple(x.shape)}")
    if x.dtype not in _OUT_DTYPES:
        raise ValueError(f"quant_linear: x must be float32, bfloat16 or float16, got {x.dtype}")
    block_k = qw.kernel_block_k
    if block_k is None:
        raise ValueError(f"quant_linear: group size {qw.group_size} has no K tile "
                         "(a multiple of 16 is needed)")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], qw.out_features
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k = block_sizes(m, n, block_k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    offsets = qw.offsets if qw.offsets is not None else qw.scales
    _quant_linear_kernel[grid](
        x, qw.q, qw.scales, offsets, bias if bias is not None else qw.scales, y,
        m, n, qw.in_features, x.stride(0), y.stride(0), qw.group_size,
        BITS=qw.bits,
        HAS_OFFSETS=qw.offsets is not None,
        HAS_BIAS=bias is not None,
        W_DTYPE=_OUT_DTYPES[x.dtype],
        DOT_DTYPE=dot_dtype(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # q * scale + offset rounded twice, as device_quant.dequantize (the dense path's
        # weight and the oracle's) computes it, not fused into one multiply-add.
        enable_fp_fusion=False,
    )
    return y
