/* Linear layers on weight-only quantized weights (int8 or int4), for steps of any size.

   Weights are held as integers q with a float32 scale s and an optional float32 offset m
   per group of `group` inputs and output column: w = q s + m. One layout serves every
   scheme the engine loads: symmetric int8 per output channel (group = K, no offsets),
   group-wise int4 with offsets (what GPTQ, AWQ and GGUF's Q4_1 store), group-wise int8
   (GGUF's Q8_0).

   Layout (cpu_quant.py's pack): output columns in blocks of 16; for each block,
   int8: q[k][16] as int8 for k < K; int4: byte[k / 2][16], the low nibble input k (even),
   the high nibble input k + 1, values 0..15. Scales and offsets: [N / 16][K / group][16].

   y[t][n] = sum over groups g of (sum_{k in g} x[t][k] q[k][n]) s[g][n]
                                + (sum_{k in g} x[t][k]) m[g][n]   (+ bias[n])
   in float32: the products of one group summed in input order, then scaled. That is the
   same sum as x . dequantized(w) up to float32 rounding (the scale applied once per
   group instead of once per weight). On AVX2, float32 rows of SCALED_MIN_ROWS or more
   against grouped weights sum x . dequantized(w) itself (each weight q s + m rounded to
   float32 as it is converted: "scaled chunks").

   AVX-512, up to four rows (a decode step of few sequences): each tile of 4, 2 or 1 rows
   converts the integers as it multiplies. More rows on AVX-512, and every step on AVX2:
   each chunk of a block's integers is converted to float32 once into L1 ("buffered"), and
   the row tiles read it there (AVX-512: 6 rows over two blocks, then 12, 8, 4, 2, 1 over
   one; AVX2, where a block is two registers: 6, 4, 2, 1). bf16 rows on AVX-512 BF16: the
   integers are converted to bf16 pairs instead and the tiles run on the dot-product
   instruction, over two blocks: for layers of up to DP_MAX_PANEL inputs all of a block's
   inputs at once, tiles of 4, 2, 1 rows running every group with its sums and the scaled
   totals in registers (dp_panel); longer layers chunk by chunk through partial sums
   (12, 8, 4, 2, 1 rows). Parallel over pairs of blocks
   with OpenMP on torch's pool. Other CPUs: plain loops.
*/
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define CB 16

/* The tiles' rows are spelled out (ROWS_R, cpu_common.h). */

/* One tile of R rows (x: float32 rows of K, row stride K) against one block of 16
   columns: acc[R][16] = the block's outputs before the bias. On AVX-512 the 16 columns
   are one register and each row's sums stay in registers (R <= 8: 2 R of 32); elsewhere
   plain loops the compiler vectorizes. */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 load_q8(const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

#define T_ZERO(r) __m512 a##r = _mm512_setzero_ps(), p##r;
#define T_PZERO(r) p##r = _mm512_setzero_ps();
#define T_STEP8(r) p##r = _mm512_fmadd_ps(_mm512_set1_ps(x[(r) * K + k]), w, p##r);
#define T_STEP4(r)                                                                          \
    p##r = _mm512_fmadd_ps(_mm512_set1_ps(x[(r) * K + k]), lo, p##r);                       \
    p##r = _mm512_fmadd_ps(_mm512_set1_ps(x[(r) * K + k + 1]), hi, p##r);
#define T_SCALE(r) a##r = _mm512_fmadd_ps(p##r, sv, a##r);
#define T_OFFSET(r) a##r = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(r) * ngroups + g]), mv, a##r);
#define T_STORE(r) _mm512_storeu_ps(acc_out[r], a##r);
#define DEFINE_TILE(R)                                                                      \
    static inline void tile_##R(const float *restrict x, int64_t K, int64_t group, int bits, \
                                const uint8_t *restrict q, const float *restrict s,          \
                                const float *restrict m, const float *restrict xsum,         \
                                int64_t ngroups, float acc_out[R][CB]) {                     \
        ROWS_##R(T_ZERO)                                                                    \
        const __m512i low = _mm512_set1_epi32(15);                                          \
        for (int64_t g = 0; g < ngroups; g++) {                                             \
            ROWS_##R(T_PZERO)                                                               \
            const int64_t k0 = g * group, k1 = k0 + group;                                  \
            if (bits == 8) {                                                                \
                for (int64_t k = k0; k < k1; k++) {                                         \
                    const __m512 w = load_q8((const int8_t *)q + k * CB);                   \
                    ROWS_##R(T_STEP8)                                                       \
                }                                                                           \
            } else {                                                                        \
                for (int64_t k = k0; k < k1; k += 2) {                                      \
                    const __m512i b = _mm512_cvtepu8_epi32(                                 \
                        _mm_loadu_si128((const __m128i *)(q + (k / 2) * CB)));              \
                    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));         \
                    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));          \
                    ROWS_##R(T_STEP4)                                                       \
                }                                                                           \
            }                                                                               \
            const __m512 sv = _mm512_loadu_ps(s + g * CB);                                  \
            ROWS_##R(T_SCALE)                                                               \
            if (m) {                                                                        \
                const __m512 mv = _mm512_loadu_ps(m + g * CB);                              \
                ROWS_##R(T_OFFSET)                                                          \
            }                                                                               \
        }                                                                                   \
        ROWS_##R(T_STORE)                                                                   \
    }
