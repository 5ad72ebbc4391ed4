/* Paged decode attention on the CPU (see cpu_decode.py). */
#include "cpu_common.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Blocks are scattered in the cache, so the hardware cannot guess the next one: each
   row of a block has the same row of the next block fetched while it is worked on, into
   L2 (into L1, the prefetches waiting for L1's miss buffers held up the loads: 30 layers'
   float32 attention at 32 rows took 34.8 ms against 25.7, docs/BENCHMARKS.md). */
static inline void prefetch_row(const void *p, int64_t nbytes) {
    for (int64_t i = 0; i < nbytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 2);
}

/* How many blocks ahead the bf16 loop fetches rows (1-3 within 4% on a Zen 4; 2 leaves
   room for a slower memory). */
#define FETCH_AHEAD 2

/* The work items of one call (a sequence, or one KV head of it), handed out one at a time
   from a shared counter. A thread takes its next item FETCH_AHEAD blocks before the end
   of the current one (in the bf16 loop below), so that the next item's first blocks come
   from memory while the current one's last blocks are worked on: otherwise every item
   starts with a wait for its first blocks, and that a few dozen times a layer. */
struct work_queue {
    int64_t *taken;
    int64_t total, split, per_item;
    const int64_t *block_tables;
    int64_t table_stride;
    const int64_t *context_lens;
    int64_t block_size;
};

/* A thread's next item (item >= total: none left), and the first of its blocks whose rows
   were fetched while the item before it ran (blocks [covered, FETCH_AHEAD) are; covered ==
   FETCH_AHEAD: none). */
struct next_item {
    int64_t item, covered;
};

static inline int64_t take_item(const struct work_queue *q) {
    return __atomic_fetch_add(q->taken, 1, __ATOMIC_RELAXED);
}

/* Floats of work a query head needs in the bf16 loop below: its 16 probabilities of a
   chunk, their factor, the running max and the running sum (cpu_decode_typed.h sizes
   the work buffers from it). */
#define DPBF16_WORK_PER_HEAD 19

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

/* bf16 on CPUs with AVX-512 BF16, head dims 64 and 128, blocks of 16 rows or more: one
   pass over the sequence's blocks with the softmax carried along (a running max and sum
   per query head; the weighted sums rescaled as the max grows), so that each block's K
   and V rows are used together while the next blocks' rows come from memory.

   The fetch of those rows is spread over the work: with the rows of a whole block
   prefetched at once (192 lines for SmolLM2's 3 KV heads), the prefetches waiting for
   the L2's miss buffers held up the loads behind them, and the step's memory time and
   compute time added up (a 32-row step's attention 20-25 ms, against 13 ms for the
   reads alone on a Zen 4: docs/BENCHMARKS.md). Here each query head's 16 scores are
   followed by a few rows' prefetches, into L2.

   The scores of 16 rows at once (their 16 horizontal sums in one transpose by adds,
   instead of a reduction per dot product); the weighted sum of V with every query head of
   a KV head accumulating in registers, each V row widened once. */
#include "cpu_avx512.h"
#ifdef HAVE_DPBF16


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

/* Lane i: (q . k_i) * scale for the 16 bf16 rows k_i = k + i * stride of HD values (each
   lane sums its own row only, so a stale row past the context spoils its lane alone). */
#define SCORES16(HD)                                                                       \
    static inline __attribute__((always_inline)) __m512 scores16_##HD(                    \
        const bf16_t *restrict q, const bf16_t *restrict k, int64_t stride, float scale) { \
        __m512 acc[16];                                                                   \
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();                        \
        for (int d = 0; d < HD; d += 32) {                                                \
            const __m512bh qd = (__m512bh)_mm512_loadu_si512(q + d);                      \
            for (int i = 0; i < 16; i++)                                                  \
                acc[i] = _mm512_dpbf16_ps(acc[i], qd,                                     \
                                          (__m512bh)_mm512_loadu_si512(k + i * stride + d)); \
        }                                                                                 \
        return _mm512_mul_ps(sum16_lanes(acc), _mm512_set1_ps(scale));                    \
    }
