/* Paged decode attention on the CPU (see cpu_decode.py). */
#include "cpu_common.h"

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

/* bf16 on CPUs with AVX-512 BF16, head dims 64 and 128: the scores of 16 cache rows at
   once (their 16 horizontal sums in one transpose by adds, instead of a reduction per dot
   product) and the weighted sum of V with every query head of a KV head accumulating in
   registers, each V row widened once. With K/V in the last-level cache that is 2.3x the
   loop of cpu_decode_typed.h; in a decode step, where each layer's K/V comes from memory
   in scattered blocks, the wait on memory dominates and the gain is small
   (docs/BENCHMARKS.md). */
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

#define TYPED_HEADER "cpu_decode_typed.h"
#include "cpu_each_type.h"
#undef TYPED_HEADER
