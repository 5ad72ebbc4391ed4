/* Linear layers on int8 weights and int8 activations (`--quantization w8a8`; see
   cpu_qdot.py): integer dot products summed exactly in int32, scaled in float32.

   Weights: symmetric int8, q in -127..127, with a float32 scale per output channel sw[n],
   or ("grouped") one per output channel and group of the activations' ag inputs,
   sw[n / 16][g][16] (GGUF's Q8_0 grid: the output projection, groups of 32).
   Stored as q + 128 (unsigned), in blocks of 16 output columns, four inputs of one column
   side by side: packed[n / 16][k / 4][16][4]. That is the operand layout of AVX-512
   VNNI's vpdpbusd, which multiplies 64 unsigned bytes by 64 signed ones and adds each
   column's four products to its int32 lane.

   Activations: each row quantized on the fly in groups of `ag` inputs: s = max |x| / 127,
   xq = round(x / s) (to nearest even) in -127..127, one scale per row and group. Per
   group, the exact integer sum of (q + 128) xq, minus 128 sum(xq) (the group's `comp`,
   which the sums start from), is sum(q xq); then, in float32,

       y[t][n] = (sum over groups g of  sum_g(q xq) * s[t][g]) * sw[n]  (+ bias[n])

   each group's term added by one fused multiply-add in group order, the last step one
   fused multiply-add with the bias (a multiply without one); grouped,

       y[t][n] = sum over groups g of  sum_g(q xq) * (s[t][g] * sw[n / 16][g][n % 16])

   (the two scales multiplied, then one fused multiply-add) (+ bias[n]). The generic loops compute
   the same operations in the same order, so every build gives the same bits.

   Wide activations (`--quantization int8` at bf16 on AVX-512 VNNI: weight-only in its
   precision): the same weights per output channel, and each row of x as 16-bit integers,
   one scale per row: s = max |x| / 32767, a = round(x / s) (to nearest even) in
   -32767..32767, split a = 256 hi + lo with hi = a >> 8 in -128..127 and lo = a & 255,
   stored lo - 128 so that both halves are signed bytes. Two exact int32 sums per column,
   over every input:

       H = sum (q + 128) hi - 128 sum(hi)                       = sum q hi
       L = sum (q + 128) (lo - 128) - 128 sum(lo - 128) + 128 sum(q)  = sum q lo

   (sum(q), the column's, kept with the weights), and in float32

       y[t][n] = (H * 256 + L) * s[t] * sw[n]  (+ bias[n])

   (one fused multiply-add for H * 256 + L, then the row's scale, then the channel's,
   multiplied or fused with the bias). Against bf16 inputs a 16-bit grid per row is finer
   than the inputs themselves wherever an input is within 2^7 of its row's largest, so the
   product is the dequantized weights' within float32 rounding: two vpdpbusd a 4-input step
   for 64 multiply-adds, the bf16 dot product's rate, on half its weight bytes and with no
   conversion of the integers. Grouped weights (the output projection's groups of 32): the
   two sums per group, H * 256 + L combined exactly in int32 (groups of at most 256), each
   group's total times its scale added in order, then times s[t] (+ bias[n]).

   VNNI path: each thread takes units of three column blocks (the rest one block at a
   time) and runs tiles of 4, 2 and 1 rows against a unit: 12 int32 sums for the group in
   registers, 12 float32 totals beside them. Rows are taken 128 at a time, so that a
   prefill's activations stay in L2 while the units' weights go by.
*/
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && !defined(QDOT_GENERIC)
#define HAVE_VNNI 1
#include "cpu_avx512.h"
#include <immintrin.h>
#endif

#define CB 16
#define ROW_CHUNK 128

