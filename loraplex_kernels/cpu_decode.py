"""Paged decode attention on the CPU, reading K/V straight from the cache's blocks.

The torch path (`reference.paged_decode_attention`) gathers every sequence's blocks into
a contiguous copy per layer and step, then runs SDPA over it: the K/V bytes are read,
written and read again. This kernel reads each cached K/V row once, in place, through
the block table, with the softmax over the exact context (no padding, no mask).

NOTE: a small C function built by loraplex_kernels/cpu_build.py (once per machine, cached) and
called through ctypes with the GIL released; parallel over (sequence, KV head) with
OpenMP on torch's own thread pool. Without a compiler, or when the build fails,
`available()` is False and callers keep the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from loraplex_kernels.cpu_build import C_BF16, C_DOT, C_EXP, LazyLibrary, instantiate
from loraplex_kernels.cpu_ops import DTYPE_SUFFIX, kernel_for

_COMMON = C_DOT + C_BF16 + C_EXP + r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Blocks are scattered in the cache, so the hardware cannot guess the next one: each
   row of a block has the same row of the next block fetched while it is worked on. */
static inline void prefetch_row(const void *p, int64_t nbytes) {
    for (int64_t i = 0; i < nbytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}
"""

# Built once per storage dtype (cpu_build.instantiate): the query, the cache and the
# output in float32 or bfloat16; scores, softmax and the weighted sum in float32.
_TEMPLATE = r"""
typedef struct {
    const scalar_t *query;
    int64_t q_stride;
    const scalar_t *key_cache;
    const scalar_t *value_cache;
    const int64_t *block_tables;
    int64_t table_stride;
    const int64_t *context_lens;
    scalar_t *out;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Args_@;

/* Sequence s, KV heads [h0, h1): every cached row is read once, in place, and all the
   query heads of those KV heads are done with it. scores: [(h1 - h0) * groups, len];
   acc: [(h1 - h0) * groups * hd], the output before it is stored; vrow: [hd]. */
static inline __attribute__((always_inline)) void attend_impl_@(
    const Args_@ *a, int64_t s, int64_t h0, int64_t h1, float *restrict scores,
    float *restrict acc, float *restrict vrow, const int64_t hd) {
    const int64_t groups = a->num_heads / a->num_kv_heads;
    const int64_t bs = a->block_size;
    const int64_t row = a->num_kv_heads * hd; /* one token slot of the cache */
    const int64_t len = a->context_lens[s];
    const int64_t heads = (h1 - h0) * groups;
    const int64_t *table = a->block_tables + s * a->table_stride;
    const scalar_t *q = a->query + s * a->q_stride + h0 * groups * hd;
    scalar_t *restrict o = a->out + (s * a->num_heads + h0 * groups) * hd;
    const int64_t row_bytes = (h1 - h0) * hd * (int64_t)sizeof(scalar_t);
    /* Block by block: a block's slots are consecutive rows of the cache. */
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const scalar_t *k = a->key_cache + table[t0 / bs] * bs * row + h0 * hd;
        const scalar_t *next =
            t0 + bs < len ? a->key_cache + table[t0 / bs + 1] * bs * row + h0 * hd : NULL;
        for (int64_t i = 0; i < n; i++) {
            if (next != NULL) prefetch_row(next + i * row, row_bytes);
            /* KV head by KV head, its query heads reading the same K in L1 */
            for (int64_t kh = 0, j = 0; kh < h1 - h0; kh++) {
                const scalar_t *kr = k + i * row + kh * hd;
                for (int64_t g = 0; g < groups; g++, j++)
                    scores[j * len + t0 + i] = dot_@(q + j * hd, kr, hd) * a->scale;
            }
        }
    }
    for (int64_t j = 0; j < heads; j++) {
        float *p = scores + j * len;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < len; t++) m = p[t] > m ? p[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            p[t] = exp_f32(p[t] - m);
            sum += p[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) p[t] *= inv;
    }
    for (int64_t i = 0; i < heads * hd; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const scalar_t *v = a->value_cache + table[t0 / bs] * bs * row + h0 * hd;
        const scalar_t *next =
            t0 + bs < len ? a->value_cache + table[t0 / bs + 1] * bs * row + h0 * hd : NULL;
        for (int64_t i = 0; i < n; i++) {
            if (next != NULL) prefetch_row(next + i * row, row_bytes);
            for (int64_t kh = 0, j = 0; kh < h1 - h0; kh++) {
                const scalar_t *restrict vi = v + i * row + kh * hd;
                /* bf16: the row in float32 once, for all of its query heads */
                const float *restrict vf = (const float *)vi;
                if (sizeof(scalar_t) != sizeof(float)) {
                    for (int64_t d = 0; d < hd; d++) vrow[d] = ld_@(vi[d]);
                    vf = vrow;
                }
                for (int64_t g = 0; g < groups; g++, j++) {
                    const float p = scores[j * len + t0 + i];
                    float *restrict oj = acc + j * hd;
                    for (int64_t d = 0; d < hd; d++) oj[d] += p * vf[d];
                }
            }
        }
    }
    for (int64_t i = 0; i < heads * hd; i++) o[i] = st_@(acc[i]);
}

/* Head dims the models use get a loop of known length (unrolled, in registers). */
static void attend_@(const Args_@ *a, int64_t s, int64_t h0, int64_t h1,
                     float *restrict scores, float *restrict acc, float *restrict vrow) {
    switch (a->head_dim) {
    case 64: attend_impl_@(a, s, h0, h1, scores, acc, vrow, 64); break;
    case 128: attend_impl_@(a, s, h0, h1, scores, acc, vrow, 128); break;
    default: attend_impl_@(a, s, h0, h1, scores, acc, vrow, a->head_dim);
    }
}

/* query [S, H, D] (rows q_stride apart, heads contiguous); key/value cache
   [NB, BS, KVH, D] contiguous; block_tables [S, >= ceil(len / BS)] rows table_stride
   apart; context_lens [S], each <= max_len; out [S, H, D] contiguous. Query head h
   reads KV head h / (H / KVH). */
int paged_decode_attention_@(
    const scalar_t *query, int64_t q_stride, const scalar_t *key_cache,
    const scalar_t *value_cache, const int64_t *block_tables, int64_t table_stride,
    const int64_t *context_lens, scalar_t *out, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t max_len,
    int64_t num_threads) {
    const Args_@ a = {query, q_stride, key_cache, value_cache, block_tables, table_stride,
                      context_lens, out, num_heads, num_kv_heads, head_dim, block_size, scale};
    /* Whole sequences per work item when there are enough of them to share out; else
       one KV head each, so that a few long sequences still use every thread. */
    const int64_t split = num_seqs >= 4 * num_threads ? 1 : num_kv_heads;
    const int64_t per_item = num_kv_heads / split;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t width = max_len > 0 ? max_len : 1;
        const int64_t heads = num_heads / split;
        float *scores = (float *)malloc(sizeof(float) * (heads * (width + head_dim) + head_dim));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * split; item++) {
            const int64_t s = item / split, h0 = (item % split) * per_item;
            if (scores != NULL)
                attend_@(&a, s, h0, h0 + per_item, scores, scores + heads * width,
                         scores + heads * (width + head_dim));
        }
        free(scores);
    }
    return failed;
}
"""

_SOURCE = _COMMON + instantiate(_TEMPLATE)

def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for sfx in DTYPE_SUFFIX.values():
        fn = getattr(lib, f"paged_decode_attention_{sfx}")
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                       ctypes.c_float, i64, i64]
        fn.restype = ctypes.c_int



# LORAPLEX_CPU_DECODE_KERNEL=0 turns this kernel alone off.
_library = LazyLibrary("paged_decode", _SOURCE, _declare,
                       env_switch="LORAPLEX_CPU_DECODE_KERNEL").get


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
