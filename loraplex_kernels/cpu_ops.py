"""Fused CPU kernels for the small operations of a decode step, in float32 and bfloat16.

A decode step of a small model spends much of its time outside the matmuls: in ops
whose work is a few microseconds but whose dispatch, temporaries and thread-pool
barriers cost tens (RMSNorm is six torch ops on the CPU), and, with adapters, in the
per-segment LoRA matmuls (two or three torch ops per adapter, group and layer). These
kernels do each in one call, reading their inputs once:

- `rms_norm`: y = x * rsqrt(mean(x^2) + eps) * weight, row by row (sum in double).
- `lora_segments`: y[rows] += ((x[rows] @ A^T) @ B^T) * scaling for every segment of
  a step's LoRA layout, reading the adapters' A and B^T in place (the PackedLoRA layout
  of loraplex_kernels/reference.py); for decode-sized segments (prefill keeps the matmuls).
- `silu_mul`: silu(gate) * up from the fused gate/up projection, in one pass (torch's
  SiLU and multiply are two passes over [T, I]; 1.0 against 1.5-1.9 ms at 2,048 rows).
- `argmax_rows`: the greedy token of each row of a step's logits (torch's argmax is
  single-threaded and scalar here: 1.85 against 0.40 ms for 32 x 49,152 logits).
- `write_kv`: a step's new K and V rows into their cache slots, one call per layer
  instead of two `index_copy_` calls (10 against 16 us for 32 rows; in a real step both
  pay the cache misses and first-touch page faults of the slots they write).

The C is in cpu_ops.c (the kernels built for both storage types in cpu_ops_typed.h),
built by loraplex_kernels/cpu_build.py; callers check `available()` and keep the torch path
otherwise. Each kernel but the argmax (logits are float32) is built for float32 and for
bfloat16 storage; bfloat16 is computed in float32 and rounded where the Hugging Face
model's bf16 ops round (RMSNorm's normalized row, the SiLU before its product), and the
LoRA delta once, into y. Float32 results agree with the torch ops to float32 rounding.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from loraplex_kernels.cpu_build import C_TYPES, SOURCE_DIR, LazyLibrary

# Slices per LoRA group at most (Llama's qkv has three); the descriptor's width follows:
# the number of slices, then (A pointer, B^T pointer, rank, lo, hi) per slice.
MAX_SLICES = 4
DESC_WIDTH = 1 + 5 * MAX_SLICES

def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for sfx in DTYPE_SUFFIX.values():
        fn = getattr(lib, f"rms_norm_{sfx}")
        fn.argtypes, fn.restype = [ptr, i64, ptr, ptr, i64, i64, ctypes.c_float, i64], None
        fn = getattr(lib, f"add_rms_norm_{sfx}")
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float, i64]
        fn.restype = None
        fn = getattr(lib, f"lora_segments_{sfx}")
        fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64]
        fn.restype = ctypes.c_int
        fn = getattr(lib, f"silu_mul_{sfx}")
        fn.argtypes, fn.restype = [ptr, i64, ptr, i64, i64, i64], None
        fn = getattr(lib, f"write_kv_{sfx}")
        fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        fn.restype = ctypes.c_int
    lib.argmax_rows_f32.argtypes = [ptr, i64, i64, i64, ptr, i64]
    lib.argmax_rows_f32.restype = None
    lib.rope_interleaved_bf16.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64]
    lib.rope_interleaved_bf16.restype = None


# The storage dtypes the templated kernels are built for, and their C names' suffixes.
DTYPE_SUFFIX: dict[torch.dtype, str] = {getattr(torch, name): sfx
                                        for name, (_, sfx) in C_TYPES.items()}

_library = LazyLibrary(
    "cpu_ops", SOURCE_DIR / "cpu_ops.c", _declare, defines={"MAX_SLICES": MAX_SLICES}
).get


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether these kernels serve `device`/`dtype` (builds them once)."""
    return device.type == "cpu" and dtype in DTYPE_SUFFIX and _library() is not None


def kernel_for(lib: ctypes.CDLL | None, name: str, dtype: torch.dtype) -> Any:
    """The build of kernel `name` for `dtype` in `lib` (`name_f32`, `name_bf16`)."""
    assert lib is not None, "kernel not available: check available() first"
    assert dtype in DTYPE_SUFFIX, f"{name}: no {dtype} kernel"
    return getattr(lib, f"{name}_{DTYPE_SUFFIX[dtype]}")