/* 1: this build runs the VNNI tiles; 0: the generic loops. */
int qdot_variant(void) {
#ifdef HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}

/* One row of x (float32 or bf16) quantized in groups of ag: xq[K], comp[G], sx[G]. A group
   of zeros gets the scale 0; a group holding a NaN or an infinity gets a NaN scale and
   zeros, so its row's outputs come out NaN, as the float product's would. (Per channel,
   the sum over groups is taken before the weight scale: finite inputs above ~1e32 overflow
   it to infinity where the float product would not; activations are nowhere near.) */
static void quantize_row(const void *x, int bf16, int64_t K, int64_t ag, int8_t *xq,
                         int32_t *comp, float *sx) {
    float v[ag];
    for (int64_t g = 0; g * ag < K; g++) {
        const int64_t k0 = g * ag;
        if (bf16) {
            const bf16_t *xb = (const bf16_t *)x + k0;
            for (int64_t k = 0; k < ag; k++) v[k] = ld_bf16(xb[k]);
        } else {
            memcpy(v, (const float *)x + k0, (size_t)ag * sizeof(float));
        }
        float amax = 0.0f;
        int bad = 0;
        for (int64_t k = 0; k < ag; k++) {
            const float a = fabsf(v[k]);
            amax = a > amax ? a : amax;
            bad |= !(a <= 3.4028235e38f); /* NaN or infinity */
        }
        const float s = bad ? NAN : amax / 127.0f;
        int32_t sum = 0;
        if (s > 0.0f && !bad) {
            for (int64_t k = 0; k < ag; k++) {
                float r = nearbyintf(v[k] / s);
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                xq[k0 + k] = (int8_t)r;
                sum += (int32_t)r;
            }
        } else {
            memset(xq + k0, 0, (size_t)ag);
        }
        comp[g] = -128 * sum;
        sx[g] = s;
    }
}

#ifdef HAVE_VNNI
/* 16 inputs from k of a bf16 or float32 row, as float32. */
static inline __attribute__((always_inline)) __m512 load16(const void *x, int bf16, int64_t k) {
    return bf16 ? widen16_bf16((const bf16_t *)x + k) : _mm512_loadu_ps((const float *)x + k);
}

/* quantize_row16 16 lanes at a time (K a multiple of 16), the same operations lane by lane:
   the same integers. The scalar loop took most of a 32-row step's time at K = 576. */
static void quantize_row16_x16(const void *x, int bf16, int64_t K, int64_t ag, int8_t *xh,
                               int8_t *xl, int32_t *hsum, int32_t *lsum, float *sx) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 a = _mm512_andnot_ps(sign, load16(x, bf16, k));
        bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.4028235e38f), _CMP_NLE_UQ);
        amax = _mm512_max_ps(amax, a);
    }
    const float s = bad ? NAN : _mm512_reduce_max_ps(amax) / 32767.0f;
    if (!(s > 0.0f) || bad) {
        memset(xh, 0, (size_t)K);
        memset(xl, -128, (size_t)K);
        for (int64_t g = 0; g * ag < K; g++) hsum[g] = 0, lsum[g] = (int32_t)(-128 * ag);
        *sx = s;
        return;
    }
    const __m512 vs = _mm512_set1_ps(s), top = _mm512_set1_ps(32767.0f);
    __m512i hs = _mm512_setzero_si512(), ls = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 16) {
        if (k % ag == 0 && k > 0) { /* a group done */
            hsum[k / ag - 1] = _mm512_reduce_add_epi32(hs);
            lsum[k / ag - 1] = _mm512_reduce_add_epi32(ls);
            hs = ls = _mm512_setzero_si512();
        }
        __m512 r = _mm512_roundscale_ps(_mm512_div_ps(load16(x, bf16, k), vs),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_max_ps(_mm512_min_ps(r, top), _mm512_sub_ps(_mm512_setzero_ps(), top));
        const __m512i a = _mm512_cvtps_epi32(r);
        const __m512i hi = _mm512_srai_epi32(a, 8);
        const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(a, _mm512_set1_epi32(255)),
                                            _mm512_set1_epi32(128));
        _mm_storeu_si128((__m128i *)(xh + k), _mm512_cvtepi32_epi8(hi));
        _mm_storeu_si128((__m128i *)(xl + k), _mm512_cvtepi32_epi8(lo));
        hs = _mm512_add_epi32(hs, hi);
        ls = _mm512_add_epi32(ls, lo);
    }
    hsum[K / ag - 1] = _mm512_reduce_add_epi32(hs);
    lsum[K / ag - 1] = _mm512_reduce_add_epi32(ls);
    *sx = s;
}
#endif

/* One row of x as 16-bit integers split in bytes (see "Wide activations" above): xh[K],
   xl[K] (lo - 128), their sums per group of ag inputs (K / ag of each), the row's scale.
   A row of zeros gets the scale 0; a row holding a NaN or an infinity a NaN scale and
   integers 0, so its outputs come out NaN. K at most 32,768 (cpu_qdot.WIDE_MAX_K): every
   int32 sum, with its start, stays in range. */
static void quantize_row16(const void *x, int bf16, int64_t K, int64_t ag, int8_t *xh,
                           int8_t *xl, int32_t *hsum, int32_t *lsum, float *sx) {
#ifdef HAVE_VNNI
    if (ag % 16 == 0) {
        quantize_row16_x16(x, bf16, K, ag, xh, xl, hsum, lsum, sx);
        return;
    }
#endif
    float amax = 0.0f;
    int bad = 0;
    for (int64_t k = 0; k < K; k++) {
        const float a = fabsf(bf16 ? ld_bf16(((const bf16_t *)x)[k]) : ((const float *)x)[k]);
        amax = a > amax ? a : amax;
        bad |= !(a <= 3.4028235e38f); /* NaN or infinity */
    }
    const float s = bad ? NAN : amax / 32767.0f;
    for (int64_t g = 0; g * ag < K; g++) hsum[g] = 0, lsum[g] = 0;
    if (s > 0.0f && !bad) {
        for (int64_t k = 0; k < K; k++) {
            const float v = bf16 ? ld_bf16(((const bf16_t *)x)[k]) : ((const float *)x)[k];
            float r = nearbyintf(v / s);
            r = r > 32767.0f ? 32767.0f : (r < -32767.0f ? -32767.0f : r);
            const int32_t a = (int32_t)r;
            xh[k] = (int8_t)(a >> 8); /* arithmetic: floor(a / 256) */
            xl[k] = (int8_t)((a & 255) - 128);
            hsum[k / ag] += xh[k];
            lsum[k / ag] += xl[k];
        }
    } else { /* every a = 0: hi 0, lo - 128 = -128 */
        memset(xh, 0, (size_t)K);
        memset(xl, -128, (size_t)K);
        for (int64_t g = 0; g * ag < K; g++) lsum[g] = (int32_t)(-128 * ag);
    }
    *sx = s;
}

