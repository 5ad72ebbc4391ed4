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

# bf16 on CPUs with AVX-512 BF16, head dims 64 and 128: the scores of 16 cache rows at
# once (their 16 horizontal sums in one transpose by adds, instead of a reduction per
# dot product) and the weighted sum of V with every query head of a KV head accumulating
# in registers, each V row widened once. With K/V in the last-level cache that is 2.3x
# the loop below; in a decode step, where each layer's K/V comes from memory in scattered
# blocks, the wait on memory dominates and the gain is small (docs/BENCHMARKS.md).
_DPBF16 = r"""
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1

/* Lane i of the result: the sum of v[i]'s 16 lanes. */
static inline __attribute__((always_inline)) __m512 sum16_lanes(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: rows 4i..4i+3, that lane's part */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++) /* lanes: rows 8i..8i+3 (two halves), 8i+4..8i+7 (two) */
        c[i] = _mm512_add_ps(
            _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* out[i] = (q . k_i) * scale for the 16 bf16 rows k_i = k + i * stride of HD values. */
#define SCORES16(HD)                                                                       \
    static inline __attribute__((always_inline)) void scores16_##HD(                      \
        const bf16_t *restrict q, const bf16_t *restrict k, int64_t stride, float scale,  \
        float *restrict out) {                                                            \
        __m512 acc[16];                                                                   \
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();                        \
        for (int d = 0; d < HD; d += 32) {                                                \
            const __m512bh qd = (__m512bh)_mm512_loadu_si512(q + d);                      \
            for (int i = 0; i < 16; i++)                                                  \
                acc[i] = _mm512_dpbf16_ps(acc[i], qd,                                     \
                                          (__m512bh)_mm512_loadu_si512(k + i * stride + d)); \
        }                                                                                 \
        _mm512_storeu_ps(out, _mm512_mul_ps(sum16_lanes(acc), _mm512_set1_ps(scale)));    \
    }
SCORES16(64)
SCORES16(128)

/* bf16 x 16 -> float32 x 16 (exact: the bits shifted into the high half). */
static inline __attribute__((always_inline)) __m512 widen16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* out_g = sum_t p_g[t] v_t for GW query heads g of one KV head (p_g = p + g * len), v_t
   the HD values of that head in token t's cache row: rows of block table[t / bs] start
   at value_cache + (table[t / bs] * bs + t % bs) * row + off. */
#define WEIGHTED_SUM(GW, HD)                                                              \
    static inline __attribute__((always_inline)) void weighted_sum_##GW##_##HD(           \
        const bf16_t *value_cache, const int64_t *table, int64_t bs, int64_t row,         \
        int64_t off, int64_t len, const float *p, float *restrict out) {                  \
        __m512 acc[GW][HD / 16];                                                          \
        for (int g = 0; g < GW; g++)                                                      \
            for (int c = 0; c < HD / 16; c++) acc[g][c] = _mm512_setzero_ps();            \
        for (int64_t t0 = 0; t0 < len; t0 += bs) {                                        \
            const int64_t n = len - t0 < bs ? len - t0 : bs;                              \
            const bf16_t *v = value_cache + table[t0 / bs] * bs * row + off;              \
            for (int64_t i = 0; i < n; i++) {                                             \
                __m512 vf[HD / 16];                                                       \
                for (int c = 0; c < HD / 16; c++) vf[c] = widen16(v + i * row + 16 * c);  \
                for (int g = 0; g < GW; g++) {                                            \
                    const __m512 pg = _mm512_set1_ps(p[g * len + t0 + i]);                \
                    for (int c = 0; c < HD / 16; c++)                                     \
                        acc[g][c] = _mm512_fmadd_ps(pg, vf[c], acc[g][c]);                \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int g = 0; g < GW; g++)                                                      \
            for (int c = 0; c < HD / 16; c++)                                             \
                _mm512_storeu_ps(out + g * HD + 16 * c, acc[g][c]);                       \
    }
WEIGHTED_SUM(1, 64)
WEIGHTED_SUM(3, 64)
WEIGHTED_SUM(1, 128)
WEIGHTED_SUM(2, 128)

/* attend() for bf16 with HD 64 or 128 and blocks of 16 rows or more: scores[j * len + t],
   then acc [heads, HD] (see attend_impl). Rows past a block's last full 16 go one by one. */
#define ATTEND_DPBF16(HD, GW)                                                             \
    static void attend_dpbf16_##HD(const bf16_t *query, const bf16_t *key_cache,          \
                                   const bf16_t *value_cache, const int64_t *table,       \
                                   int64_t bs, int64_t row, int64_t h0, int64_t h1,       \
                                   int64_t groups, int64_t len, float scale,              \
                                   float *restrict scores, float *restrict acc) {         \
        for (int64_t t0 = 0; t0 < len && t0 < 2 * bs; t0 += bs)                           \
            for (int64_t i = 0; i < bs && t0 + i < len; i++)                              \
                prefetch_row(key_cache + table[t0 / bs] * bs * row + h0 * HD + i * row,   \
                             (h1 - h0) * HD * 2);                                         \
        for (int64_t t0 = 0; t0 < len; t0 += bs) {                                        \
            const int64_t n = len - t0 < bs ? len - t0 : bs;                              \
            const bf16_t *k = key_cache + table[t0 / bs] * bs * row + h0 * HD;            \
            /* K two blocks ahead; this block's V now, for the weighted sum after the  \
               softmax (a sequence's K and V fit in L2) */                                \
            for (int64_t i = 0; i < bs; i++) {                                            \
                if (t0 + 2 * bs < len)                                                    \
                    prefetch_row(key_cache + table[t0 / bs + 2] * bs * row + h0 * HD +    \
                                 i * row, (h1 - h0) * HD * 2);                            \
                if (i < n)                                                                \
                    prefetch_row(value_cache + table[t0 / bs] * bs * row + h0 * HD +      \
                                 i * row, (h1 - h0) * HD * 2);                            \
            }                                                                             \
            for (int64_t kh = 0; kh < h1 - h0; kh++)                                      \
                for (int64_t g = 0; g < groups; g++) {                                    \
                    const int64_t j = kh * groups + g;                                    \
                    const bf16_t *qj = query + j * HD;                                    \
                    int64_t i = 0;                                                        \
                    for (; i + 16 <= n; i += 16)                                          \
                        scores16_##HD(qj, k + i * row + kh * HD, row, scale,              \
                                      scores + j * len + t0 + i);                         \
                    for (; i < n; i++)                                                    \
                        scores[j * len + t0 + i] =                                        \
                            dot_bf16(qj, k + i * row + kh * HD, HD) * scale;              \
                }                                                                         \
        }                                                                                 \
        softmax_rows(scores, (h1 - h0) * groups, len);                                    \
        for (int64_t kh = 0; kh < h1 - h0; kh++) {                                        \
            int64_t g = 0;                                                                \
            for (; g + GW <= groups; g += GW)                                             \
                weighted_sum_##GW##_##HD(value_cache, table, bs, row, (h0 + kh) * HD, len,  \
                                         scores + (kh * groups + g) * len,                \
                                         acc + (kh * groups + g) * HD);                   \
            for (; g < groups; g++)                                                       \
                weighted_sum_1_##HD(value_cache, table, bs, row, (h0 + kh) * HD, len,     \
                                    scores + (kh * groups + g) * len,                     \
                                    acc + (kh * groups + g) * HD);                        \
        }                                                                                 \
    }
ATTEND_DPBF16(64, 3)
ATTEND_DPBF16(128, 2)
#endif
"""

