"""Paged decode attention on the CPU, reading K/V straight from the cache's blocks.

The torch path (`reference.paged_decode_attention`) gathers every sequence's blocks into
a contiguous copy per layer and step, then runs SDPA over it: the K/V bytes are read,
written and read again. This kernel reads each cached K/V row once, in place, through
the block table, with the softmax over the exact context (no padding, no mask).

NOTE: C in cpu_decode.c (per storage type in cpu_decode_typed.h), built by
loraplex_kernels/cpu_build.py (once per machine, cached) and called through ctypes with
the GIL released; parallel over (sequence, KV head) with OpenMP on torch's own thread
pool. Without a compiler, or when the build fails,
`available()` is False and callers keep the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from loraplex_kernels.cpu_build import SOURCE_DIR, LazyLibrary
from loraplex_kernels.cpu_ops import DTYPE_SUFFIX, kernel_for


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for sfx in DTYPE_SUFFIX.values():
        fn = getattr(lib, f"paged_decode_attention_{sfx}")
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                       ctypes.c_float, i64, i64]
        fn.restype = ctypes.c_int



# KernelSettings.decode_attention False (LORAPLEX_CPU_DECODE_KERNEL=0) turns this kernel
# alone off.
_library = LazyLibrary(
    "paged_decode", SOURCE_DIR / "cpu_decode.c", _declare,
    switch=lambda settings: settings.decode_attention,
).get


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention on `device`/`dtype` runs this kernel (builds it once)."""
    return device.type == "cpu" and dtype in DTYPE_SUFFIX and _library() is not None


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
) -> torch.Tensor:
    """Same contract as `reference.paged_decode_attention`, without the gather.

    query [S, H, D] float32 or bfloat16 (heads and head_dim contiguous); key/value cache
    [NB, BS, KVH, D] contiguous, of the query's dtype; block_tables [S, M] long (rows
    contiguous); context_lens [S] long, each in [1, M * BS] and at most max_context_len.
    Returns [S, H, D].
    """
    kernel = kernel_for(_library(), "paged_decode_attention", query.dtype)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0, (
        query.shape, key_cache.shape)
    assert query.dtype == key_cache.dtype == value_cache.dtype, (query.dtype, key_cache.dtype)
    assert query.stride(2) == 1 and query.stride(1) == head_dim, query.stride()
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert value_cache.shape == key_cache.shape
    assert block_tables.dtype == context_lens.dtype == torch.long
    assert block_tables.shape[0] == context_lens.shape[0] == num_seqs
    assert block_tables.stride(1) == 1 and context_lens.is_contiguous()
    assert max_context_len <= block_tables.shape[1] * block_size
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype)
    if num_seqs == 0:
        return out
    failed = kernel(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
        max_context_len, torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("paged decode attention: no memory for its score buffers")
    return out