#else
#define DEFINE_TILE(R)                                                                      \
    static inline void tile_##R(const float *restrict x, int64_t K, int64_t group, int bits, \
                                const uint8_t *restrict q, const float *restrict s,          \
                                const float *restrict m, const float *restrict xsum,         \
                                int64_t ngroups, float acc[R][CB]) {                         \
        for (int r = 0; r < R; r++)                                                         \
            for (int c = 0; c < CB; c++) acc[r][c] = 0.0f;                                  \
        for (int64_t g = 0; g < ngroups; g++) {                                             \
            float part[R][CB];                                                              \
            for (int r = 0; r < R; r++)                                                     \
                for (int c = 0; c < CB; c++) part[r][c] = 0.0f;                             \
            for (int64_t k = g * group; k < (g + 1) * group; k++) {                         \
                float w[CB];                                                                \
                for (int c = 0; c < CB; c++)                                                \
                    w[c] = bits == 8 ? (float)((const int8_t *)q)[k * CB + c]               \
                           : (float)((k & 1) ? q[(k / 2) * CB + c] >> 4                     \
                                             : q[(k / 2) * CB + c] & 15);                   \
                for (int r = 0; r < R; r++) {                                               \
                    const float xv = x[r * K + k];                                          \
                    for (int c = 0; c < CB; c++) part[r][c] += xv * w[c];                   \
                }                                                                           \
            }                                                                               \
            for (int r = 0; r < R; r++)                                                     \
                for (int c = 0; c < CB; c++) acc[r][c] += part[r][c] * s[g * CB + c];       \
            if (m)                                                                          \
                for (int r = 0; r < R; r++)                                                 \
                    for (int c = 0; c < CB; c++)                                            \
                        acc[r][c] += xsum[r * ngroups + g] * m[g * CB + c];                 \
        }                                                                                   \
    }
#endif

DEFINE_TILE(8)
DEFINE_TILE(4)
DEFINE_TILE(2)
DEFINE_TILE(1)

/* Stores a tile's rows (plus the bias) into y: float32 or bf16 rows of stride ldy. */
static inline void store_rows(const float *acc, int rows, int64_t col, const float *bias,
                              void *y, int64_t ldy, int out_bf16) {
    for (int r = 0; r < rows; r++) {
        const float *a = acc + r * CB;
        float v[CB];
        for (int c = 0; c < CB; c++) v[c] = a[c] + (bias ? bias[col + c] : 0.0f);
        if (out_bf16) {
            bf16_t *dst = (bf16_t *)y + r * ldy + col;
            for (int c = 0; c < CB; c++) dst[c] = st_bf16(v[c]);
        } else {
            float *dst = (float *)y + r * ldy + col;
            for (int c = 0; c < CB; c++) dst[c] = v[c];
        }
    }
}

#define RUN_TILE(R)                                                                         \
    do {                                                                                    \
        float acc[R][CB];                                                                   \
        tile_##R(xf + t * K, K, group, bits, wb, sb, mb, xsum ? xsum + t * ngroups : 0,     \
                 ngroups, acc);                                                             \
        store_rows(&acc[0][0], R, blk * CB, bias, (char *)y + t * ldy * esz, ldy,           \
                   out_bf16);                                                               \
        t += R;                                                                             \
    } while (0)

/* Buffered steps: each chunk of a block's integers is converted to float32 once (wf, in
   L1) and every row tile reads it from there, so the conversion is paid once per weight
   instead of once per weight and tile; the partial sums of a group and the outputs wait
   in per-thread buffers of T x 16 floats between chunks. Each instruction set gives
   convert_chunk (the integers of inputs [k0, k0 + n) of one block as float32 rows of 16)
   and chunk_tiles (part[b][t][16] (+)= x[t][k0 .. k0 + n) . wf[b] for every row t of the
   step and each of the nb blocks). */
#if defined(__AVX512F__)
#define HAVE_BUFFERED 1
#define BUFFERED_MIN_ROWS 5

static inline void convert_chunk(const uint8_t *wb, int bits, int64_t k0, int64_t n,
                                 float *restrict wf) {
    if (bits == 8) {
        for (int64_t k = 0; k < n; k++)
            _mm512_store_ps(wf + k * CB, load_q8((const int8_t *)wb + (k0 + k) * CB));
        return;
    }
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t k = 0; k < n; k += 2) {
        const __m512i b = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(wb + ((k0 + k) / 2) * CB)));
        _mm512_store_ps(wf + k * CB, _mm512_cvtepi32_ps(_mm512_and_si512(b, low)));
        _mm512_store_ps(wf + (k + 1) * CB, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
    }
}

/* part[R][16] (+)= x[r][k0 .. k0 + n) . wf[0 .. n) for R rows of x (row stride K). */
#define BT_LOAD(r) __m512 p##r = first ? _mm512_setzero_ps() : _mm512_load_ps(part + (r) * CB);
#define BT_STEP(r) p##r = _mm512_fmadd_ps(_mm512_set1_ps(x[(r) * K + k]), w, p##r);
#define BT_STORE(r) _mm512_store_ps(part + (r) * CB, p##r);
#define DEFINE_BUFFERED_TILE(R)                                                             \
    static inline void btile_##R(const float *restrict x, int64_t K, int64_t k0, int64_t n, \
                                 const float *restrict wf, float *restrict part, int first) { \
        ROWS_##R(BT_LOAD)                                                                   \
        for (int64_t k = k0; k < k0 + n; k++) {                                             \
            const __m512 w = _mm512_load_ps(wf + (k - k0) * CB);                            \
            ROWS_##R(BT_STEP)                                                               \
        }                                                                                   \
        ROWS_##R(BT_STORE)                                                                  \
    }
DEFINE_BUFFERED_TILE(12)
DEFINE_BUFFERED_TILE(8)
DEFINE_BUFFERED_TILE(4)
DEFINE_BUFFERED_TILE(2)
DEFINE_BUFFERED_TILE(1)

/* Two blocks side by side for 6 rows: each x value broadcast once for 32 columns, so a
   step of 12 products reads 8 values instead of 13 (the loads, not the products, bound
   the single-block tile). */
#define PT_LOAD(r)                                                                          \
    __m512 p##r = first ? _mm512_setzero_ps() : _mm512_load_ps(part0 + (r) * CB);          \
    __m512 q##r = first ? _mm512_setzero_ps() : _mm512_load_ps(part1 + (r) * CB);