_COMMON = C_DOT + C_BF16 + C_EXP + r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Blocks are scattered in the cache, so the hardware cannot guess the next one: each
   row of a block has the same row of the next block fetched while it is worked on. */
static inline void prefetch_row(const void *p, int64_t nbytes) {
    for (int64_t i = 0; i < nbytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

/* Each of the `heads` rows of scores [heads, len] becomes its softmax, in place. */
static inline void softmax_rows(float *scores, int64_t heads, int64_t len) {
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
}
""" + _DPBF16

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
    softmax_rows(scores, heads, len);
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
#ifdef HAVE_DPBF16
    if (sizeof(scalar_t) == sizeof(bf16_t) && a->block_size >= 16 &&
        (a->head_dim == 64 || a->head_dim == 128)) {
        const int64_t groups = a->num_heads / a->num_kv_heads;
        const int64_t *table = a->block_tables + s * a->table_stride;
        const bf16_t *q = (const bf16_t *)(a->query + s * a->q_stride + h0 * groups * a->head_dim);
        const bf16_t *kc = (const bf16_t *)a->key_cache, *vc = (const bf16_t *)a->value_cache;
        const int64_t row = a->num_kv_heads * a->head_dim, len = a->context_lens[s];
        if (a->head_dim == 64)
            attend_dpbf16_64(q, kc, vc, table, a->block_size, row, h0, h1, groups, len,
                             a->scale, scores, acc);
        else
            attend_dpbf16_128(q, kc, vc, table, a->block_size, row, h0, h1, groups, len,
                              a->scale, scores, acc);
        scalar_t *o = a->out + (s * a->num_heads + h0 * groups) * a->head_dim;
        for (int64_t i = 0; i < (h1 - h0) * groups * a->head_dim; i++) o[i] = st_@(acc[i]);
        return;
    }
#endif
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