static inline float finish(float total, float scale, const float *bias, int64_t n) {
    return bias != NULL ? fmaf(total, scale, bias[n]) : total * scale;
}

static inline void store_out(void *y, int bf16, int64_t i, float v) {
    if (bf16)
        ((bf16_t *)y)[i] = st_bf16(v);
    else
        ((float *)y)[i] = v;
}

#ifdef HAVE_VNNI

static inline __attribute__((always_inline)) int32_t ld_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store16_out(void *y, int bf16, int64_t i,
                                                              __m512 v) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)((bf16_t *)y + i), store16_bf16(v));
    else
        _mm512_storeu_ps((float *)y + i, v);
}

#define BLOCKS_1(M) M(0)
#define BLOCKS_3(M) M(0) M(1) M(2)
#define EACH_1(M, r) M(r, 0)
#define EACH_3(M, r) M(r, 0) M(r, 1) M(r, 2)
/* Blocks spelled out as the rows are (ROWS_R, cpu_common.h), so that each sum is a named
   register. */

#define D_SUM(r, c) __m512i i##r##c; __m512 f##r##c = _mm512_setzero_ps();
#define I_START(r, c) i##r##c = start##r;
#define I_DOT(r, c) i##r##c = _mm512_dpbusd_epi32(i##r##c, w##c, b##r);
#define F_ADD(r, c)                                                                         \
    f##r##c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i##r##c),                                  \
                              grouped ? _mm512_mul_ps(s##r, gs##c) : s##r, f##r##c);
#define F_OUT(r, c)                                                                         \
    store16_out(y, y_bf16, (r) * y_stride + (c) * CB,                                       \
                grouped ? (bias != NULL ? _mm512_add_ps(f##r##c, bv##c) : f##r##c)          \
                        : (bias != NULL ? _mm512_fmadd_ps(f##r##c, sw##c, bv##c)            \
                                        : _mm512_mul_ps(f##r##c, sw##c)));

#define R_DECL(r) EACH(D_SUM, r)
#define R_START(r)                                                                          \
    const __m512i start##r = _mm512_set1_epi32(comp[(r) * G + g]);                          \
    EACH(I_START, r)
#define R_DOT(r)                                                                            \
    const __m512i b##r = _mm512_set1_epi32(ld_i32(xq + (r) * K + k));                       \
    EACH(I_DOT, r)
#define R_ADD(r)                                                                            \
    const __m512 s##r = _mm512_set1_ps(sx[(r) * G + g]);                                    \
    EACH(F_ADD, r)
#define R_OUT(r) EACH(F_OUT, r)
#define B_LOAD(c) const __m512i w##c = _mm512_loadu_si512(wb + (c) * wstride + k * CB);
#define B_GROUP(c)                                                                          \
    const __m512 gs##c = grouped ? _mm512_loadu_ps(sw + ((c) * G + g) * CB) : _mm512_setzero_ps();
#define B_SCALE(c)                                                                          \
    const __m512 sw##c = grouped ? _mm512_setzero_ps() : _mm512_loadu_ps(sw + (c) * CB);    \
    const __m512 bv##c = bias != NULL ? _mm512_loadu_ps(bias + (c) * CB) : _mm512_setzero_ps();

/* R rows (xq, comp, sx at the tile's first row) against C blocks of 16 columns (wb at the
   first block's packed bytes, wstride bytes apart; sw at the first block's scales and bias
   at its first column), into y at the tile's first row and column. `grouped` is a
   constant where it is called, so each call keeps one of the two scale paths. pf: a block
   to fetch into L2 beside the tile's own (one line an input step), or NULL. */
#define DEFINE_TILE(R, C)                                                                   \
    static inline __attribute__((always_inline)) void tile_##R##x##C(                       \
        const int8_t *restrict xq, const int32_t *restrict comp, const float *restrict sx,  \
        int64_t K, int64_t ag, const uint8_t *restrict wb, int64_t wstride,                 \
        const float *restrict sw, const float *restrict bias, void *y, int64_t y_stride,    \
        int y_bf16, const int grouped, const uint8_t *pf) {                                 \
        const int64_t G = K / ag;                                                           \
        ROWS_##R(R_DECL)                                                                    \
        for (int64_t g = 0; g < G; g++) {                                                   \
            ROWS_##R(R_START)                                                               \
            for (int64_t k = g * ag; k < (g + 1) * ag; k += 4) {                            \
                BLOCKS(B_LOAD)                                                              \
                if (pf != NULL) _mm_prefetch((const char *)(pf + k * CB), _MM_HINT_T1);    \
                ROWS_##R(R_DOT)                                                             \
            }                                                                               \
            BLOCKS(B_GROUP)                                                                 \
            ROWS_##R(R_ADD)                                                                 \
        }                                                                                   \
        BLOCKS(B_SCALE)                                                                     \
        ROWS_##R(R_OUT)                                                                     \
    }

#define EACH EACH_3
#define BLOCKS BLOCKS_3
DEFINE_TILE(4, 3)
DEFINE_TILE(2, 3)
DEFINE_TILE(1, 3)
#undef EACH
#undef BLOCKS
#define EACH EACH_1
#define BLOCKS BLOCKS_1
DEFINE_TILE(4, 1)
DEFINE_TILE(2, 1)
DEFINE_TILE(1, 1)
#undef EACH
#undef BLOCKS

/* What both kernels' drivers share: each thread a static share of `units`, and rows
   ROW_CHUNK at a time ([r0, r1)), so that a prefill's activations stay in L2 while the
   share's weights go by; BODY runs unit u against the chunk. */
#define EACH_UNIT_AND_ROW_CHUNK(units, T, num_threads, BODY)                               \
    _Pragma("omp parallel num_threads(num_threads)") {                                      \
        const int64_t nt_ = omp_get_num_threads(), id_ = omp_get_thread_num();              \
        const int64_t u0 = (units) * id_ / nt_, u1 = (units) * (id_ + 1) / nt_;            \
        for (int64_t r0 = 0; r0 < (T); r0 += ROW_CHUNK) {                                   \
            const int64_t r1 = r0 + ROW_CHUNK < (T) ? r0 + ROW_CHUNK : (T);                 \
            for (int64_t u = u0; u < u1; u++) {                                             \
                BODY                                                                        \
            }                                                                               \
        }                                                                                   \
    }

/* The most rows of a step whose row tiles fetch the thread's next unit of weights while
   they run (wide_unit, run_blocks): at 8-64 rows a layer waits on its weights' read, and
   the fetch takes 6-20% off (docs/BENCHMARKS.md); from 128 rows it gained nothing that
   the noise resolved. */
#define PREFETCH_ROWS 64

/* What the row tile at row r fetches, in wide_unit and run_blocks (r0: the first row they
   run; next, next_blocks: the thread's next unit, wstride bytes a block): the tile t =
   (r - r0) / 4 fetches block t of the next unit, if there is one; NULL otherwise. */
#define NEXT_BLOCK(r)                                                                       \
    (((r) - r0) / 4 < next_blocks ? next + ((r) - r0) / 4 * wstride : NULL)

/* Rows [r, r1) in tiles of 4, 2 and 1 rows (T4, T2, T1 called with AT(row)). */
#define ROW_TILES(T4, T2, T1)                                                               \
    for (; r + 4 <= r1; r += 4) T4(AT(r));                                                  \
    if (r + 2 <= r1) T2(AT(r)), r += 2;                                                     \
    if (r < r1) T1(AT(r));

/* Wide activations: R rows (xh, xl at the tile's first row, K apart; their start values
   h0, l0) against C blocks of 16 columns (wb, wstride bytes apart; colsum, sw, bias at the
   first block's first column), into y. Two int32 sums a row and block: 4 x 2 x 2 = 16. pf:
   a block to fetch into L2 beside the tile's own (one line an input step), or NULL. */
#define W_DECL(r, c) __m512i h##r##c = hstart##r, l##r##c = _mm512_add_epi32(lstart##r, cq##c);
#define W_DOT(r, c)                                                                         \
    h##r##c = _mm512_dpbusd_epi32(h##r##c, w##c, bh##r);                                    \
    l##r##c = _mm512_dpbusd_epi32(l##r##c, w##c, bl##r);
#define W_OUT(r, c)                                                                         \
    {                                                                                       \
        const __m512 t = _mm512_mul_ps(                                                     \
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(h##r##c), _mm512_set1_ps(256.0f),            \
                            _mm512_cvtepi32_ps(l##r##c)),                                   \
            _mm512_set1_ps(sx[r]));                                                         \
        store16_out(y, y_bf16, (r) * y_stride + (c) * CB,                                   \
                    bias != NULL ? _mm512_fmadd_ps(t, sw##c, bv##c) : _mm512_mul_ps(t, sw##c)); \
    }
#define WR_START(r)                                                                         \
    const __m512i hstart##r = _mm512_set1_epi32(-128 * hsum[r]);                            \
    const __m512i lstart##r = _mm512_set1_epi32(-128 * lsum[r]);
#define WR_DECL(r) EACH(W_DECL, r)
#define WR_DOT(r)                                                                           \
    const __m512i bh##r = _mm512_set1_epi32(ld_i32(xh + (r) * K + k));                      \
    const __m512i bl##r = _mm512_set1_epi32(ld_i32(xl + (r) * K + k));                      \
    EACH(W_DOT, r)
#define WR_OUT(r) EACH(W_OUT, r)
#define WB_COLSUM(c)                                                                        \
    const __m512i cq##c = _mm512_slli_epi32(_mm512_loadu_si512(colsum + (c) * CB), 7);
#define WB_SCALE(c)                                                                         \
    const __m512 sw##c = _mm512_loadu_ps(sw + (c) * CB);                                    \
    const __m512 bv##c = bias != NULL ? _mm512_loadu_ps(bias + (c) * CB) : _mm512_setzero_ps();

#define DEFINE_WIDE_TILE(R, C)                                                              \
    static inline __attribute__((always_inline)) void wide_##R##x##C(                       \
        const int8_t *restrict xh, const int8_t *restrict xl, const int32_t *restrict hsum, \
        const int32_t *restrict lsum, const float *restrict sx, int64_t K,                  \
        const uint8_t *restrict wb, int64_t wstride, const int32_t *restrict colsum,        \
        const float *restrict sw, const float *restrict bias, void *y, int64_t y_stride,    \
        int y_bf16, const uint8_t *pf) {                                                    \
        BLOCKS(WB_COLSUM)                                                                   \
        ROWS_##R(WR_START)                                                                  \
        ROWS_##R(WR_DECL)                                                                   \
        for (int64_t k = 0; k < K; k += 4) {                                                \
            BLOCKS(B_LOAD)                                                                  \
            if (pf != NULL) _mm_prefetch((const char *)(pf + k * CB), _MM_HINT_T1);        \
            ROWS_##R(WR_DOT)                                                                \
        }                                                                                   \
        BLOCKS(WB_SCALE)                                                                    \
        ROWS_##R(WR_OUT)                                                                    \
    }

#define EACH_2(M, r) M(r, 0) M(r, 1)
#define BLOCKS_2(M) M(0) M(1)
#define EACH EACH_2
#define BLOCKS BLOCKS_2
DEFINE_WIDE_TILE(4, 2)
DEFINE_WIDE_TILE(2, 2)
DEFINE_WIDE_TILE(1, 2)
#undef EACH
#undef BLOCKS
#define EACH EACH_1
#define BLOCKS BLOCKS_1
DEFINE_WIDE_TILE(4, 1)
DEFINE_WIDE_TILE(2, 1)
DEFINE_WIDE_TILE(1, 1)
#undef EACH
#undef BLOCKS

/* Wide activations, grouped weights: R rows against one block of 16 columns whose scales
   are per group of ag inputs (gsc [G][16], colsum [G][16]). Per group the two sums are
   combined exactly in int32 (H * 256 + L: ag <= 256 keeps it in range), converted, and
   added times the group's scale (a fused multiply-add each, in group order); then times
   the row's scale, fused with the bias where there is one. */
#define WG_DECL(r) __m512 f##r = _mm512_setzero_ps(); __m512i h##r, l##r;
#define WG_START(r)                                                                         \
    h##r = _mm512_set1_epi32(-128 * hsum[(r) * G + g]);                                     \
    l##r = _mm512_add_epi32(_mm512_set1_epi32(-128 * lsum[(r) * G + g]), cq);
#define WG_DOT(r)                                                                           \
    h##r = _mm512_dpbusd_epi32(h##r, w0, _mm512_set1_epi32(ld_i32(xh + (r) * K + k)));       \
    l##r = _mm512_dpbusd_epi32(l##r, w0, _mm512_set1_epi32(ld_i32(xl + (r) * K + k)));
#define WG_ADD(r)                                                                           \
    f##r = _mm512_fmadd_ps(                                                                 \
        _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h##r, 8), l##r)), gs, f##r);
#define WG_OUT(r)                                                                           \
    {                                                                                       \
        const __m512 s = _mm512_set1_ps(sx[r]);                                             \
        store16_out(y, y_bf16, (r) * y_stride,                                              \
                    bias != NULL ? _mm512_fmadd_ps(f##r, s, bv) : _mm512_mul_ps(f##r, s));  \
    }
#define DEFINE_WIDE_GROUPED_TILE(R)                                                         \
    static inline __attribute__((always_inline)) void wide_grouped_##R(                     \
        const int8_t *restrict xh, const int8_t *restrict xl, const int32_t *restrict hsum, \
        const int32_t *restrict lsum, const float *restrict sx, int64_t K, int64_t ag,      \
        const uint8_t *restrict wb, const int32_t *restrict colsum,                         \
        const float *restrict gsc, const float *restrict bias, void *y, int64_t y_stride,   \
        int y_bf16, const uint8_t *pf) {                                                    \
        const int64_t G = K / ag;                                                           \
        ROWS_##R(WG_DECL)                                                                   \
        for (int64_t g = 0; g < G; g++) {                                                   \
            const __m512i cq = _mm512_slli_epi32(_mm512_loadu_si512(colsum + g * CB), 7);   \
            const __m512 gs = _mm512_loadu_ps(gsc + g * CB);                                \
            ROWS_##R(WG_START)                                                              \
            for (int64_t k = g * ag; k < (g + 1) * ag; k += 4) {                            \
                const __m512i w0 = _mm512_loadu_si512(wb + k * CB);                         \
                if (pf != NULL) _mm_prefetch((const char *)(pf + k * CB), _MM_HINT_T1);    \
                ROWS_##R(WG_DOT)                                                            \
            }                                                                               \
            ROWS_##R(WG_ADD)                                                                \
        }                                                                                   \
        const __m512 bv = bias != NULL ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();      \
        ROWS_##R(WG_OUT)                                                                    \
    }
DEFINE_WIDE_GROUPED_TILE(4)
DEFINE_WIDE_GROUPED_TILE(2)
DEFINE_WIDE_GROUPED_TILE(1)

/* Wide activations: rows [r0, r1) against `nblocks` (2 or 1) blocks from block b. `next`:
   the thread's next unit (next_blocks blocks, K x 16 bytes each), or NULL: the first row
   tiles fetch it into L2 as they run, tile t (4 rows) its block t, one line next to each of
   its own, so that the next unit's first tile reads it from there instead of waiting on
   memory. SmolLM2's 120 linears at 32 rows ~7% faster, at 8 rows ~18%, its output
   projection at 32 rows ~20% (a Zen 4, docs/BENCHMARKS.md). */
static void wide_unit(const int8_t *xh, const int8_t *xl, const int32_t *hsum,
                      const int32_t *lsum, const float *sx, int64_t K, const uint8_t *w,
                      const int32_t *colsum, const float *sw, const float *bias, int64_t b,
                      int nblocks, void *y, int64_t y_stride, int y_bf16, int64_t r0,
                      int64_t r1, const uint8_t *next, int64_t next_blocks) {
    const int64_t wstride = K * CB;
    const uint8_t *wb = w + b * wstride;
    const size_t out_size = y_bf16 ? sizeof(bf16_t) : sizeof(float);
    const float *bb = bias != NULL ? bias + b * CB : NULL;
    int64_t r = r0;
#define AT(r) xh + (r) * K, xl + (r) * K, hsum + (r), lsum + (r), sx + (r), K, wb, wstride,  \
              colsum + b * CB, sw + b * CB, bb,                                             \
              (char *)y + ((r) * y_stride + b * CB) * (int64_t)out_size, y_stride, y_bf16,  \
              NEXT_BLOCK(r)
    if (nblocks == 2) {
        ROW_TILES(wide_4x2, wide_2x2, wide_1x2)
    } else {
        ROW_TILES(wide_4x1, wide_2x1, wide_1x1)
    }
#undef AT
}

/* Grouped: rows [r0, r1) against block b (one block a unit); the first row tile fetches
   the next unit's block (`next`, or NULL), as wide_unit's do. */
static void wide_grouped_unit(const int8_t *xh, const int8_t *xl, const int32_t *hsum,
                              const int32_t *lsum, const float *sx, int64_t K, int64_t ag,
                              const uint8_t *w, const int32_t *colsum, const float *sw,
                              const float *bias, int64_t b, void *y, int64_t y_stride,
                              int y_bf16, int64_t r0, int64_t r1, const uint8_t *next) {
    const int64_t G = K / ag;
    const size_t out_size = y_bf16 ? sizeof(bf16_t) : sizeof(float);
    int64_t r = r0;
#define AT(r) xh + (r) * K, xl + (r) * K, hsum + (r) * G, lsum + (r) * G, sx + (r), K, ag,   \
              w + b * K * CB, colsum + b * G * CB, sw + b * G * CB,                         \
              bias != NULL ? bias + b * CB : NULL,                                          \
              (char *)y + ((r) * y_stride + b * CB) * (int64_t)out_size, y_stride, y_bf16,  \
              (r) == r0 ? next : NULL
    ROW_TILES(wide_grouped_4, wide_grouped_2, wide_grouped_1)
#undef AT
}

static void wide_gemm(const int8_t *xh, const int8_t *xl, const int32_t *hsum,
                      const int32_t *lsum, const float *sx, int64_t T, int64_t K, int64_t ag,
                      const uint8_t *w, const int32_t *colsum, const float *sw, int grouped,
                      const float *bias, int64_t N, void *y, int64_t y_stride, int y_bf16,
                      int64_t num_threads) {
    const int64_t nb = N / CB, pairs = nb / 2, units = grouped ? nb : pairs + nb % 2;
    EACH_UNIT_AND_ROW_CHUNK(units, T, num_threads,
        /* the thread's next unit, in this row chunk */
        const int has_next = u + 1 < u1 && (T) <= PREFETCH_ROWS;
        if (grouped)
            wide_grouped_unit(xh, xl, hsum, lsum, sx, K, ag, w, colsum, sw, bias, u, y,
                              y_stride, y_bf16, r0, r1,
                              has_next ? w + (u + 1) * K * CB : NULL);
        else
            wide_unit(xh, xl, hsum, lsum, sx, K, w, colsum, sw, bias,
                      u < pairs ? 2 * u : 2 * pairs, u < pairs ? 2 : 1, y, y_stride, y_bf16,
                      r0, r1, has_next ? w + 2 * (u + 1) * K * CB : NULL,
                      !has_next ? 0 : u + 1 < pairs ? 2 : 1);)
}

/* Rows [r0, r1) against `nblocks` (3 or 1) blocks from block b; the first row tiles fetch
   the thread's next unit (`next`, next_blocks blocks, or NULL), as wide_unit's do. */
static inline __attribute__((always_inline)) void run_blocks(
    const int8_t *xq, const int32_t *comp, const float *sx, int64_t K, int64_t ag,
    const uint8_t *w, const float *sw, const float *bias, int64_t b, int nblocks, void *y,
    int64_t y_stride, int y_bf16, int64_t r0, int64_t r1, const int grouped,
    const uint8_t *next, int64_t next_blocks) {
    const int64_t G = K / ag, wstride = K * CB;
    const uint8_t *wb = w + b * wstride;
    const float *swb = sw + b * (grouped ? G * CB : CB), *bb = bias != NULL ? bias + b * CB : NULL;
    const size_t out_size = y_bf16 ? sizeof(bf16_t) : sizeof(float);
    int64_t r = r0;
#define AT(r) xq + (r) * K, comp + (r) * G, sx + (r) * G, K, ag, wb, wstride, swb, bb,       \
              (char *)y + ((r) * y_stride + b * CB) * (int64_t)out_size, y_stride, y_bf16,  \
              grouped, NEXT_BLOCK(r)
    if (nblocks == 3) {
        ROW_TILES(tile_4x3, tile_2x3, tile_1x3)
    } else {
        ROW_TILES(tile_4x1, tile_2x1, tile_1x1)
    }
#undef AT
}

static void run_unit(const int8_t *xq, const int32_t *comp, const float *sx, int64_t K,
                     int64_t ag, const uint8_t *w, const float *sw, const float *bias,
                     int64_t b, int nblocks, void *y, int64_t y_stride, int y_bf16,
                     int64_t r0, int64_t r1, int grouped, const uint8_t *next,
                     int64_t next_blocks) {
    if (grouped)
        run_blocks(xq, comp, sx, K, ag, w, sw, bias, b, nblocks, y, y_stride, y_bf16, r0, r1,
                   1, next, next_blocks);
    else
        run_blocks(xq, comp, sx, K, ag, w, sw, bias, b, nblocks, y, y_stride, y_bf16, r0, r1,
                   0, next, next_blocks);
}

static void gemm(const int8_t *xq, const int32_t *comp, const float *sx, int64_t T,
                 int64_t K, int64_t ag, const uint8_t *w, const float *sw, const float *bias,
                 int64_t N, int grouped, void *y, int64_t y_stride, int y_bf16,
                 int64_t num_threads) {
    const int64_t nb = N / CB, triples = nb / 3, units = triples + nb % 3;
    /* unit v's first block and its blocks */
#define FIRST_BLOCK(v) ((v) < triples ? 3 * (v) : 3 * triples + ((v) - triples))
#define UNIT_BLOCKS(v) ((v) < triples ? 3 : 1)
    EACH_UNIT_AND_ROW_CHUNK(units, T, num_threads,
        /* the thread's next unit, in this row chunk */
        const int has_next = u + 1 < u1 && (T) <= PREFETCH_ROWS;
        run_unit(xq, comp, sx, K, ag, w, sw, bias, FIRST_BLOCK(u), (int)UNIT_BLOCKS(u), y,
                 y_stride, y_bf16, r0, r1, grouped,
                 has_next ? w + FIRST_BLOCK(u + 1) * K * CB : NULL,
                 has_next ? UNIT_BLOCKS(u + 1) : 0);)
#undef FIRST_BLOCK
#undef UNIT_BLOCKS
}

#else /* the generic loops */

static void gemm(const int8_t *xq, const int32_t *comp, const float *sx, int64_t T,
                 int64_t K, int64_t ag, const uint8_t *w, const float *sw, const float *bias,
                 int64_t N, int grouped, void *y, int64_t y_stride, int y_bf16,
                 int64_t num_threads) {
    const int64_t G = K / ag;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wb = w + (n / CB) * K * CB + (n % CB) * 4;
        /* grouped: the scale of group g at gs[g * CB] */
        const float *gs = grouped ? sw + (n / CB) * G * CB + n % CB : sw;
        for (int64_t t = 0; t < T; t++) {
            const int8_t *xr = xq + t * K;
            float total = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t acc = comp[t * G + g];
                for (int64_t k = g * ag; k < (g + 1) * ag; k += 4) {
                    const uint8_t *q = wb + k * CB;
                    acc += (int32_t)q[0] * xr[k] + (int32_t)q[1] * xr[k + 1] +
                           (int32_t)q[2] * xr[k + 2] + (int32_t)q[3] * xr[k + 3];
                }
                total = fmaf((float)acc, grouped ? sx[t * G + g] * gs[g * CB] : sx[t * G + g],
                             total);
            }
            const float out = grouped ? (bias != NULL ? total + bias[n] : total)
                                      : finish(total, sw[n], bias, n);
            store_out(y, y_bf16, t * y_stride + n, out);
        }
    }
}

static void wide_gemm(const int8_t *xh, const int8_t *xl, const int32_t *hsum,
                      const int32_t *lsum, const float *sx, int64_t T, int64_t K, int64_t ag,
                      const uint8_t *w, const int32_t *colsum, const float *sw, int grouped,
                      const float *bias, int64_t N, void *y, int64_t y_stride, int y_bf16,
                      int64_t num_threads) {
    const int64_t G = K / ag;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wb = w + (n / CB) * K * CB + (n % CB) * 4;
        /* grouped: group g's scale and column sum at [(n / CB) * G + g][n % CB] */
        const int64_t at = (n / CB) * G * CB + n % CB;
        for (int64_t t = 0; t < T; t++) {
            const int8_t *h = xh + t * K, *l = xl + t * K;
            float total = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t hs = -128 * hsum[t * G + g];
                int32_t ls = -128 * lsum[t * G + g] + 128 * colsum[grouped ? at + g * CB : n];
                for (int64_t k = g * ag; k < (g + 1) * ag; k += 4) {
                    const uint8_t *q = wb + k * CB;
                    for (int j = 0; j < 4; j++) {
                        hs += (int32_t)q[j] * h[k + j];
                        ls += (int32_t)q[j] * l[k + j];
                    }
                }
                if (grouped)
                    total = fmaf((float)(hs * 256 + ls), sw[at + g * CB], total);
                else /* per channel: the one group */
                    total = fmaf((float)hs, 256.0f, (float)ls) * sx[t];
            }
            const float out = grouped ? finish(total, sx[t], bias, n)
                                      : finish(total, sw[n], bias, n);
            store_out(y, y_bf16, t * y_stride + n, out);
        }
    }
}

#endif /* HAVE_VNNI */

/* The activations' buffer of the calling thread (xq, comp, sx), grown as needed and kept:
   a prefill's is a few MiB, and a fresh one per call would fault its pages in each time.
   Freed when its thread exits (the key's destructor). */
static __thread void *scratch;
static __thread size_t scratch_size;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void make_scratch_key(void) { (void)pthread_key_create(&scratch_key, free); }

/* The scratch buffer of the calling thread, at least `need` bytes (NULL: out of memory). */
static void *thread_scratch(size_t need) {
    if (need > scratch_size) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, need) != 0) return NULL;
        free(scratch);
        scratch = grown;
        scratch_size = need;
        pthread_once(&scratch_once, make_scratch_key);
        (void)pthread_setspecific(scratch_key, scratch);
    }
    return scratch;
}

/* y [T][N] = x [T][K] times the packed weights with wide activations (see the top): the
   weights per output channel (sw [N]) with their columns' integer sums colsum [N], or
   grouped, per output channel and group of ag inputs (sw and colsum [N / 16][K / ag][16],
   ag a multiple of 4 up to 256). K a multiple of 4 (and of ag) up to 32,768, N of 16.
   Returns 0, or 1 when the activations' buffer could not be allocated. */
int qdot16_linear(const void *x, int64_t x_stride, int x_bf16, int64_t T, int64_t K,
                  int64_t ag, const uint8_t *w, const float *sw, const int32_t *colsum,
                  int grouped, const float *bias, int64_t N, void *y, int64_t y_stride,
                  int y_bf16, int64_t num_threads) {
    const int64_t G = K / ag;
    const size_t row_bytes = ((size_t)(T * K) + 63) & ~(size_t)63;
    char *buf = (char *)thread_scratch(2 * row_bytes +
                                       (size_t)T * (2 * G * sizeof(int32_t) + sizeof(float)));
    if (buf == NULL) return 1;
    int8_t *xh = (int8_t *)buf, *xl = (int8_t *)(buf + row_bytes);
    int32_t *hsum = (int32_t *)(buf + 2 * row_bytes), *lsum = hsum + T * G;
    float *sx = (float *)(lsum + T * G);
    const size_t in_size = x_bf16 ? sizeof(bf16_t) : sizeof(float);
#pragma omp parallel for num_threads(T * K >= 65536 ? num_threads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++)
        quantize_row16((const char *)x + t * x_stride * (int64_t)in_size, x_bf16, K, ag,
                       xh + t * K, xl + t * K, hsum + t * G, lsum + t * G, sx + t);
    wide_gemm(xh, xl, hsum, lsum, sx, T, K, ag, w, colsum, sw, grouped, bias, N, y, y_stride,
              y_bf16, num_threads);
    return 0;
}

/* y [T][N] (row stride y_stride, float32 or bf16) = x [T][K] (row stride x_stride) times
   the packed weights, as described at the top (grouped: sw holds a scale per group of ag
   inputs). K a multiple of ag, ag of 4, N of 16. Returns 0, or 1 when the activations'
   buffer could not be allocated. */
int qdot_linear(const void *x, int64_t x_stride, int x_bf16, int64_t T, int64_t K,
                int64_t ag, const uint8_t *w, const float *sw, int grouped, const float *bias,
                int64_t N, void *y, int64_t y_stride, int y_bf16, int64_t num_threads) {
    const int64_t G = K / ag;
    const size_t xq_bytes = ((size_t)(T * K) + 63) & ~(size_t)63;
    const size_t need = xq_bytes + (size_t)(T * G) * (sizeof(int32_t) + sizeof(float));
    if (thread_scratch(need) == NULL) return 1;
    int8_t *xq = (int8_t *)scratch;
    int32_t *comp = (int32_t *)((char *)scratch + xq_bytes);
    float *sx = (float *)(comp + T * G);
    const size_t in_size = x_bf16 ? sizeof(bf16_t) : sizeof(float);
#pragma omp parallel for num_threads(T * K >= 65536 ? num_threads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++)
        quantize_row((const char *)x + t * x_stride * (int64_t)in_size, x_bf16, K, ag,
                     xq + t * K, comp + t * G, sx + t * G);
    gemm(xq, comp, sx, T, K, ag, w, sw, bias, N, grouped, y, y_stride, y_bf16, num_threads);
    return 0;
}
