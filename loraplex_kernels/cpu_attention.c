/* bf16 causal attention of a new prompt, in flash attention's order (see cpu_attention.py):
   the two products on AMX tiles where the CPU has them, else on the AVX-512 BF16
   dot-product instruction. */
#include "cpu_avx512.h"
#include "cpu_common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* What this build runs (bf16_variants: 1 the dot-product variant, 2 the AMX one as well,
   which needs the tiles granted to the process first: cpu_gemm.c amx_ready). */
int causal_attention_variants(void) { return bf16_variants(); }

#ifdef HAVE_DPBF16
/* One 32-bit pair of bf16 values (a query's dims 2i and 2i + 1, or a row's probabilities of
   keys 2i and 2i + 1) in every lane. */
static inline __attribute__((always_inline)) __m512bh pair16(const bf16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* s [16 rows][32 keys] = the 16 query rows of qpad [16][hd] . the 32 keys of two K^T
   blocks (kt0, then kt0 + nks * 512: 16 keys each, dim pair i of the block's keys at
   i * 32). 8 rows at a time: 16 sums in registers, each dim pair of a key block loaded
   once for 8 rows. */
static inline __attribute__((always_inline)) void scores_dp(const bf16_t *qpad,
                                                            const bf16_t *kt0, int64_t nks,
                                                            int64_t hd, float *s) {
    const bf16_t *kt1 = kt0 + nks * 512;
    for (int64_t r0 = 0; r0 < 16; r0 += 8) {
        __m512 a[8], b[8];
        for (int i = 0; i < 8; i++) a[i] = b[i] = _mm512_setzero_ps();
        for (int64_t pr = 0; pr < hd / 2; pr++) {
            const __m512bh ka = (__m512bh)_mm512_loadu_si512(kt0 + pr * 32);
            const __m512bh kb = (__m512bh)_mm512_loadu_si512(kt1 + pr * 32);
            for (int i = 0; i < 8; i++) {
                const __m512bh qq = pair16(qpad + (r0 + i) * hd + 2 * pr);
                a[i] = _mm512_dpbf16_ps(a[i], qq, ka);
                b[i] = _mm512_dpbf16_ps(b[i], qq, kb);
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_store_ps(s + (r0 + i) * 32, a[i]);
            _mm512_store_ps(s + (r0 + i) * 32 + 16, b[i]);
        }
    }
}

/* o [16 rows][hd] += p [16 rows][32 keys] . the V block at vt0 (dim block j of 16 dims at
   j * 512: key pair i's 16 dims, interleaved, at i * 32). 8 rows by 2 dim blocks at a
   time: 16 sums in registers. */
static inline __attribute__((always_inline)) void add_pv_dp(const bf16_t *p,
                                                            const bf16_t *vt0, int64_t hd,
                                                            float *o) {
    for (int64_t r0 = 0; r0 < 16; r0 += 8) {
        for (int64_t db = 0; db < hd / 16; db += 2) {
            __m512 a[8], b[8];
            for (int i = 0; i < 8; i++) a[i] = b[i] = _mm512_setzero_ps();
            for (int64_t kp = 0; kp < 16; kp++) {
                const __m512bh va = (__m512bh)_mm512_loadu_si512(vt0 + db * 512 + kp * 32);
                const __m512bh vb = (__m512bh)_mm512_loadu_si512(vt0 + (db + 1) * 512 + kp * 32);
                for (int i = 0; i < 8; i++) {
                    const __m512bh pp = pair16(p + (r0 + i) * 32 + 2 * kp);
                    a[i] = _mm512_dpbf16_ps(a[i], pp, va);
                    b[i] = _mm512_dpbf16_ps(b[i], pp, vb);
                }
            }
            for (int i = 0; i < 8; i++) {
                float *row = o + (r0 + i) * hd + db * 16;
                _mm512_store_ps(row, _mm512_add_ps(_mm512_load_ps(row), a[i]));
                _mm512_store_ps(row + 16, _mm512_add_ps(_mm512_load_ps(row + 16), b[i]));
            }
        }
    }
}
#endif

/* Causal attention of one sequence with nothing cached before it, in bf16: q [len, heads,
   hd] (rows q_stride apart), k and v [len, kv_heads, hd] (rows k_stride, v_stride apart),
   out [len, heads, hd] contiguous; query head h reads KV head h / (heads / kv_heads).
   hd a multiple of 32, at most 256. tiles: 1 on AMX tiles (granted to the process), 0 on
   the AVX-512 BF16 dot-product instruction.

   Flash attention's order: for each KV head K^T and V are first laid out in pairs, as AMX
   tiles take them (work: (len rounded up to 32) * hd * 2 * kv_heads bf16 values); then for
   16 query rows of one head at a time, 32 keys at a time up to the diagonal: the scores in
   float32, an online softmax in float32, the probabilities rounded to bf16 (as torch's
   flash kernel rounds them for its second matmul) and their product with V, summed in
   float32. Returns 1 for a variant this build does not have or shapes it does not take. */
int causal_attention_bf16(const bf16_t *q, int64_t q_stride, const bf16_t *k,
                          int64_t k_stride, const bf16_t *v, int64_t v_stride, bf16_t *out,
                          int64_t len, int64_t heads, int64_t kv_heads, int64_t hd,
                          float scale, bf16_t *work, int64_t num_threads, int64_t tiles) {
#ifdef HAVE_DPBF16
#ifndef HAVE_AMX
    if (tiles) return 1;
#endif
    if (len < 1 || hd % 32 != 0 || hd > 256 || heads % kv_heads != 0) return 1;
    const int64_t groups = heads / kv_heads, kpad = (len + 31) / 32 * 32, nks = hd / 32;
    /* K^T: [kv_head][key block of 16][k-step][16 dim pairs][16 keys][2];
       V:   [kv_head][key block of 32][dim block of 16][16 key pairs][16 dims][2] */
    bf16_t *kt = work, *vt = work + kv_heads * kpad * hd;
    const int64_t q_blocks = (len + 15) / 16;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < kv_heads * (kpad / 16); item++) {
            const int64_t kh = item / (kpad / 16), kb = item % (kpad / 16);
            /* K^T: row r of a k-step holds dims (2r, 2r + 1) of the block's 16 keys, one
               32-bit pair each: key c's 16 pairs go down column c */
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
                /* V: row r holds keys (2r, 2r + 1) of 16 dims, interleaved */
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
        /* the implicit barrier: every pair laid out before any is read */
#ifdef HAVE_AMX
        if (tiles) {
            TileConfig cfg;
            memset(&cfg, 0, sizeof cfg);
            cfg.palette = 1;
            for (int t = 0; t < 8; t++) {
                cfg.rows[t] = 16;
                cfg.colsb[t] = 64;
            }
            _tile_loadconfig(&cfg);
        }
        float pv[16 * 16] __attribute__((aligned(64)));
#endif
        float s[16 * 32] __attribute__((aligned(64)));
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
                const bf16_t *kt0 = kt + ((kh * (kpad / 16) + k0 / 16) * nks) * 512;
#ifdef HAVE_AMX
                if (tiles) {
                    _tile_zero(0);
                    _tile_zero(1);
                    for (int64_t ks = 0; ks < nks; ks++) {
                        _tile_loadd(2, qpad + ks * 32, hd * 2);
                        _tile_loadd(3, kt0 + ks * 512, 64);
                        _tile_dpbf16ps(0, 2, 3);
                        _tile_loadd(3, kt0 + (nks + ks) * 512, 64);
                        _tile_dpbf16ps(1, 2, 3);
                    }
                    _tile_stored(0, s, 128);
                    _tile_stored(1, s + 16, 128);
                } else
#endif
                    scores_dp(qpad, kt0, nks, hd, s);
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
                const bf16_t *vt0 = vt + ((kh * (kpad / 32) + k0 / 32) * (hd / 16)) * 512;
#ifdef HAVE_AMX
                if (tiles) {
                    _tile_loadd(4, p, 64);
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
                } else
#endif
                    add_pv_dp(p, vt0, hd, o);
            }
            for (int64_t r = 0; r < rows; r++) {
                const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
                bf16_t *dst = out + ((q0 + r) * heads + h) * hd;
                for (int64_t d = 0; d < hd; d += 16)
                    _mm256_storeu_si256((__m256i *)(dst + d),
                                        narrow16(_mm512_mul_ps(inv, _mm512_load_ps(o + r * hd + d))));
            }
        }
#ifdef HAVE_AMX
        if (tiles) _tile_release();
#endif
    }
    return 0;
#else
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out;
    (void)len, (void)heads, (void)kv_heads, (void)hd, (void)scale, (void)work;
    (void)num_threads, (void)tiles;
    return 1;
#endif
}
