/* bf16 on AMX tiles: linear layers of few rows (see cpu_amx.py); a new prompt's causal
   attention on tiles is in cpu_attention.c. */
#include "cpu_avx512.h"
#include "cpu_common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif

/* Whether this build has AMX and the kernel lets the process use its tile registers
   (Linux hands them out on request: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA). */
int amx_ready(void) {
#ifdef HAVE_AMX
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* How far ahead of the tile being read each weight stream is fetched, in bytes. */
#define WEIGHT_PREFETCH 2048

/* Tile t (a constant) of rows [row0, row0 + rows) and columns [col0, col0 + 16) of y,
   through tmp: float32 + bias, rounded to bf16. */
#define STORE_TILE(t, row0, rows, col0)                                                   \
    do {                                                                                  \
        _tile_stored(t, tmp, 64);                                                         \
        for (int64_t r = 0; r < (rows); r++)                                              \
            for (int64_t c = 0; c < 16; c++)                                              \
                y[((row0) + r) * n + (col0) + c] = st_bf16(                               \
                    tmp[r * 16 + c] + (bias != NULL ? ld_bf16(bias[(col0) + c]) : 0.0f)); \
    } while (0)

/* float32 x 16 rounded to bf16 and widened back: st_bf16 then ld_bf16 lane by lane (round
   to nearest even in integers, a NaN made quiet, denormals kept). */
static inline __attribute__((always_inline)) __m512 round16_bf16(__m512 v) {
    const __m512i i = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(0x7fff)), lsb);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(i, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i out = _mm512_mask_blend_epi32(
        nan, rounded, _mm512_or_si512(i, _mm512_set1_epi32(0x400000)));
    return _mm512_castsi512_ps(_mm512_and_si512(out, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Tiles tg and tu: the gate and the up columns [col0, col0 + 16) of rows [row0, row0 +
   rows), through tmp and tmp2. y (n / 2 columns) = silu(gate) * up, each rounded as the
   unfused path rounds it: gate and up (+ bias) to bf16, as the linear stores them, then
   silu_mul's steps (cpu_ops_typed.h). */
#define STORE_SILU_MUL(tg, tu, row0, rows, col0)                                          \
    do {                                                                                  \
        _tile_stored(tg, tmp, 64);                                                        \
        _tile_stored(tu, tmp2, 64);                                                       \
        __m512 bg = _mm512_setzero_ps(), bu = _mm512_setzero_ps();                        \
        if (bias != NULL) {                                                               \
            bg = widen16_bf16(bias + (col0));                                             \
            bu = widen16_bf16(bias + n / 2 + (col0));                                     \
        }                                                                                 \
        for (int64_t r = 0; r < (rows); r++) {                                            \
            const __m512 g = round16_bf16(_mm512_add_ps(_mm512_load_ps(tmp + r * 16), bg)); \
            const __m512 u = round16_bf16(_mm512_add_ps(_mm512_load_ps(tmp2 + r * 16), bu)); \
            const __m512 den = _mm512_add_ps(                                             \
                _mm512_set1_ps(1.0f), exp16(_mm512_xor_ps(g, _mm512_set1_ps(-0.0f)))); \
            const __m512 h = _mm512_mul_ps(round16_bf16(_mm512_div_ps(g, den)), u);       \
            const __m512i bits = _mm512_srli_epi32(                                       \
                _mm512_castps_si512(round16_bf16(h)), 16);                                \
            _mm256_storeu_si256((__m256i *)(y + ((row0) + r) * (n / 2) + (col0)),         \
                                _mm512_cvtepi32_epi16(bits));                             \
        }                                                                                 \
    } while (0)

#endif

/* y [m, n] (contiguous) = x [m, k] (rows x_stride apart) . W^T + bias, for 1 <= m <= 32,
   n and k multiples of 32: products summed in float32, rounded once to bf16. W [n, k] is
   given as amx_pack lays it out: 16 output columns by 32 inputs a tile, 1 KiB each, the
   input pairs (2i, 2i + 1) of a column side by side, tiles of one 16-column block in input
   order, blocks in column order (cpu_amx.py pack_weight).

   Each thread takes 16-column blocks j and j + n / 32 at once: two weight streams read
   from memory side by side, the rows of x in two A tiles, four float32 tiles of sums.
   Returns 1 (and writes nothing) for shapes it does not take or without AMX.

   NOTE: at 32 rows the weights are read once and the tiles' arithmetic is cheap, so the
   time is the weight read: on an Intel Xeon with AMX, the 120 matrices of a SmolLM2
   decode step in 9.1 ms on two threads (23 GB/s) against 13.6 ms for oneDNN's packed bf16
   matmul; one stream per thread instead of two read 17 GB/s. */
static int amx_linear(const bf16_t *x, int64_t x_stride, int64_t m, int64_t k,
                      const bf16_t *packed, int64_t n, const bf16_t *bias, bf16_t *y,
                      int64_t num_threads, int silu_mul) {
#ifdef HAVE_AMX
    if (m < 1 || m > 32 || n % 32 != 0 || k % 32 != 0 || n == 0 || k == 0) return 1;
    const int64_t half = n / 32, nk = k / 32;
    const int64_t ma = m < 16 ? m : 16, mb = m - ma; /* rows of the two A tiles */
#pragma omp parallel num_threads(num_threads)
    {
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        /* 0, 1: sums of rows [0, ma); 2, 3: rows [16, 16 + mb); 4, 5: those rows of x;
           6, 7: a weight tile of each stream */
        const uint8_t rows[8] = {(uint8_t)ma, (uint8_t)ma, (uint8_t)(mb ? mb : 1),
                                 (uint8_t)(mb ? mb : 1), (uint8_t)ma, (uint8_t)(mb ? mb : 1),
                                 16, 16};
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = rows[t];
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        float tmp[16 * 16] __attribute__((aligned(64)));
        float tmp2[16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t j = 0; j < half; j++) {
            const char *w0 = (const char *)(packed + j * nk * 512);
            const char *w1 = (const char *)(packed + (j + half) * nk * 512);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < nk; kb++) {
                for (int o = 0; o < 1024; o += 64) { /* past a matrix's end: no fault */
                    _mm_prefetch(w0 + kb * 1024 + WEIGHT_PREFETCH + o, _MM_HINT_T0);
                    _mm_prefetch(w1 + kb * 1024 + WEIGHT_PREFETCH + o, _MM_HINT_T0);
                }
                _tile_loadd(6, w0 + kb * 1024, 64);
                _tile_loadd(7, w1 + kb * 1024, 64);
                _tile_loadd(4, x + kb * 32, x_stride * 2);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (mb) {
                    _tile_loadd(5, x + 16 * x_stride + kb * 32, x_stride * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            if (silu_mul) { /* block j + half holds the up columns of block j's gates */
                STORE_SILU_MUL(0, 1, 0, ma, j * 16);
                if (mb) STORE_SILU_MUL(2, 3, 16, mb, j * 16);
            } else {
                STORE_TILE(0, 0, ma, j * 16);
                STORE_TILE(1, 0, ma, (j + half) * 16);
                if (mb) {
                    STORE_TILE(2, 16, mb, j * 16);
                    STORE_TILE(3, 16, mb, (j + half) * 16);
                }
            }
        }
        /* NOTE: the tiles back to their initial state, so that no configuration of ours
           is left for other code on this thread (oneDNN configures its own). */
        _tile_release();
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y;
    (void)num_threads, (void)silu_mul;
    return 1;
#endif
}

int amx_linear_bf16(const bf16_t *x, int64_t x_stride, int64_t m, int64_t k,
                    const bf16_t *packed, int64_t n, const bf16_t *bias, bf16_t *y,
                    int64_t num_threads) {
    return amx_linear(x, x_stride, m, k, packed, n, bias, y, num_threads, 0);
}

/* A gate_up projection and the SiLU after it in one pass: W [n, k] holds the n / 2 gate
   rows, then the n / 2 up rows (n a multiple of 64, so that block j + n / 32 is block j's
   up columns); y [m, n / 2] = silu(gate) * up, equal bit for bit to amx_linear_bf16 and
   then silu_mul_bf16 (cpu_ops.c), without the [m, n] intermediate. */
int amx_linear_silu_mul_bf16(const bf16_t *x, int64_t x_stride, int64_t m, int64_t k,
                             const bf16_t *packed, int64_t n, const bf16_t *bias, bf16_t *y,
                             int64_t num_threads) {
    if (n % 64 != 0) return 1;
    return amx_linear(x, x_stride, m, k, packed, n, bias, y, num_threads, 1);
}