#define PT_STEP(r)                                                                          \
    {                                                                                       \
        const __m512 xv = _mm512_set1_ps(x[(r) * K + k]);                                   \
        p##r = _mm512_fmadd_ps(xv, w0, p##r);                                               \
        q##r = _mm512_fmadd_ps(xv, w1, q##r);                                               \
    }
#define PT_STORE(r)                                                                         \
    _mm512_store_ps(part0 + (r) * CB, p##r);                                                \
    _mm512_store_ps(part1 + (r) * CB, q##r);
static inline void pair_tile_6(const float *restrict x, int64_t K, int64_t k0, int64_t n,
                               const float *restrict wf0, const float *restrict wf1,
                               float *restrict part0, float *restrict part1, int first) {
    ROWS_6(PT_LOAD)
    for (int64_t k = k0; k < k0 + n; k++) {
        const __m512 w0 = _mm512_load_ps(wf0 + (k - k0) * CB);
        const __m512 w1 = _mm512_load_ps(wf1 + (k - k0) * CB);
        ROWS_6(PT_STEP)
    }
    ROWS_6(PT_STORE)
}

/* The single-block tiles over rows [t, T) of one block. */
static inline void single_tiles(const float *xf, int64_t T, int64_t t, int64_t K, int64_t k0,
                                int64_t chunk, const float *wf, float *part, int first) {
    for (; T - t >= 12; t += 12) btile_12(xf + t * K, K, k0, chunk, wf, part + t * CB, first);
    for (; T - t >= 8; t += 8) btile_8(xf + t * K, K, k0, chunk, wf, part + t * CB, first);
    if (T - t >= 4) { btile_4(xf + t * K, K, k0, chunk, wf, part + t * CB, first); t += 4; }
    if (T - t >= 2) { btile_2(xf + t * K, K, k0, chunk, wf, part + t * CB, first); t += 2; }
    if (T - t >= 1) btile_1(xf + t * K, K, k0, chunk, wf, part + t * CB, first);
}

static inline void chunk_tiles(const float *xf, int64_t T, int64_t K, int64_t k0,
                               int64_t chunk, const float *wf, int64_t nb, float *part,
                               int first) {
    int64_t t = 0;
    if (nb == 2)
        for (; T - t >= 6; t += 6)
            pair_tile_6(xf + t * K, K, k0, chunk, wf, wf + chunk * CB, part + t * CB,
                        part + (T + t) * CB, first);
    for (int64_t b = 0; b < nb; b++)
        single_tiles(xf, T, t, K, k0, chunk, wf + b * chunk * CB, part + b * T * CB, first);
}

#if defined(__AVX512BF16__)
/* bf16 steps on the dot-product instruction (`vdpbf16ps`, AVX-512 BF16): a chunk's
   integers become bf16, exactly (int8 and int4 values have at most 8 significant bits), in
   pairs of inputs, each vector the 16 columns' pairs of inputs (2i, 2i + 1) (cpu_gemm.c's
   layout), and each row's bf16 pair is broadcast against them: the products are exact and
   summed in float32 as on the float32 path, two to an instruction lane instead of one, and
   the rows are read as bf16 with no float32 copy. */
#define HAVE_DP_CHUNKS 1
#define DP_MAX_PANEL 4096

/* 16 lanes of (even, odd) as bf16 pairs: even's bits in the low half, odd's in the high. */
static inline __attribute__((always_inline)) __m512i pairs16(__m512 even, __m512 odd) {
    return _mm512_or_si512(
        _mm512_srli_epi32(_mm512_castps_si512(even), 16),
        _mm512_and_si512(_mm512_castps_si512(odd), _mm512_set1_epi32((int)0xffff0000u)));
}

static inline void convert_chunk_pairs(const uint8_t *wb, int bits, int64_t k0, int64_t n,
                                       bf16_t *restrict wp) {
    if (bits == 8) {
        for (int64_t k = 0; k < n; k += 2)
            _mm512_store_si512(wp + k * CB,
                               pairs16(load_q8((const int8_t *)wb + (k0 + k) * CB),
                                       load_q8((const int8_t *)wb + (k0 + k + 1) * CB)));
        return;
    }
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t k = 0; k < n; k += 2) {
        const __m512i b = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(wb + ((k0 + k) / 2) * CB)));
        _mm512_store_si512(wp + k * CB,
                           pairs16(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)),
                                   _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))));
    }
}

/* sum[r][b] = rows r of xr (stride ldx) . block b's pairs (blocks bstride values apart in
   wp), over input pairs [i0, i1): each block's pair vector loaded once for R rows, each
   row's pair broadcast once for NB blocks. R and NB are constants at every call. */
static inline __attribute__((always_inline)) void dp_sums(
    __m512 sum[][2], const bf16_t *xr, int64_t ldx, const int R, const int NB,
    const bf16_t *wp, int64_t bstride, int64_t i0, int64_t i1) {
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) sum[r][b] = _mm512_setzero_ps();
    for (int64_t i = i0; i < i1; i++) {
        __m512bh w[2];
        for (int b = 0; b < NB; b++)
            w[b] = (__m512bh)_mm512_load_si512(wp + b * bstride + i * 32);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, xr + r * ldx + 2 * i, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < NB; b++) sum[r][b] = _mm512_dpbf16_ps(sum[r][b], a, w[b]);
        }
    }
}

/* part[b][t + r][16] (+)= x[t + r][k0 .. k0 + n) . the chunk of block b, for R rows and NB
   blocks (constants at every call: R x NB sums in registers, at most 12 x 2). */
static inline __attribute__((always_inline)) void dp_tile(
    const bf16_t *x, int64_t ldx, int64_t t, const int R, const int NB, int64_t k0,
    int64_t n, const bf16_t *wp, float *part, int64_t T, int first) {
    __m512 acc[12][2];
    dp_sums(acc, x + t * ldx + k0, ldx, R, NB, wp, n * CB, 0, n / 2);
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < R; r++) {
            float *dst = part + (b * T + t + r) * CB;
            _mm512_store_ps(dst, first ? acc[r][b]
                                       : _mm512_add_ps(acc[r][b], _mm512_load_ps(dst)));
        }
}

