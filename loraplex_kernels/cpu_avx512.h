/* AVX-512 helpers shared by the bf16 kernels (cpu_gemm.c, cpu_attention.c): e^x in 16 lanes,
   bf16 rows widened to float32 and narrowed back, and SiLU-and-multiply of 16 columns. Empty on CPUs without AVX-512. */
#ifndef LORAPLEX_CPU_AVX512_H
#define LORAPLEX_CPU_AVX512_H

#include "cpu_common.h"

/* What a bf16 kernel of this build can run on: the AVX-512 BF16 dot-product instruction, and
   AMX tiles as well (which need the tiles granted to the process first: cpu_gemm.c
   amx_ready). */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#endif
#endif

#ifdef HAVE_AMX
/* The tile configuration _tile_loadconfig reads (palette 1). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;
#endif

/* Those as the variant bits a kernel library reports: 1 the dot-product variant, 2 (as
   well) the AMX one. */
static inline int bf16_variants(void) {
    int variants = 0;
#ifdef HAVE_DPBF16
    variants |= 1;
#endif
#ifdef HAVE_AMX
    variants |= 2;
#endif
    return variants;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_f32 (cpu_common.h) in 16 lanes, step for step as the compiler builds it there (its
   multiply-adds fused), so that the fused SiLU of cpu_gemm.c equals silu_mul's bit for bit.
   x is clamped to [-87.3, 88.3]: a caller zeroes what must be exactly 0. */
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

/* bf16 x 16 -> float32 x 16 (exact). */
static inline __attribute__((always_inline)) __m512 widen16_bf16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

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

/* float32 x 16 -> bf16 x 16 as st_bf16 rounds each (denormals kept, unlike the
   instruction's conversion). */
static inline __attribute__((always_inline)) __m256i store16_bf16(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round16_bf16(v)), 16));
}

/* 16 columns of a gate_up product's float32 sums (bias added): gate and up rounded to bf16
   as a linear layer stores them, then silu_mul's steps (cpu_ops_typed.h), so that a fused
   pass equals the linear and then silu_mul_bf16 bit for bit. */
static inline __attribute__((always_inline)) __m256i silu_mul16_bf16(__m512 gate_sum,
                                                                    __m512 up_sum) {
    const __m512 g = round16_bf16(gate_sum), u = round16_bf16(up_sum);
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f),
                                     exp16(_mm512_xor_ps(g, _mm512_set1_ps(-0.0f))));
    return store16_bf16(_mm512_mul_ps(round16_bf16(_mm512_div_ps(g, den)), u));
}

#if defined(__AVX512BF16__)
/* float32 x 16 -> bf16 x 16, rounded to nearest even. */
static inline __attribute__((always_inline)) __m256i narrow16(__m512 v) {
    return (__m256i)_mm512_cvtneps_pbh(v);
}
#endif
#endif /* __AVX512F__ */

#endif /* LORAPLEX_CPU_AVX512_H */
