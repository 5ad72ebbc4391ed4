/* The fused CPU kernels of cpu_ops.py (see its docstring). MAX_SLICES comes from the
   build (cpu_ops.MAX_SLICES). */
#include "cpu_common.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define DESC_WIDTH (1 + 5 * MAX_SLICES)
#define SILU_CHUNK 512 /* floats of silu_mul's denominators on the stack */

/* logits [S, V] rows stride apart -> ids [S]: each row's first largest value, NaN ranked
   below every number; a row with no number above -inf gets 0. */
void argmax_rows_f32(const float *logits, int64_t stride, int64_t num_rows, int64_t vocab,
                     int64_t *ids, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_rows * vocab >= 262144)
    for (int64_t s = 0; s < num_rows; s++) {
        const float *restrict x = logits + s * stride;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < vocab; i++) {
            const float v = x[i] == x[i] ? x[i] : -INFINITY; /* NaN out first */
            m = v > m ? v : m;
        }
        int64_t best = 0;
        if (m > -INFINITY)
            while (x[best] != m) best++;
        ids[s] = best;
    }
}

#define TYPED_HEADER "cpu_ops_typed.h"
#include "cpu_each_type.h"
#undef TYPED_HEADER

/* bf16 only: in float32 the torch op's rounding is kept (the exact-equality tests compare
   float32 with Hugging Face bit for bit), and it costs little there. */
/* In place: x [T, N, D] (tokens token_stride apart, heads contiguous, pairs (2i, 2i+1))
   rotated by rope [T, D / 2] (cos, sin) pairs, rope_stride floats apart, in float32 and
   rounded once: (x0 + i x1) (cos + i sin). */
void rope_interleaved_bf16(bf16_t *x, int64_t token_stride, int64_t num_tokens,
                        int64_t num_heads, int64_t head_dim, const float *rope,
                        int64_t rope_stride, int64_t num_threads) {
    const int64_t work = num_tokens * num_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) if (work >= 262144)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *restrict cs = rope + t * rope_stride;
        for (int64_t h = 0; h < num_heads; h++) {
            bf16_t *restrict xh = x + t * token_stride + h * head_dim;
            for (int64_t i = 0; i < head_dim / 2; i++) {
                const float x0 = ld_bf16(xh[2 * i]), x1 = ld_bf16(xh[2 * i + 1]);
                const float c = cs[2 * i], sn = cs[2 * i + 1];
                xh[2 * i] = st_bf16(x0 * c - x1 * sn);
                xh[2 * i + 1] = st_bf16(x0 * sn + x1 * c);
            }
        }
    }
}