#define DP_TILES(NB)                                                                        \
    do {                                                                                    \
        int64_t t = 0;                                                                      \
        for (; T - t >= 12; t += 12) dp_tile(x, ldx, t, 12, NB, k0, n, wp, part, T, first); \
        if (T - t >= 8) { dp_tile(x, ldx, t, 8, NB, k0, n, wp, part, T, first); t += 8; }   \
        if (T - t >= 4) { dp_tile(x, ldx, t, 4, NB, k0, n, wp, part, T, first); t += 4; }   \
        if (T - t >= 2) { dp_tile(x, ldx, t, 2, NB, k0, n, wp, part, T, first); t += 2; }   \
        if (T - t >= 1) dp_tile(x, ldx, t, 1, NB, k0, n, wp, part, T, first);              \
    } while (0)

/* chunk_tiles for bf16 rows x (row stride ldx) and a chunk converted by
   convert_chunk_pairs (block b's at wp + b n 16). */
static inline void chunk_tiles_dp(const bf16_t *x, int64_t ldx, int64_t T, int64_t k0,
                                  int64_t n, const bf16_t *wp, int64_t nb, float *part,
                                  int first) {
    if (nb == 2)
        DP_TILES(2);
    else
        DP_TILES(1);
}

/* Inputs [k0, k0 + n) of blocks [blk0, blk0 + nb): converted into wp (the bf16 pairs take
   half of the float32 buffer), the same inputs of the next two blocks (the thread's next
   unit, under a static schedule) fetched meanwhile, then every row's tiles. */
static inline void dp_chunk(const bf16_t *x, int64_t ldx, int64_t T, const void *w, int bits,
                            int64_t block_bytes, int64_t blk0, int64_t nb, int64_t nblocks,
                            int64_t k0, int64_t n, bf16_t *wp, float *part, int first) {
    const int64_t chunk_bytes = n * CB * bits / 8, at = k0 * CB * bits / 8;
    for (int64_t b = blk0 + 2; b < blk0 + 4 && b < nblocks; b++)
        for (int64_t o = 0; o < chunk_bytes; o += 64)
            _mm_prefetch((const char *)w + b * block_bytes + at + o, _MM_HINT_T0);
    for (int64_t b = 0; b < nb; b++)
        convert_chunk_pairs((const uint8_t *)w + (blk0 + b) * block_bytes, bits, k0, n,
                            wp + b * n * CB);
    chunk_tiles_dp(x, ldx, T, k0, n, wp, nb, part, first);
}

/* The whole of a layer's inputs at once, where K <= DP_MAX_PANEL: a unit's two blocks
   converted once (wp: block b's K inputs at wp + b K 16, in L2), then each tile of R rows
   runs every group with the group's sums in registers and scales them into totals also in
   registers (tot += sum s, + the rows' sums of the group times m), stored once into
   acc[b][t + r]: no partial sums through memory, one pass for all groups. */
static inline __attribute__((always_inline)) void dp_panel_tile(
    const bf16_t *x, int64_t ldx, int64_t t, const int R, const int NB, int64_t K,
    int64_t group, const bf16_t *wp, const float *const sb[2], const float *const mb[2],
    const float *xsum, float *acc, int64_t T) {
    const int64_t ngroups = K / group;
    __m512 tot[4][2], sum[4][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) tot[r][b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        dp_sums(sum, x + t * ldx, ldx, R, NB, wp, K * CB, g * group / 2, (g + 1) * group / 2);
        for (int b = 0; b < NB; b++) {
            const __m512 sv = _mm512_loadu_ps(sb[b] + g * CB);
            for (int r = 0; r < R; r++) tot[r][b] = _mm512_fmadd_ps(sum[r][b], sv, tot[r][b]);
            if (mb[b] != NULL) {
                const __m512 mv = _mm512_loadu_ps(mb[b] + g * CB);
                for (int r = 0; r < R; r++)
                    tot[r][b] = _mm512_fmadd_ps(
                        _mm512_set1_ps(xsum[(t + r) * ngroups + g]), mv, tot[r][b]);
            }
        }
    }
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < R; r++) _mm512_store_ps(acc + (b * T + t + r) * CB, tot[r][b]);
}

#define DP_PANEL(NB)                                                                        \
    do {                                                                                    \
        int64_t t = 0;                                                                      \
        for (; T - t >= 4; t += 4)                                                          \
            dp_panel_tile(x, ldx, t, 4, NB, K, group, wp, sb, mb, xsum, acc, T);            \
        if (T - t >= 2) {                                                                   \
            dp_panel_tile(x, ldx, t, 2, NB, K, group, wp, sb, mb, xsum, acc, T);            \
            t += 2;                                                                         \
        }                                                                                   \
        if (T - t >= 1) dp_panel_tile(x, ldx, t, 1, NB, K, group, wp, sb, mb, xsum, acc, T); \
    } while (0)

/* Blocks [blk0, blk0 + nb) over all rows, into acc [nb][T][16] (see dp_panel_tile); the
   next unit's integers fetched while these are converted. */
