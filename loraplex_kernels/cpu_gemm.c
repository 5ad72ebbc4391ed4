/* bf16 linear layers (see cpu_gemm.py): on AMX tiles for steps of up to 32 rows, or on the
   AVX-512 BF16 dot-product instruction for any number of rows; both read the weights in one
   packed layout. A new prompt's causal attention on tiles is in cpu_attention.c. */
#include "cpu_avx512.h"
#include "cpu_common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* What this build runs (bf16_variants: 1 the dot-product variant, 2 the AMX one as well). */
int gemm_variants(void) { return bf16_variants(); }

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
        for (int64_t r = 0; r < (rows); r++)                                              \
            _mm256_storeu_si256(                                                          \
                (__m256i *)(y + ((row0) + r) * (n / 2) + (col0)),                         \
                silu_mul16_bf16(_mm512_add_ps(_mm512_load_ps(tmp + r * 16), bg),          \
                                _mm512_add_ps(_mm512_load_ps(tmp2 + r * 16), bu)));       \
    } while (0)

#endif

/* y [m, n] (contiguous) = x [m, k] (rows x_stride apart) . W^T + bias, for 1 <= m <= 32,
   n and k multiples of 32: products summed in float32, rounded once to bf16. W [n, k] is
   given as pack_weight lays it out (cpu_gemm.py): 16 output columns by 32 inputs a tile,
   1 KiB each, the input pairs (2i, 2i + 1) of a column side by side, tiles of one
   16-column block in input order, blocks in column order. So block j's weights are one
   run of k / 2 vectors of 16 columns' pairs: what the dot-product variant loads too.

   Each thread takes 16-column blocks j and j + n / 32 at once: two weight streams read
   from memory side by side, the rows of x in two A tiles, four float32 tiles of sums.
   Returns 1 (and writes nothing) for shapes it does not take or without AMX.

   NOTE: at 32 rows the weights are read once and the tiles' arithmetic is cheap, so the
   time is the weight read: on an Intel Xeon with AMX, the 120 matrices of a SmolLM2
   decode step in 9.1 ms on two threads (23 GB/s) against 13.6 ms for oneDNN's packed bf16
   matmul; one stream per thread instead of two read 17 GB/s. */
#ifdef HAVE_AMX
static int amx_linear(const bf16_t *x, int64_t x_stride, int64_t m, int64_t k,
                      const bf16_t *packed, int64_t n, const bf16_t *bias, bf16_t *y,
                      int64_t num_threads, int silu_mul) {
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
}
#endif

#ifdef HAVE_DPBF16
/* The weights of the group a thread runs next: its 2 C blocks' lines (one input pair of a
   block's 16 columns, 64 bytes, each), fetched into L2 while the current group runs, so
   that the next group's first rows find them there instead of waiting on memory.
   - Up to PREFETCH_TILES row tiles (16 rows), where a group's arithmetic is short, its
     lines are spread over the tiles in the order that group reads them, several an input
     pair: a step's linears at 8 and 16 rows ~13-18% faster with it on a Zen 4.
   - From more tiles on, row tile t fetches whole blocks of the next group (t, t + tiles,
     ...): one unconditional prefetch next to each input pair's loads. The spread's
     bookkeeping in that loop cost more than the fetches saved there (with the weights in
     L3, 12-15% slower at 32 rows); one stream a tile took SmolLM2's 120 linears at 32 rows
     from ~21 to ~19 ms, at 20-24 rows 12-20% off, with nothing lost in L3.
   - Beyond PREFETCH_MAX_TILES (128 rows) the weights' read is a small part of a group's
     time, and lines fetched early only crowd the rows of x out of L2: nothing is fetched
     (docs/BENCHMARKS.md). */
#define PREFETCH_TILES 4
#define PREFETCH_MAX_TILES 32
struct next_group {
    const bf16_t *w[6];
    int64_t blocks;  /* 2 C, each `pairs` lines; 0: nothing to fetch */
    int64_t tiles;   /* the row tiles the current group runs */
};