SCORES16(64)
SCORES16(128)

/* out_g = out_g * alpha_g + sum_i p_g[i] v_i for GW query heads g of one KV head, over
   the n <= 16 rows v_i = v + i * row of HD values (p_g = p + 16 g, out_g = out + g HD). */
#define WEIGHTED_SUM(GW, HD)                                                              \
    static inline __attribute__((always_inline)) void weighted_sum_##GW##_##HD(           \
        const bf16_t *restrict v, int64_t row, int64_t n, const float *restrict p,        \
        const float *restrict alpha, float *restrict out) {                               \
        __m512 acc[GW][HD / 16];                                                          \
        for (int g = 0; g < GW; g++)                                                      \
            for (int c = 0; c < HD / 16; c++)                                             \
                acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(out + g * HD + 16 * c),         \
                                          _mm512_set1_ps(alpha[g]));                      \
        for (int64_t i = 0; i < n; i++) {                                                 \
            __m512 vf[HD / 16];                                                           \
            for (int c = 0; c < HD / 16; c++) vf[c] = widen16_bf16(v + i * row + 16 * c); \
            for (int g = 0; g < GW; g++) {                                                \
                const __m512 pg = _mm512_set1_ps(p[16 * g + i]);                          \
                for (int c = 0; c < HD / 16; c++)                                         \
                    acc[g][c] = _mm512_fmadd_ps(pg, vf[c], acc[g][c]);                    \
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

/* attend() for bf16 (see attend_impl): the query heads of KV heads [h0, h1) of one
   sequence, their outputs into acc [heads, HD]; work: DPBF16_WORK_PER_HEAD floats a head. */
#define ATTEND_DPBF16(HD, GW)                                                             \
    static void attend_dpbf16_##HD(const bf16_t *query, const bf16_t *key_cache,          \
                                   const bf16_t *value_cache, const int64_t *table,       \
                                   int64_t bs, int64_t row, int64_t h0, int64_t h1,       \
                                   int64_t groups, int64_t len, float scale,              \
                                   float *restrict work, float *restrict acc,             \
                                   const struct work_queue *queue,                        \
                                   struct next_item *next) {                              \
        const int64_t heads = (h1 - h0) * groups, nbytes = (h1 - h0) * HD * 2;            \
        /* this chunk's probabilities [heads, 16]; per head: the factor its sums take   \
           for the chunk's new max, the running max and the running sum */                \
        float *restrict p = work, *restrict alpha = work + 16 * heads;                    \
        float *restrict m = alpha + heads, *restrict l = m + heads;                       \
        for (int64_t j = 0; j < heads; j++) m[j] = -INFINITY, l[j] = 0.0f;                \
        for (int64_t i = 0; i < heads * HD; i++) acc[i] = 0.0f;                           \
        const int64_t nblocks = (len + bs - 1) / bs;                                      \
        /* every row of a chunk is prefetched once: K's 16, then V's, a few per head */   \
        const int64_t per_head = (32 + heads - 1) / heads;                                \
        for (int64_t b = 0; b < nblocks && b < FETCH_AHEAD && b < next->covered; b++)     \
            for (int64_t i = 0; i < bs; i++) {                                            \
                prefetch_row(key_cache + (table[b] * bs + i) * row + h0 * HD, nbytes);     \
                prefetch_row(value_cache + (table[b] * bs + i) * row + h0 * HD, nbytes);   \
            }                                                                             \
        /* the next item: taken at block `take`, its blocks fetched from then on as if    \
           they followed this item's */                                                   \
        const int64_t take = nblocks > FETCH_AHEAD ? nblocks - FETCH_AHEAD : 0;           \
        const int64_t *next_table = NULL;                                                 \
        int64_t next_blocks = 0, next_h0 = 0;                                             \
        next->item = queue->total, next->covered = FETCH_AHEAD;                           \
        for (int64_t b = 0; b < nblocks; b++) {                                           \
            const int64_t n = len - b * bs < bs ? len - b * bs : bs;                      \
            const bf16_t *k = key_cache + table[b] * bs * row + h0 * HD;                  \
            const bf16_t *v = value_cache + table[b] * bs * row + h0 * HD;                \
            if (b == take) {                                                              \
                next->item = take_item(queue);                                            \
                if (next->item < queue->total) {                                          \
                    const int64_t ns = next->item / queue->split;                         \
                    next_table = queue->block_tables + ns * queue->table_stride;          \
                    next_blocks = (queue->context_lens[ns] + bs - 1) / bs;                \
                    next_h0 = (next->item % queue->split) * queue->per_item;              \
                    next->covered = b + FETCH_AHEAD - nblocks;                            \
                }                                                                         \
            }                                                                             \
            int64_t ahead = -1, ahead_h0 = h0;                                            \
            if (b + FETCH_AHEAD < nblocks)                                                \
                ahead = table[b + FETCH_AHEAD];                                           \
            else if (b + FETCH_AHEAD - nblocks < next_blocks)                             \
                ahead = next_table[b + FETCH_AHEAD - nblocks], ahead_h0 = next_h0;        \
            for (int64_t i0 = 0; i0 < n; i0 += 16) {                                      \
                const int64_t nn = n - i0 < 16 ? n - i0 : 16;                             \
                /* rows past the context hold stale values: their scores -inf, their     \
                   probabilities 0, and the weighted sums stop before them */             \
                const __mmask16 valid = (__mmask16)((1u << nn) - 1u);                     \
                for (int64_t j = 0; j < heads; j++) {                                     \
                    if (ahead >= 0)                                                       \
                        for (int64_t r = j * per_head; r < (j + 1) * per_head && r < 32; r++) \
                            prefetch_row((r < 16 ? key_cache : value_cache) +              \
                                            (ahead * bs + i0 + (r & 15)) * row +          \
                                            ahead_h0 * HD,                                \
                                        nbytes);                                          \
                    const __m512 s = _mm512_mask_mov_ps(                                  \
                        _mm512_set1_ps(-INFINITY), valid,                                 \
                        scores16_##HD(query + j * HD, k + i0 * row + (j / groups) * HD,   \
                                      row, scale));                                       \
                    const float mx = _mm512_reduce_max_ps(s);                             \
                    const float m1 = mx > m[j] ? mx : m[j];                               \
                    const __m512 e = _mm512_maskz_mov_ps(                                 \
                        valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m1))));              \
                    alpha[j] = m[j] == m1 ? 1.0f : m[j] == -INFINITY ? 0.0f : exp_f32(m[j] - m1); \
                    l[j] = l[j] * alpha[j] + _mm512_reduce_add_ps(e);                     \
                    m[j] = m1;                                                            \
                    _mm512_storeu_ps(p + 16 * j, e);                                      \
                }                                                                         \
                for (int64_t kh = 0; kh < h1 - h0; kh++) {                                \
                    const bf16_t *vk = v + i0 * row + kh * HD;                            \
                    const int64_t j0 = kh * groups;                                       \
                    int64_t g = 0;                                                        \
                    for (; g + GW <= groups; g += GW)                                     \
                        weighted_sum_##GW##_##HD(vk, row, nn, p + 16 * (j0 + g),          \
                                                 alpha + j0 + g, acc + (j0 + g) * HD);    \
                    for (; g < groups; g++)                                               \
                        weighted_sum_1_##HD(vk, row, nn, p + 16 * (j0 + g),               \
                                            alpha + j0 + g, acc + (j0 + g) * HD);         \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int64_t j = 0; j < heads; j++) {                                             \
            const float inv = 1.0f / l[j];                                                \
            for (int64_t d = 0; d < HD; d++) acc[j * HD + d] *= inv;                      \
        }                                                                                 \
    }
ATTEND_DPBF16(64, 3)
ATTEND_DPBF16(128, 2)
#endif

#define TYPED_HEADER "cpu_decode_typed.h"
#include "cpu_each_type.h"
#undef TYPED_HEADER
