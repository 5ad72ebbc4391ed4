/* bf16 on AMX tiles: linear layers of few rows, and a new prompt's causal attention (see cpu_amx.py). */
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

/* exp_f32 (cpu_common.h) in 16 lanes, step for step as the compiler builds it there (its
   multiply-adds fused), so that the fused SiLU below equals silu_mul's bit for bit. x is
   clamped to [-87.3, 88.3]: a caller zeroes what must be exactly 0. */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    /* the constant first: a NaN x stays NaN, as the scalar comparisons keep it */
    x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
    x = _mm512_min_ps(_mm512_set1_ps(88.3f), x);
    const __m512 big = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), big), big);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 er = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
                                    _mm512_set1_ps(1.0f));
    const __m512i scale = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(er, _mm512_castsi512_ps(scale));
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

static inline __attribute__((always_inline)) __m512 widen16_bf16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
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

#ifdef HAVE_AMX
/* float32 x 16 -> bf16 x 16, rounded to nearest even. */
static inline __attribute__((always_inline)) __m256i narrow16(__m512 v) {
    return (__m256i)_mm512_cvtneps_pbh(v);
}
#endif

/* Causal attention of one sequence with nothing cached before it, in bf16: q [len, heads,
   hd] (rows q_stride apart), k and v [len, kv_heads, hd] (rows k_stride, v_stride apart),
   out [len, heads, hd] contiguous; query head h reads KV head h / (heads / kv_heads).
   hd a multiple of 32, at most 256.

   On AMX tiles, flash attention's order: for each KV head K^T and V are first laid out as
   tiles (work: (len rounded up to 32) * hd * 2 * kv_heads bf16 values); then for 16 query
   rows of one head at a time, 32 keys at a time up to the diagonal: the scores in two
   float32 tiles, an online softmax in float32, the probabilities rounded to bf16 (as
   torch's flash kernel rounds them for its second matmul) and their product with V in
   tiles, summed in float32. Returns 1 without AMX or for shapes it does not take. */