static inline void dp_panel(const bf16_t *x, int64_t ldx, const float *xsum, int64_t T,
                            int64_t K, const void *w, int bits, int64_t group, const float *s,
                            const float *m, int64_t block_bytes, int64_t blk0, int64_t nb,
                            int64_t nblocks, bf16_t *wp, float *acc) {
    const int64_t ngroups = K / group;
    for (int64_t b = blk0 + 2; b < blk0 + 4 && b < nblocks; b++)
        for (int64_t o = 0; o < block_bytes; o += 64)
            _mm_prefetch((const char *)w + b * block_bytes + o, _MM_HINT_T1);
    const float *sb[2] = {0, 0}, *mb[2] = {0, 0};
    for (int64_t b = 0; b < nb; b++) {
        convert_chunk_pairs((const uint8_t *)w + (blk0 + b) * block_bytes, bits, 0, K,
                            wp + b * K * CB);
        sb[b] = s + (blk0 + b) * ngroups * CB;
        mb[b] = m ? m + (blk0 + b) * ngroups * CB : 0;
    }
    if (nb == 2)
        DP_PANEL(2);
    else
        DP_PANEL(1);
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: a block's 16 columns are two registers, so a row tile of R rows holds 2 R sums
   (R <= 6 of 16 registers). Every step runs buffered, one path for all sizes: on an AMD
   EPYC (Zen) with AVX2 it runs SmolLM2's layers at 0.65-0.75x oneDNN float32's time for
   1-4 rows, and at 32 rows int8 at its time, int4 at 1.13x (`loraplex bench
   quant-kernels`). */
#define HAVE_BUFFERED 1
#define BUFFERED_MIN_ROWS 1

static inline void convert_chunk(const uint8_t *wb, int bits, int64_t k0, int64_t n,
                                 float *restrict wf) {
    if (bits == 8) {
        for (int64_t k = 0; k < n; k++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(wb + (k0 + k) * CB));
            _mm256_store_ps(wf + k * CB, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
            _mm256_store_ps(wf + k * CB + 8,
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
        }
        return;
    }
    const __m256i low = _mm256_set1_epi32(15);
    for (int64_t k = 0; k < n; k += 2) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(wb + ((k0 + k) / 2) * CB));
        const __m256i u0 = _mm256_cvtepu8_epi32(b);
        const __m256i u1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
        float *r0 = wf + k * CB, *r1 = r0 + CB;
        _mm256_store_ps(r0, _mm256_cvtepi32_ps(_mm256_and_si256(u0, low)));
        _mm256_store_ps(r0 + 8, _mm256_cvtepi32_ps(_mm256_and_si256(u1, low)));
        _mm256_store_ps(r1, _mm256_cvtepi32_ps(_mm256_srli_epi32(u0, 4)));
        _mm256_store_ps(r1 + 8, _mm256_cvtepi32_ps(_mm256_srli_epi32(u1, 4)));
    }
}

#define BT_LOAD(r)                                                                          \
    __m256 p##r = first ? _mm256_setzero_ps() : _mm256_load_ps(part + (r) * CB);           \
    __m256 q##r = first ? _mm256_setzero_ps() : _mm256_load_ps(part + (r) * CB + 8);
#define BT_STEP(r)                                                                          \
    {                                                                                       \
        const __m256 xv = _mm256_broadcast_ss(x + (r) * K + k);                             \
        p##r = _mm256_fmadd_ps(xv, w0, p##r);                                               \
        q##r = _mm256_fmadd_ps(xv, w1, q##r);                                               \
    }
