/* AVX-512 helpers shared by the bf16 kernels (cpu_amx.c, cpu_attention.c): e^x in 16 lanes
   and bf16 rows widened to float32 and narrowed back. Empty on CPUs without AVX-512. */
#ifndef LORAPLEX_CPU_AVX512_H
#define LORAPLEX_CPU_AVX512_H

#include "cpu_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_f32 (cpu_common.h) in 16 lanes, step for step as the compiler builds it there (its
   multiply-adds fused), so that the fused SiLU of cpu_amx.c equals silu_mul's bit for bit.
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

#if defined(__AVX512BF16__)
/* float32 x 16 -> bf16 x 16, rounded to nearest even. */
static inline __attribute__((always_inline)) __m256i narrow16(__m512 v) {
    return (__m256i)_mm512_cvtneps_pbh(v);
}
#endif
#endif /* __AVX512F__ */

#endif /* LORAPLEX_CPU_AVX512_H */
