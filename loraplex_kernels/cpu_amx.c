/* bf16 linear layers of few rows on AMX tiles (see cpu_amx.py). */
#include "cpu_common.h"

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
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
int amx_linear_bf16(const bf16_t *x, int64_t x_stride, int64_t m, int64_t k,
                    const bf16_t *packed, int64_t n, const bf16_t *bias, bf16_t *y,
                    int64_t num_threads) {
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
            STORE_TILE(0, 0, ma, j * 16);
            STORE_TILE(1, 0, ma, (j + half) * 16);
            if (mb) {
                STORE_TILE(2, 16, mb, j * 16);
                STORE_TILE(3, 16, mb, (j + half) * 16);
            }
        }
        /* NOTE: the tiles back to their initial state, so that no configuration of ours
           is left for other code on this thread (oneDNN configures its own). */
        _tile_release();
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y;
    (void)num_threads;
    return 1;
#endif
}