/* Rows [r0, r0 + R) of x against 2 C column blocks: j .. j + C - 1 and, C blocks of sums
   further on, half + j .. half + j + C - 1 (for a gate_up weight, each gate block beside
   its up block). R x 2C sums in registers (at most 4 x 6 = 24 of the 32): per input pair,
   each block's 16 column pairs are loaded once for R rows and each row's pair broadcast
   once for 2C blocks. R and C are constants at every call (the loops unroll). */
static inline __attribute__((always_inline)) void dp_block(
    const bf16_t *x, int64_t x_stride, int64_t r0, const int R, const int C, int64_t j,
    int64_t half, const bf16_t *packed, int64_t pairs, int64_t n, const bf16_t *bias,
    bf16_t *y, int silu_mul, const struct next_group *next, int64_t tile, int64_t rate) {
    __m512 acc[4][6];
    const bf16_t *w[6];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 2 * C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int c = 0; c < C; c++) {
        w[c] = packed + (j + c) * pairs * 32;
        w[C + c] = packed + (half + j + c) * pairs * 32;
    }
    const bf16_t *xr = x + r0 * x_stride;
    /* the next group's lines this tile fetches. Up to PREFETCH_TILES tiles: `rate` an input
       pair, in the order that group reads them (input pair np of each of its blocks in
       turn, block nb, then the next pair). Beyond: the blocks tile, tile + tiles (at most
       two, as tiles > PREFETCH_TILES >= 3), the line of pair p of each beside pair p's. */
    int64_t left = 0, nb = 0, np = 0;
    const bf16_t *s0 = NULL, *s1 = NULL;
    if (next->tiles <= PREFETCH_TILES) {
        const int64_t first = tile * pairs * rate;
        left = next->blocks * pairs - first;
        if (left > 0) nb = first % next->blocks, np = first / next->blocks;
    } else {
        if (tile < next->blocks) s0 = next->w[tile];
        if (tile + next->tiles < next->blocks) s1 = next->w[tile + next->tiles];
    }
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh b[6];
        for (int c = 0; c < 2 * C; c++) b[c] = (__m512bh)_mm512_loadu_si512(w[c] + p * 32);
        if (s0 != NULL) _mm_prefetch((const char *)(s0 + p * 32), _MM_HINT_T1);
        if (s1 != NULL) _mm_prefetch((const char *)(s1 + p * 32), _MM_HINT_T1);
        for (int64_t i = 0; i < rate && left > 0; i++, left--) {
            _mm_prefetch((const char *)(next->w[nb] + np * 32), _MM_HINT_T1);
            if (++nb == next->blocks) nb = 0, np++;
        }
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, xr + r * x_stride + 2 * p, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < 2 * C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
        }
    }
    for (int c = 0; c < C; c++) {
        const int64_t lo = (j + c) * 16, hi = (half + j + c) * 16;
        const __m512 blo = bias != NULL ? widen16_bf16(bias + lo) : _mm512_setzero_ps();
        const __m512 bhi = bias != NULL ? widen16_bf16(bias + hi) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 slo = _mm512_add_ps(acc[r][c], blo);
            const __m512 shi = _mm512_add_ps(acc[r][C + c], bhi);
            if (silu_mul) {
                _mm256_storeu_si256((__m256i *)(y + (r0 + r) * (n / 2) + lo),
                                    silu_mul16_bf16(slo, shi));
            } else {
                _mm256_storeu_si256((__m256i *)(y + (r0 + r) * n + lo), store16_bf16(slo));
                _mm256_storeu_si256((__m256i *)(y + (r0 + r) * n + hi), store16_bf16(shi));
            }
        }
    }
}

/* Column blocks [j, j + C) and their partners, all rows: 4 at a time, then the rest; the
   next group's weights are prefetched over the tiles (tile t: struct next_group). */
#define DP_BLOCK(R, C)                                                                      \
    dp_block(x, x_stride, r0, R, C, j, half, packed, pairs, n, bias, y, silu_mul, &next,    \
             r0 / 4, rate)
#define DP_ROWS(C)                                                                          \
    do {                                                                                    \
        int64_t r0 = 0;                                                                     \
        for (; r0 + 4 <= m; r0 += 4) DP_BLOCK(4, C);                                        \
        switch (m - r0) {                                                                   \
        case 3: DP_BLOCK(3, C); break;                                                      \
        case 2: DP_BLOCK(2, C); break;                                                      \
        case 1: DP_BLOCK(1, C); break;                                                      \
        }                                                                                   \
    } while (0)
