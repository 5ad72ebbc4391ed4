/* What the CPU kernels share: the dot product, bfloat16 storage and e^x. Included by
   every kernel source next to it (cpu_build.py builds each source with this directory on
   the include path). */
#ifndef LORAPLEX_CPU_COMMON_H
#define LORAPLEX_CPU_COMMON_H

#include <stddef.h>
#include <stdint.h>

/* A kernel tile's rows spelled out: ROWS_R(M) is M(0) ... M(R - 1), so that each row's
   sums are a named register (gcc kept an array of them in memory, at half the speed). */
#define ROWS_1(M) M(0)
#define ROWS_2(M) M(0) M(1)
#define ROWS_4(M) M(0) M(1) M(2) M(3)
#define ROWS_6(M) ROWS_4(M) M(4) M(5)
#define ROWS_8(M) ROWS_4(M) M(4) M(5) M(6) M(7)
#define ROWS_12(M) ROWS_8(M) M(8) M(9) M(10) M(11)

/* The dot product in 8 independent lanes, vectorized without reassociating a sum (so a
   build's results do not depend on the compiler's choices). */
static inline __attribute__((always_inline)) float dot(const float *restrict a,
                                                       const float *restrict b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[d + k] * b[d + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* bfloat16 storage for the kernels built for both types (the *_typed.h headers): values
   are read into float32, computed in float32 and rounded to nearest even when stored, as
   torch rounds (a NaN stays a quiet NaN). */
typedef uint16_t bf16_t;

static inline __attribute__((always_inline)) float ld_f32(float v) { return v; }
static inline __attribute__((always_inline)) float st_f32(float v) { return v; }

static inline __attribute__((always_inline)) float ld_bf16(bf16_t v) {
    const union { uint32_t i; float f; } u = {.i = (uint32_t)v << 16};
    return u.f;
}

static inline __attribute__((always_inline)) bf16_t st_bf16(float v) {
    const union { float f; uint32_t i; } u = {.f = v};
    if ((u.i & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u.i >> 16) | 0x40u);
    return (bf16_t)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}

/* The dot product of two bf16 rows in float32: on AVX-512 BF16, pairs of products summed
   by the dot-product unit (each product exact, the sums rounded to nearest); elsewhere in
   16 lanes, as dot() (no reassociation left to the compiler). */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
static inline __attribute__((always_inline)) float dot_bf16(const bf16_t *restrict a,
                                                            const bf16_t *restrict b,
                                                            int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= n; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d),
                               (__m512bh)_mm512_loadu_si512(b + d));
    float s = _mm512_reduce_add_ps(acc);
    for (; d < n; d++) s += ld_bf16(a[d]) * ld_bf16(b[d]);
    return s;
}
#else
static inline __attribute__((always_inline)) float dot_bf16(const bf16_t *restrict a,
                                                            const bf16_t *restrict b,
                                                            int64_t n) {
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int k = 0; k < 16; k++) acc[k] += ld_bf16(a[d + k]) * ld_bf16(b[d + k]);
    for (int k = 0; k < 8; k++) acc[k] += acc[k + 8];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; d < n; d++) s += ld_bf16(a[d]) * ld_bf16(b[d]);
    return s;
}
#endif

static inline __attribute__((always_inline)) float dot_f32(const float *restrict a,
                                                           const float *restrict b, int64_t n) {
    return dot(a, b, n);
}

/* e^x to a few float32 ulps, in plain C that vectorizes: x = n ln2 + r, |r| <= ln2 / 2,
   e^r by Cephes' polynomial, 2^n by the exponent bits. x is clamped to [-87.3, 88.3] so
   that 2^n stays normal (e^x below e^-87.3 is 0 to what callers can tell). */
static inline __attribute__((always_inline)) float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    /* round to nearest by the 1.5 * 2^23 trick: floorf would keep the loop scalar */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float er = p * (r * r) + r + 1.0f;
    const union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return er * scale.f;
}

/* A row into memory that is not read again soon (the K/V cache: a slot is written once,
   and the cache is far larger than the CPU's caches). Whole 64-byte lines go out as
   streaming stores, which skip reading each line from memory before writing it: that read
   was 90% of the K/V write of a decode step (4.3 of 4.8 ms at 32 rows, 30 layers). Any
   other row is copied. store_rows_done() orders the streaming stores before later loads
   and stores of any thread. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __attribute__((always_inline)) void store_row(void *dst, const void *src,
                                                            int64_t nbytes) {
    if (((uintptr_t)dst & 63) == 0 && (nbytes & 63) == 0) {
        for (int64_t i = 0; i < nbytes; i += 64)
            _mm512_stream_si512((void *)((char *)dst + i),
                                _mm512_loadu_si512((const char *)src + i));
    } else {
        __builtin_memcpy(dst, src, (size_t)nbytes);
    }
}
static inline __attribute__((always_inline)) void store_rows_done(void) { _mm_sfence(); }
#else
static inline __attribute__((always_inline)) void store_row(void *dst, const void *src,
                                                            int64_t nbytes) {
    __builtin_memcpy(dst, src, (size_t)nbytes);
}
static inline __attribute__((always_inline)) void store_rows_done(void) {}
#endif

#endif /* LORAPLEX_CPU_COMMON_H */