#define BT_STORE(r)                                                                         \
    _mm256_store_ps(part + (r) * CB, p##r);                                                 \
    _mm256_store_ps(part + (r) * CB + 8, q##r);
#define DEFINE_BUFFERED_TILE(R)                                                             \
    static inline void btile_##R(const float *restrict x, int64_t K, int64_t k0, int64_t n, \
                                 const float *restrict wf, float *restrict part, int first) { \
        ROWS_##R(BT_LOAD)                                                                   \
        for (int64_t k = k0; k < k0 + n; k++) {                                             \
            const __m256 w0 = _mm256_load_ps(wf + (k - k0) * CB);                           \
            const __m256 w1 = _mm256_load_ps(wf + (k - k0) * CB + 8);                       \
            ROWS_##R(BT_STEP)                                                               \
        }                                                                                   \
        ROWS_##R(BT_STORE)                                                                  \
    }
DEFINE_BUFFERED_TILE(6)
DEFINE_BUFFERED_TILE(4)
DEFINE_BUFFERED_TILE(2)
DEFINE_BUFFERED_TILE(1)

static inline void chunk_tiles(const float *xf, int64_t T, int64_t K, int64_t k0,
                               int64_t chunk, const float *wf, int64_t nb, float *part,
                               int first) {
    for (int64_t b = 0; b < nb; b++) {
        const float *w = wf + b * chunk * CB;
        float *pb = part + b * T * CB;
        int64_t t = 0;
        for (; T - t >= 6; t += 6) btile_6(xf + t * K, K, k0, chunk, w, pb + t * CB, first);
        if (T - t >= 4) { btile_4(xf + t * K, K, k0, chunk, w, pb + t * CB, first); t += 4; }
        if (T - t >= 2) { btile_2(xf + t * K, K, k0, chunk, w, pb + t * CB, first); t += 2; }
        if (T - t >= 1) btile_1(xf + t * K, K, k0, chunk, w, pb + t * CB, first);
    }
}

/* A whole group in one chunk (groups of up to 128 inputs): each tile scales its sums into
   the outputs as it finishes (acc[r] += sum s, and + xsum[r] m with offsets) instead of
   storing them for a separate pass (SmolLM2's int4 layers at 32 rows on an AVX2 EPYC:
   from 1.21x oneDNN float32's time to 1.13x). */
#define FUSED_GROUPS 1
#define BS_ZERO(r) __m256 p##r = _mm256_setzero_ps(), q##r = _mm256_setzero_ps();
#define BS_FINISH(r)                                                                        \
    {                                                                                       \
        __m256 a0 = _mm256_load_ps(acc + (r) * CB), a1 = _mm256_load_ps(acc + (r) * CB + 8); \
        a0 = _mm256_fmadd_ps(p##r, s0, a0);                                                 \
        a1 = _mm256_fmadd_ps(q##r, s1, a1);                                                 \
        if (m) {                                                                            \
            const __m256 xs = _mm256_broadcast_ss(xsum + (r) * ngroups);                    \
            a0 = _mm256_fmadd_ps(xs, _mm256_loadu_ps(m), a0);                               \
            a1 = _mm256_fmadd_ps(xs, _mm256_loadu_ps(m + 8), a1);                           \
        }                                                                                   \
        _mm256_store_ps(acc + (r) * CB, a0);                                                \
        _mm256_store_ps(acc + (r) * CB + 8, a1);                                            \
    }
#define DEFINE_SCALED_TILE(R)                                                               \
    static inline void stile_##R(const float *restrict x, int64_t K, int64_t k0, int64_t n, \
                                 const float *restrict wf, float *restrict acc,             \
                                 const float *restrict s, const float *restrict m,          \
                                 const float *restrict xsum, int64_t ngroups) {             \
        ROWS_##R(BS_ZERO)                                                                   \
        for (int64_t k = k0; k < k0 + n; k++) {                                             \
            const __m256 w0 = _mm256_load_ps(wf + (k - k0) * CB);                           \
            const __m256 w1 = _mm256_load_ps(wf + (k - k0) * CB + 8);                       \
            ROWS_##R(BT_STEP)                                                               \
        }                                                                                   \
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);                  \
        ROWS_##R(BS_FINISH)                                                                 \
    }
DEFINE_SCALED_TILE(6)
DEFINE_SCALED_TILE(4)
DEFINE_SCALED_TILE(2)
DEFINE_SCALED_TILE(1)

/* Float32 rows ("scaled chunks"): a chunk of up to 128 inputs of a block converted to the
   weights themselves, q s + m with each input's group's scale and offset (one multiply-add
   a weight, shared by every row), then every row's tiles add the chunk's products into
   the outputs, a chunk of several groups at a time: no group's sums are scaled per row
   tile. SmolLM2's 120 int4 layers (groups of 32) on an AVX2 EPYC (Zen 3), the kernel
   alone: 47.1 ms at 32 rows and 87.0 at 64 against 57.4 and 107.3 with the fused groups
   below; from 12 rows on (at 8 rows 18.3 against 17.8 ms, and fewer lose more: the
   multiply-add per weight is not shared by enough rows). Grouped int8 the same way; per
   channel, scaled once per output, it gains nothing and keeps its path. */
#define SCALED_CHUNKS 1
#ifndef SCALED_MIN_ROWS /* (a build for comparisons may set it) */
#define SCALED_MIN_ROWS 12
#endif
static inline void convert_scaled_chunk(const uint8_t *wb, int bits, int64_t k0, int64_t n,
                                        int64_t group, const float *sb, const float *mb,
                                        float *restrict wf) {
    for (int64_t g0 = k0; g0 < k0 + n;) {
        const int64_t g = g0 / group, g1 = (g + 1) * group < k0 + n ? (g + 1) * group : k0 + n;
        const __m256 s0 = _mm256_loadu_ps(sb + g * CB), s1 = _mm256_loadu_ps(sb + g * CB + 8);
        const __m256 m0 = mb ? _mm256_loadu_ps(mb + g * CB) : _mm256_setzero_ps();
        const __m256 m1 = mb ? _mm256_loadu_ps(mb + g * CB + 8) : _mm256_setzero_ps();
        float *dst = wf + (g0 - k0) * CB;
        if (bits == 8) {
            for (int64_t k = g0; k < g1; k++, dst += CB) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(wb + k * CB));
                const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
                _mm256_store_ps(dst, _mm256_fmadd_ps(q0, s0, m0));
                _mm256_store_ps(dst + 8, _mm256_fmadd_ps(q1, s1, m1));
            }
        } else {
            const __m256i low = _mm256_set1_epi32(15);
            for (int64_t k = g0; k < g1; k += 2, dst += 2 * CB) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(wb + (k / 2) * CB));
                const __m256i u0 = _mm256_cvtepu8_epi32(b);
                const __m256i u1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
                const __m256 e0 = _mm256_cvtepi32_ps(_mm256_and_si256(u0, low));
                const __m256 e1 = _mm256_cvtepi32_ps(_mm256_and_si256(u1, low));
                const __m256 o0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(u0, 4));
                const __m256 o1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(u1, 4));
                _mm256_store_ps(dst, _mm256_fmadd_ps(e0, s0, m0));
                _mm256_store_ps(dst + 8, _mm256_fmadd_ps(e1, s1, m1));
                _mm256_store_ps(dst + CB, _mm256_fmadd_ps(o0, s0, m0));
                _mm256_store_ps(dst + CB + 8, _mm256_fmadd_ps(o1, s1, m1));
            }
        }
        g0 = g1;
    }
}

/* One group (inputs [k0, k0 + n)) of every row into acc[b][t][16] for the nb blocks;
   s[b], m[b]: the block's scales and offsets of this group; xsum: the rows' sums of it
   (row stride ngroups). */
static inline void group_tiles(const float *xf, int64_t T, int64_t K, int64_t k0, int64_t n,
                               const float *wf, int64_t nb, float *acc,
                               const float *const s[2], const float *const m[2],
                               const float *xsum, int64_t ngroups) {
    for (int64_t b = 0; b < nb; b++) {
        const float *w = wf + b * n * CB;
        float *ab = acc + b * T * CB;
        int64_t t = 0;
#define ST_ARGS(t) xf + (t) * K, K, k0, n, w, ab + (t) * CB, s[b], m[b],                    \
                   xsum ? xsum + (t) * ngroups : 0, ngroups
        for (; T - t >= 6; t += 6) stile_6(ST_ARGS(t));
        if (T - t >= 4) { stile_4(ST_ARGS(t)); t += 4; }
        if (T - t >= 2) { stile_2(ST_ARGS(t)); t += 2; }
        if (T - t >= 1) stile_1(ST_ARGS(t));
#undef ST_ARGS
    }
}
#endif