#endif

/* The same product (and fused SiLU) on the AVX-512 BF16 dot-product instruction, for any
   m >= 1: sums in float32 in input order, rounded once to bf16 as st_bf16 rounds.

   A thread takes a group of 3 column blocks and their 3 partners (block j + n / 32) at a
   time, and runs all rows of x against them, 4 rows at a time: the six blocks' weights
   are read once and kept in the L2 cache for the rest, while the thread's next group's
   weights are fetched into L2 (struct next_group). On an AMD Zen 4 (2 cores) it runs at
   the bf16 matmul peak from 8 rows to 2,048, where oneDNN's packed matmul reaches it only
   from ~128 rows (docs/BENCHMARKS.md). */
#ifdef HAVE_DPBF16
static int dp_linear(const bf16_t *x, int64_t x_stride, int64_t m, int64_t k,
                     const bf16_t *packed, int64_t n, const bf16_t *bias, bf16_t *y,
                     int64_t num_threads, int silu_mul) {
    if (m < 1 || n % 32 != 0 || k % 32 != 0 || n == 0 || k == 0) return 1;
    const int64_t half = n / 32, pairs = k / 2, groups = (half + 2) / 3;
    /* the row tiles a group runs, over which the next group's lines are fetched (see
       struct next_group) */
    const int64_t tiles = (m + 3) / 4;
    /* Groups are handed out one at a time from a shared counter, each thread taking its
       next group when it starts one (so that it can fetch that group's weights meanwhile):
       a thread the OS takes the core from (the server's event loop, a client on the same
       cores) holds up one group, and the others take the rest of the layer. */
    int64_t taken = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t g = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
        while (g < groups) {
            const int64_t following = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
            const int64_t j = g * 3, blocks = half - j < 3 ? half - j : 3;
            struct next_group next = {.blocks = 0, .tiles = tiles};
            if (following < groups && tiles <= PREFETCH_MAX_TILES) {
                const int64_t nj = following * 3, nc = half - nj < 3 ? half - nj : 3;
                for (int64_t c = 0; c < nc; c++) {
                    next.w[c] = packed + (nj + c) * pairs * 32;
                    next.w[nc + c] = packed + (half + nj + c) * pairs * 32;
                }
                next.blocks = 2 * nc;
            }
            /* up to PREFETCH_TILES tiles: lines an input pair, so that the next group's
               2 C x pairs fit in the tiles (beyond, dp_block takes whole blocks) */
            const int64_t rate =
                tiles <= PREFETCH_TILES ? (next.blocks + tiles - 1) / tiles : 0;
            switch (blocks) {
            case 3: DP_ROWS(3); break;
            case 2: DP_ROWS(2); break;
            default: DP_ROWS(1); break;
            }
            g = following;
        }
    }
    return 0;
}
#endif

/* y = x . W^T + bias ([m, n]), or with silu_mul (a gate_up weight: the n / 2 gate rows,
   then the n / 2 up rows, n a multiple of 64) y [m, n / 2] = silu(gate) * up, equal bit for
   bit to the linear and then silu_mul_bf16 (cpu_ops.c) without the [m, n] intermediate.
   tiles: the AMX variant (m <= 32, the tiles granted), else the dot-product one. Returns 1
   (and writes nothing) for what the chosen variant does not take or this build lacks. */
int gemm_bf16(const bf16_t *x, int64_t x_stride, int64_t m, int64_t k, const bf16_t *packed,
              int64_t n, const bf16_t *bias, bf16_t *y, int64_t num_threads, int silu_mul,
              int tiles) {
    if (silu_mul && n % 64 != 0) return 1;
#ifdef HAVE_AMX
    if (tiles) return amx_linear(x, x_stride, m, k, packed, n, bias, y, num_threads, silu_mul);
#endif
#ifdef HAVE_DPBF16
    if (!tiles) return dp_linear(x, x_stride, m, k, packed, n, bias, y, num_threads, silu_mul);
#endif
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y;
    (void)num_threads, (void)tiles;
    return 1;
}