def _kernel(name: str, dtype: torch.dtype) -> Any:
    return kernel_for(_library(), name, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] float32 or bfloat16 (rows with unit stride), weight [H] contiguous, of the
    same dtype -> new [T, H]."""
    kernel = _kernel("rms_norm", x.dtype)
    assert x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous(), (x.shape, x.stride())
    assert x.dtype == weight.dtype and weight.shape[0] == x.shape[1], (x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=x.dtype)
    kernel(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
           eps, torch.get_num_threads())
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x in place (x + residual, rounded as torch's add), then a new [T, H]:
    rms_norm(residual). x [T, H] rows with unit stride, residual [T, H] contiguous, weight
    [H] contiguous, all of one dtype (float32 or bfloat16)."""
    kernel = _kernel("add_rms_norm", x.dtype)
    assert x.dim() == 2 and x.stride(1) == 1 and residual.is_contiguous(), (x.stride(),)
    assert x.shape == residual.shape and weight.is_contiguous(), (x.shape, residual.shape)
    assert x.dtype == residual.dtype == weight.dtype and weight.shape[0] == x.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype)
    kernel(x.data_ptr(), x.stride(0), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
           x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] float32 or bfloat16 (rows with unit stride) -> new [T, I]:
    silu(gate) * up."""
    kernel = _kernel("silu_mul", gate_up.dtype)
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), num_rows, inter,
           torch.get_num_threads())
    return out


def rope_in_place(x: torch.Tensor, rope: torch.Tensor) -> None:
    """`reference.apply_rope_interleaved` into x itself: x [T, N, D] bfloat16 (heads and
    head_dim contiguous, tokens any stride apart), rope [T, 1, D / 2] complex64 with
    contiguous rows."""
    assert x.dtype == torch.bfloat16, x.dtype  # its only build (see _ROPE_TEMPLATE)
    kernel = _kernel("rope_interleaved", x.dtype)
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim, x.stride()
    assert rope.dtype == torch.complex64 and rope.shape == (num_tokens, 1, head_dim // 2)
    pairs = torch.view_as_real(rope)  # [T, 1, D / 2, 2]
    assert pairs.stride(2) == 2 and pairs.stride(3) == 1, pairs.stride()
    if num_tokens == 0:
        return
    kernel(x.data_ptr(), x.stride(0), num_tokens, num_heads, head_dim, pairs.data_ptr(),
           pairs.stride(0), torch.get_num_threads())


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] float32 (rows with unit stride) -> [S] long: each row's first largest
    value, a NaN never winning over a number; a row of NaN and -inf only gets 0."""
    lib = _library()
    assert lib is not None, "kernel not available: check available() first"
    assert logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype == torch.float32
    num_rows, vocab = logits.shape
    ids = torch.empty(num_rows, dtype=torch.long)
    if num_rows and vocab:
        lib.argmax_rows_f32(logits.data_ptr(), logits.stride(0), num_rows, vocab, ids.data_ptr(),
                            torch.get_num_threads())
    else:
        ids.zero_()
    return ids


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`reference.write_kv_cache` in one call: key, value [T, KVH, D] float32 or bfloat16
    (each token's heads contiguous) into slots slot_mapping [T] of the contiguous caches
    [NB, BS, KVH, D] of the same dtype."""
    kernel = _kernel("write_kv", key.dtype)
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    for t in (key, value):
        assert t.dtype == key.dtype and t.shape == key.shape, (t.dtype, t.shape)
        assert t.stride(2) == 1 and t.stride(1) == head_dim, t.stride()
    for c in (key_cache, value_cache):
        assert c.dtype == key.dtype and c.is_contiguous() and c.shape == key_cache.shape
        assert c.shape[2] * c.shape[3] == row, (c.shape, key.shape)
    assert slot_mapping.dtype == torch.long and slot_mapping.is_contiguous()
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, key.shape)
    if num_tokens == 0:
        return
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    failed = kernel(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), key_cache.data_ptr(),
        value_cache.data_ptr(), slot_mapping.data_ptr(), num_tokens, row, num_slots,
        torch.get_num_threads(),
    )
    if failed:
        raise IndexError(f"write_kv: a slot outside the cache's {num_slots}")


def lora_segments(
    y: torch.Tensor,
    x: torch.Tensor,
    token_indices: torch.Tensor,
    segments: torch.Tensor,
    desc: torch.Tensor,
    scales: torch.Tensor,
    max_rank: int,
) -> None:
    """In place: each segment's rows of y [T, OUT] += their LoRA delta of x [T, IN].

    token_indices [N] long; segments [G >= 1, 3] long (start, end, slot), contiguous
    from 0; desc [num_slots, DESC_WIDTH] long and scales [num_slots, MAX_SLICES] float32
    as `slot_descriptor` fills them, the tensors they point to alive and of x's dtype
    (float32 or bfloat16, as y).
    """
    kernel = _kernel("lora_segments", x.dtype)
    assert x.dtype == y.dtype and x.stride(1) == 1 and y.stride(1) == 1, (x.dtype, y.dtype)
    assert token_indices.dtype == segments.dtype == desc.dtype == torch.long
    assert segments.is_contiguous() and desc.is_contiguous() and token_indices.is_contiguous()
    assert desc.shape[1] == DESC_WIDTH and scales.shape == (desc.shape[0], MAX_SLICES)
    assert scales.dtype == torch.float32 and scales.is_contiguous()
    if segments.shape[0] == 0:
        return
    failed = kernel(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), token_indices.data_ptr(),
        segments.data_ptr(), segments.shape[0], desc.data_ptr(), scales.data_ptr(),
        x.shape[1], y.shape[1], max_rank, torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("lora_segments: no memory for its scratch rows")


def slot_descriptor(
    slices: tuple[tuple[torch.Tensor, torch.Tensor, float, int, int], ...],
) -> tuple[list[int], list[float]]:
    """One slot's rows of `desc` and `scales` for a PackedLoRA's slices (A [r, IN] and B^T
    [r, OUT_k] contiguous, float32 or bfloat16, scaling, lo, hi)."""
    assert len(slices) <= MAX_SLICES, len(slices)
    row = [len(slices)]
    scales = []
    for a, b_t, scaling, lo, hi in slices:
        assert a.is_contiguous() and b_t.is_contiguous() and a.dtype == b_t.dtype
        assert a.dtype in DTYPE_SUFFIX, a.dtype
        assert a.shape[0] == b_t.shape[0] and b_t.shape[1] == hi - lo, (a.shape, b_t.shape)
        row += [a.data_ptr(), b_t.data_ptr(), a.shape[0], lo, hi]
        scales.append(scaling)
    return row + [0] * (DESC_WIDTH - len(row)), scales + [0.0] * (MAX_SLICES - len(scales))