#if defined(HAVE_BUFFERED)
/* Inputs converted at a time: the group, or for groups of more than 128 inputs (int8 per
   channel) the largest power of two up to 128 that divides it. */
static int64_t chunk_for(int64_t group) {
    if (group <= 128) return group;
    for (int64_t c = 128; c > 2; c /= 2)
        if (group % c == 0) return c;
    return 2;
}

/* Scaled chunks: as many whole groups as fit 128 inputs and divide K (SmolLM2's 576
   inputs in groups of 32: 96), else chunk_for's. */
static int64_t scaled_chunk_for(int64_t K, int64_t group) {
    if (group < 128)
        for (int64_t c = 128 / group * group; c > group; c -= group)
            if (K % c == 0) return c;
    return chunk_for(group);
}

/* xb: the rows as bf16 (row stride ldx) for the dot-product tiles, or NULL: xf's float32
   rows (row stride K) on the float32 tiles. */
static int buffered_linear(const float *xf, const bf16_t *xb, int64_t ldx, const float *xsum,
                           int64_t T, int64_t K, const void *w, int bits, int64_t group,
                           const float *s, const float *m, int64_t N, const float *bias,
                           void *y, int64_t ldy, int out_bf16, int64_t nthreads) {
    const int64_t ngroups = K / group, nblocks = N / CB, chunk = chunk_for(group);
    /* bf16 rows on the dot-product tiles: a layer's whole inputs at once up to
       DP_MAX_PANEL (its bf16 pairs, two blocks' worth, in L2), else chunk by chunk. */
    int panel = 0;
#if defined(HAVE_DP_CHUNKS)
    panel = xb != NULL && K <= DP_MAX_PANEL;
#else
    (void)xb, (void)ldx;
#endif
    int64_t scaled = 0; /* the scaled chunks' length, where they run */
#if defined(SCALED_CHUNKS)
    if (xb == NULL && group < K && T >= SCALED_MIN_ROWS) scaled = scaled_chunk_for(K, group);
#endif
    const int64_t buffer = panel ? K * CB : 2 * (scaled > chunk ? scaled : chunk) * CB;
    const int64_t block_bytes = bits == 8 ? K * CB : (K / 2) * CB;
    int failed = 0;
    /* Units of two blocks (the last of an odd count alone). */
    const int64_t nunits = (nblocks + 1) / 2;
#pragma omp parallel num_threads(nthreads)
    {
        float *wf = aligned_alloc(64, sizeof(float) * (size_t)buffer);
        float *part = aligned_alloc(64, sizeof(float) * (size_t)(2 * T * CB));
        float *acc = aligned_alloc(64, sizeof(float) * (size_t)(2 * T * CB));
        if (!wf || !part || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t u = 0; u < nunits; u++) {
                const int64_t blk0 = 2 * u, nb = blk0 + 1 < nblocks ? 2 : 1;
#if defined(HAVE_DP_CHUNKS)
                if (panel) {
                    dp_panel(xb, ldx, xsum, T, K, w, bits, group, s, m, block_bytes, blk0, nb,
                             nblocks, (bf16_t *)wf, acc);
                    for (int64_t b = 0; b < nb; b++)
                        store_rows(acc + b * T * CB, (int)T, (blk0 + b) * CB, bias, y, ldy,
                                   out_bf16);
                    continue;
                }
#endif
                memset(acc, 0, sizeof(float) * (size_t)(nb * T * CB));
#if defined(SCALED_CHUNKS)
                if (scaled) {
                    for (int64_t k0 = 0; k0 < K; k0 += scaled) {
                        for (int64_t b = 0; b < nb; b++) {
                            const int64_t blk = blk0 + b;
                            convert_scaled_chunk((const uint8_t *)w + blk * block_bytes, bits,
                                                 k0, scaled, group, s + blk * ngroups * CB,
                                                 m ? m + blk * ngroups * CB : 0,
                                                 wf + b * scaled * CB);
                        }
                        chunk_tiles(xf, T, K, k0, scaled, wf, nb, acc, 0);
                    }
                    for (int64_t b = 0; b < nb; b++)
                        store_rows(acc + b * T * CB, (int)T, (blk0 + b) * CB, bias, y, ldy,
                                   out_bf16);
                    continue;
                }
#endif
                for (int64_t g = 0; g < ngroups; g++) {
#if defined(FUSED_GROUPS)
                    if (chunk == group && xb == NULL) {
                        const float *sg[2] = {0, 0}, *mg[2] = {0, 0};
                        for (int64_t b = 0; b < nb; b++) {
                            convert_chunk((const uint8_t *)w + (blk0 + b) * block_bytes, bits,
                                          g * group, chunk, wf + b * chunk * CB);
                            sg[b] = s + ((blk0 + b) * ngroups + g) * CB;
                            mg[b] = m ? m + ((blk0 + b) * ngroups + g) * CB : 0;
                        }
                        group_tiles(xf, T, K, g * group, chunk, wf, nb, acc, sg, mg,
                                    xsum ? xsum + g : 0, ngroups);
                        continue;
                    }
#endif
                    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += chunk) {
#if defined(HAVE_DP_CHUNKS)
                        if (xb != NULL) {
                            dp_chunk(xb, ldx, T, w, bits, block_bytes, blk0, nb, nblocks, k0,
                                     chunk, (bf16_t *)wf, part, k0 == g * group);
                            continue;
                        }
#endif
                        for (int64_t b = 0; b < nb; b++)
                            convert_chunk((const uint8_t *)w + (blk0 + b) * block_bytes, bits,
                                          k0, chunk, wf + b * chunk * CB);
                        chunk_tiles(xf, T, K, k0, chunk, wf, nb, part, k0 == g * group);
                    }
                    /* The group's sums scaled (and its offsets times the rows' sums). */
                    for (int64_t b = 0; b < nb; b++) {
                        const int64_t gi = (blk0 + b) * ngroups + g;
                        const float *sv = s + gi * CB, *mv = m ? m + gi * CB : 0;
                        float *ab = acc + b * T * CB;
                        const float *pb = part + b * T * CB;
                        for (int64_t t = 0; t < T; t++) {
                            float *a = ab + t * CB;
                            const float *p = pb + t * CB;
                            for (int c = 0; c < CB; c++) a[c] += p[c] * sv[c];
                            if (mv) {
                                const float xs = xsum[t * ngroups + g];
                                for (int c = 0; c < CB; c++) a[c] += xs * mv[c];
                            }
                        }
                    }
                }
                for (int64_t b = 0; b < nb; b++)
                    store_rows(acc + b * T * CB, (int)T, (blk0 + b) * CB, bias, y, ldy, out_bf16);
            }
        }
        free(wf);
        free(part);
        free(acc);
    }
    return failed;
}
#endif