int amx_causal_attention_bf16(const bf16_t *q, int64_t q_stride, const bf16_t *k,
                              int64_t k_stride, const bf16_t *v, int64_t v_stride,
                              bf16_t *out, int64_t len, int64_t heads, int64_t kv_heads,
                              int64_t hd, float scale, bf16_t *work, int64_t num_threads) {
#ifdef HAVE_AMX
    if (len < 1 || hd % 32 != 0 || hd > 256 || heads % kv_heads != 0) return 1;
    const int64_t groups = heads / kv_heads, kpad = (len + 31) / 32 * 32, nks = hd / 32;
    /* K^T tiles: [kv_head][key block of 16][k-step][16 dim pairs][16 keys][2];
       V tiles:   [kv_head][key block of 32][dim block of 16][16 key pairs][16 dims][2] */
    bf16_t *kt = work, *vt = work + kv_heads * kpad * hd;
    const int64_t q_blocks = (len + 15) / 16;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < kv_heads * (kpad / 16); item++) {
            const int64_t kh = item / (kpad / 16), kb = item % (kpad / 16);
            /* K^T: tile row r holds dims (2r, 2r + 1) of the block's 16 keys, one 32-bit
               pair each: key c's 16 pairs go down column c */
            const __m512i down = _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(16));
            for (int64_t ks = 0; ks < nks; ks++) {
                bf16_t *dst = kt + ((kh * (kpad / 16) + kb) * nks + ks) * 512;
                for (int64_t c = 0; c < 16; c++) {
                    const int64_t key = kb * 16 + c;
                    const __m512i row = key < len ? _mm512_loadu_si512(
                        k + key * k_stride + kh * hd + ks * 32) : _mm512_setzero_si512();
                    _mm512_i32scatter_epi32((int *)dst + c, down, row, 4);
                }
            }
            if (kb % 2 == 0) {
                /* V: tile row r holds keys (2r, 2r + 1) of 16 dims, interleaved */
                const int64_t vb = kb / 2;
                for (int64_t db = 0; db < hd / 16; db++) {
                    bf16_t *dst = vt + ((kh * (kpad / 32) + vb) * (hd / 16) + db) * 512;
                    for (int64_t r = 0; r < 16; r++) {
                        const int64_t k0 = vb * 32 + 2 * r;
                        const __m256i a = k0 < len ? _mm256_loadu_si256((const __m256i *)(
                            v + k0 * v_stride + kh * hd + db * 16)) : _mm256_setzero_si256();
                        const __m256i b = k0 + 1 < len ? _mm256_loadu_si256((const __m256i *)(
                            v + (k0 + 1) * v_stride + kh * hd + db * 16)) : _mm256_setzero_si256();
                        const __m256i lo = _mm256_unpacklo_epi16(a, b);
                        const __m256i hi = _mm256_unpackhi_epi16(a, b);
                        _mm256_storeu_si256((__m256i *)(dst + r * 32),
                                            _mm256_permute2x128_si256(lo, hi, 0x20));
                        _mm256_storeu_si256((__m256i *)(dst + r * 32 + 16),
                                            _mm256_permute2x128_si256(lo, hi, 0x31));
                    }
                }
            }
        }
        /* the implicit barrier: every tile laid out before any is read */
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        float s[16 * 32] __attribute__((aligned(64)));
        float pv[16 * 16] __attribute__((aligned(64)));
        float o[16 * 256] __attribute__((aligned(64)));
        bf16_t p[16 * 32] __attribute__((aligned(64)));
        float m[16], l[16];
        bf16_t qpad[16 * 256] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < heads * q_blocks; item++) {
            /* the longest query blocks first: they have the most keys */
            const int64_t h = item % heads, qb = q_blocks - 1 - item / heads;
            const int64_t kh = h / groups, q0 = qb * 16;
            const int64_t rows = len - q0 < 16 ? len - q0 : 16;
            /* the query rows as a contiguous 16-row block (zero rows past the end) */
            for (int64_t r = 0; r < 16; r++)
                for (int64_t d = 0; d < hd; d++)
                    qpad[r * hd + d] = r < rows ? q[(q0 + r) * q_stride + h * hd + d] : 0;
            for (int64_t r = 0; r < 16; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            memset(o, 0, sizeof(float) * 16 * hd);
            const int64_t last_key = q0 + rows - 1;
            for (int64_t k0 = 0; k0 <= last_key; k0 += 32) {
                _tile_zero(0);
                _tile_zero(1);
                const bf16_t *kt0 = kt + ((kh * (kpad / 16) + k0 / 16) * nks) * 512;
                for (int64_t ks = 0; ks < nks; ks++) {
                    _tile_loadd(2, qpad + ks * 32, hd * 2);
                    _tile_loadd(3, kt0 + ks * 512, 64);
                    _tile_dpbf16ps(0, 2, 3);
                    _tile_loadd(3, kt0 + (nks + ks) * 512, 64);
                    _tile_dpbf16ps(1, 2, 3);
                }
                _tile_stored(0, s, 128);
                _tile_stored(1, s + 16, 128);
                for (int64_t r = 0; r < 16; r++) {
                    __m512 a = _mm512_mul_ps(_mm512_load_ps(s + r * 32), _mm512_set1_ps(scale));
                    __m512 b = _mm512_mul_ps(_mm512_load_ps(s + r * 32 + 16), _mm512_set1_ps(scale));
                    /* keys after this row's query (and past the sequence) are masked */
                    const int64_t allowed = r < rows ? q0 + r - k0 + 1 : 0; /* keys k0.. */
                    const __mmask16 ma = allowed >= 16 ? 0xffff : (allowed <= 0 ? 0 : (__mmask16)((1u << allowed) - 1u));
                    const __mmask16 mb = allowed >= 32 ? 0xffff : (allowed <= 16 ? 0 : (__mmask16)((1u << (allowed - 16)) - 1u));
                    if (!ma) { /* nothing visible in these 32 keys (a padding row) */
                        _mm256_store_si256((__m256i *)(p + r * 32), _mm256_setzero_si256());
                        _mm256_store_si256((__m256i *)(p + r * 32 + 16), _mm256_setzero_si256());
                        continue;
                    }
                    a = _mm512_mask_blend_ps(ma, _mm512_set1_ps(-INFINITY), a);
                    b = _mm512_mask_blend_ps(mb, _mm512_set1_ps(-INFINITY), b);
                    const float top = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
                    const float m_new = top > m[r] ? top : m[r];
                    const float alpha = exp_f32(m[r] - m_new);
                    const __m512 ea = _mm512_maskz_mov_ps(ma, exp16(_mm512_sub_ps(a, _mm512_set1_ps(m_new))));
                    const __m512 eb = _mm512_maskz_mov_ps(mb, exp16(_mm512_sub_ps(b, _mm512_set1_ps(m_new))));
                    l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(ea, eb));
                    m[r] = m_new;
                    _mm256_store_si256((__m256i *)(p + r * 32), narrow16(ea));
                    _mm256_store_si256((__m256i *)(p + r * 32 + 16), narrow16(eb));
                    if (alpha != 1.0f) {
                        const __m512 av = _mm512_set1_ps(alpha);
                        for (int64_t d = 0; d < hd; d += 16)
                            _mm512_store_ps(o + r * hd + d, _mm512_mul_ps(av, _mm512_load_ps(o + r * hd + d)));
                    }
                }
                _tile_loadd(4, p, 64);
                const bf16_t *vt0 = vt + ((kh * (kpad / 32) + k0 / 32) * (hd / 16)) * 512;
                for (int64_t db = 0; db < hd / 16; db++) {
                    _tile_zero(6);
                    _tile_loadd(5, vt0 + db * 512, 64);
                    _tile_dpbf16ps(6, 4, 5);
                    _tile_stored(6, pv, 64);
                    for (int64_t r = 0; r < rows; r++)
                        _mm512_store_ps(o + r * hd + db * 16,
                                        _mm512_add_ps(_mm512_load_ps(o + r * hd + db * 16),
                                                      _mm512_load_ps(pv + r * 16)));
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
                bf16_t *dst = out + ((q0 + r) * heads + h) * hd;
                for (int64_t d = 0; d < hd; d += 16)
                    _mm256_storeu_si256((__m256i *)(dst + d),
                                        narrow16(_mm512_mul_ps(inv, _mm512_load_ps(o + r * hd + d))));
            }
        }
        _tile_release();
    }
    return 0;
#else
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out;
    (void)len, (void)heads, (void)kv_heads, (void)hd, (void)scale, (void)work;
    (void)num_threads;
    return 1;
#endif
}