/* y [T, N] = x [T, K] . W^T (+ bias), W quantized as above.
   x: float32 (in_bf16 0) or bf16 (1) rows of stride ldx; y: float32 or bf16 (out_bf16),
   rows of stride ldy. bits 8 or 4; K a multiple of group, group even for int4; N a
   multiple of 16. bias: float32 [N] or NULL; m: NULL where the scheme has no offsets.
   Returns 0, or 1 when the shapes are refused or scratch memory cannot be had. */
int quant_linear(const void *x, int64_t ldx, int in_bf16, int64_t T, int64_t K,
                 const void *w, int bits, int64_t group, const float *s, const float *m,
                 int64_t N, const float *bias, void *y, int64_t ldy, int out_bf16,
                 int64_t nthreads) {
    if (T <= 0 || K <= 0 || N <= 0 || N % CB || group <= 0 || K % group ||
        (bits != 8 && bits != 4) || group % 2)
        return 1;
    const int64_t ngroups = K / group;
    /* The rows in float32, contiguous, and where there are offsets each row's sum per group. */
    float *xf = malloc(sizeof(float) * (size_t)(T * K + (m ? T * ngroups : 0)));
    if (!xf) return 1;
    float *xsum = m ? xf + T * K : 0;
    for (int64_t t = 0; t < T; t++) {
        float *dst = xf + t * K;
        if (in_bf16) {
            const bf16_t *src = (const bf16_t *)x + t * ldx;
            for (int64_t k = 0; k < K; k++) dst[k] = ld_bf16(src[k]);
        } else {
            memcpy(dst, (const float *)x + t * ldx, sizeof(float) * (size_t)K);
        }
        if (xsum)
            for (int64_t g = 0; g < ngroups; g++) {
                float acc = 0.0f;
                for (int64_t k = g * group; k < (g + 1) * group; k++) acc += dst[k];
                xsum[t * ngroups + g] = acc;
            }
    }
#if defined(HAVE_BUFFERED)
    /* From BUFFERED_MIN_ROWS rows: bf16 rows on the dot-product tiles where the CPU has
       them (AVX-512 BF16: 32 rows of SmolLM2's layers 2x faster than the float32 tiles on a
       Zen 4), else in float32. Fewer rows convert as they multiply (below: at one row int4
       ran 1.5x faster so than buffered). */
    const bf16_t *xb = NULL;
#if defined(HAVE_DP_CHUNKS)
    if (in_bf16) xb = (const bf16_t *)x;
#endif
    if (T >= BUFFERED_MIN_ROWS) {
        const int failed = buffered_linear(xf, xb, ldx, xsum, T, K, w, bits, group, s, m, N,
                                           bias, y, ldy, out_bf16, nthreads);
        free(xf);
        return failed;
    }
#endif
    const int64_t nblocks = N / CB;
    const int64_t block_bytes = bits == 8 ? K * CB : (K / 2) * CB;
    const int64_t esz = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const uint8_t *wb = (const uint8_t *)w + blk * block_bytes;
        const float *sb = s + blk * ngroups * CB;
        const float *mb = m ? m + blk * ngroups * CB : 0;
        int64_t t = 0;
        while (T - t >= 8) RUN_TILE(8);
        if (T - t >= 4) RUN_TILE(4);
        if (T - t >= 2) RUN_TILE(2);
        if (T - t >= 1) RUN_TILE(1);
    }
    free(xf);
    return 0;
}

/* The dequantized weights, transposed: out[k][n] = q s + m as float32 [K, N] row-major
   (x . W^T is then a plain matmul x . out, for the steps of many rows, and tests). */
void quant_dequantize(const void *w, int bits, int64_t group, const float *s, const float *m,
                      int64_t N, int64_t K, float *out, int64_t nthreads) {
    const int64_t ngroups = K / group;
    const int64_t block_bytes = bits == 8 ? K * CB : (K / 2) * CB;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t blk = 0; blk < N / CB; blk++) {
        const uint8_t *wb = (const uint8_t *)w + blk * block_bytes;
        for (int64_t g = 0; g < ngroups; g++) {
            const float *sg = s + (blk * ngroups + g) * CB;
            float mg[CB];
            for (int c = 0; c < CB; c++) mg[c] = m ? m[(blk * ngroups + g) * CB + c] : 0.0f;
            for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
                float *r0 = out + k * N + blk * CB, *r1 = r0 + N;
                if (bits == 8) {
                    const int8_t *q = (const int8_t *)wb + k * CB;
                    for (int c = 0; c < CB; c++) r0[c] = (float)q[c] * sg[c] + mg[c];
                    for (int c = 0; c < CB; c++) r1[c] = (float)q[CB + c] * sg[c] + mg[c];
                } else {
                    const uint8_t *q = wb + (k / 2) * CB;
                    for (int c = 0; c < CB; c++) r0[c] = (float)(q[c] & 15) * sg[c] + mg[c];
                    for (int c = 0; c < CB; c++) r1[c] = (float)(q[c] >> 4) * sg[c] + mg[c];
                }
            }
        }
    }
}
