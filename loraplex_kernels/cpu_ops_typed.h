/* The kernels of cpu_ops.c built once per storage type (through cpu_each_type.h):
   `scalar_t` the C type and SFX(name) the name with its suffix (name_f32, name_bf16), so
   SFX(ld) and SFX(st) are the matching load and store. No include guard.
   bfloat16 is computed in float32 and rounded where the torch ops of the Hugging Face
   model round. */

/* One row: o = xr / sqrt(mean(xr^2) + eps) * weight. The normalized row is rounded to the
   storage type before the weight multiplies it, as HF's RMSNorm does. */
static inline __attribute__((always_inline)) void SFX(rms_norm_row)(
    const scalar_t *restrict xr, const scalar_t *restrict weight, scalar_t *restrict o,
    int64_t hidden, float eps) {
    double ss = 0.0;
    /* in double lanes: a serial chain of double adds was 20-30 us at 32 rows of 576 */
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < hidden; i++) {
        const double v = (double)SFX(ld)(xr[i]);
        ss += v * v;
    }
    const float inv = (float)(1.0 / sqrt(ss / (double)hidden + (double)eps));
    for (int64_t i = 0; i < hidden; i++)
        o[i] = SFX(st)(SFX(ld)(SFX(st)(SFX(ld)(xr[i]) * inv)) * SFX(ld)(weight[i]));
}

/* x [T, H] rows x_stride apart, weight [H], out [T, H] contiguous. */
void SFX(rms_norm)(const scalar_t *x, int64_t x_stride, const scalar_t *weight, scalar_t *out,
                int64_t num_rows, int64_t hidden, float eps, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_rows * hidden >= 65536)
    for (int64_t t = 0; t < num_rows; t++)
        SFX(rms_norm_row)(x + t * x_stride, weight, out + t * hidden, hidden, eps);
}

/* A decoder layer's residual add and the norm after it, in one pass over the rows:
   residual [T, H] (contiguous) = x [T, H] (rows x_stride apart) + residual, rounded to the
   storage type as torch's add is, then out [T, H] = rms_norm(residual). */
void SFX(add_rms_norm)(const scalar_t *x, int64_t x_stride, scalar_t *residual,
                    const scalar_t *weight, scalar_t *out, int64_t num_rows, int64_t hidden,
                    float eps, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_rows * hidden >= 65536)
    for (int64_t t = 0; t < num_rows; t++) {
        const scalar_t *restrict xr = x + t * x_stride;
        scalar_t *restrict r = residual + t * hidden;
        for (int64_t i = 0; i < hidden; i++) r[i] = SFX(st)(SFX(ld)(xr[i]) + SFX(ld)(r[i]));
        SFX(rms_norm_row)(r, weight, out + t * hidden, hidden, eps);
    }
}

/* gate_up [T, 2 I] rows stride apart (gate first, then up); out [T, I] contiguous:
   out = gate / (1 + e^-gate) * up, the SiLU rounded before the product. NaN stays NaN
   (the clamp leaves the numerator). */
void SFX(silu_mul)(const scalar_t *gate_up, int64_t stride, scalar_t *out, int64_t num_rows,
                int64_t inter, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_rows * inter >= 32768)
    for (int64_t t = 0; t < num_rows; t++) {
        const scalar_t *restrict g = gate_up + t * stride;
        const scalar_t *restrict u = g + inter;
        scalar_t *restrict o = out + t * inter;
        /* NOTE: the denominators in one loop, the quotients in another: gcc 12 made the
           single loop (e^x, the divide and the product together) 12x slower on an Intel
           Xeon with AMX (290 against 24 us for 32 rows of 1,536); on Zen 4 it was not. */
        float den[SILU_CHUNK];
        for (int64_t lo = 0; lo < inter; lo += SILU_CHUNK) {
            const int64_t n = inter - lo < SILU_CHUNK ? inter - lo : SILU_CHUNK;
            for (int64_t i = 0; i < n; i++) den[i] = 1.0f + exp_f32(-SFX(ld)(g[lo + i]));
            for (int64_t i = 0; i < n; i++)
                o[lo + i] = SFX(st)(SFX(ld)(SFX(st)(SFX(ld)(g[lo + i]) / den[i]))
                                    * SFX(ld)(u[lo + i]));
        }
    }
}

/* key/value [T, row] rows key_stride / value_stride apart; caches [num_slots, row]
   contiguous; slots [T]. Returns 1, writing nothing, when a slot is out of range. */
int SFX(write_kv)(const scalar_t *key, int64_t key_stride, const scalar_t *value,
               int64_t value_stride, scalar_t *key_cache, scalar_t *value_cache,
               const int64_t *slots, int64_t num_tokens, int64_t row, int64_t num_slots,
               int64_t num_threads) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
#pragma omp parallel num_threads(num_threads) if (num_tokens * row >= 262144)
    {
#pragma omp for
        for (int64_t t = 0; t < num_tokens; t++) {
            store_row(key_cache + slots[t] * row, key + t * key_stride,
                      sizeof(scalar_t) * row);
            store_row(value_cache + slots[t] * row, value + t * value_stride,
                      sizeof(scalar_t) * row);
        }
        store_rows_done(); /* each thread its own streaming stores */
    }
    return 0;
}

/* One row, slice by slice: y[lo:hi] += ((x . A_k rows) times B_k^T) * scale_k, in float32
   and rounded once into y. shrunk: scratch of max_rank floats; delta: scratch of
   out_features floats. */
static void SFX(lora_row)(const scalar_t *restrict x, scalar_t *restrict y, const int64_t *d,
                       const float *scales, int64_t in_features, float *restrict shrunk,
                       float *restrict delta) {
    for (int64_t k = 0; k < d[0]; k++) {
        const int64_t *sl = d + 1 + 5 * k;
        const scalar_t *a = (const scalar_t *)(intptr_t)sl[0];
        const scalar_t *b_t = (const scalar_t *)(intptr_t)sl[1];
        const int64_t r = sl[2], lo = sl[3], width = sl[4] - sl[3];
        for (int64_t j = 0; j < r; j++) shrunk[j] = SFX(dot)(x, a + j * in_features, in_features);
        for (int64_t c = 0; c < width; c++) delta[c] = 0.0f;
        for (int64_t j = 0; j < r; j++) {
            const float s = shrunk[j];
            const scalar_t *restrict bj = b_t + j * width;
            for (int64_t c = 0; c < width; c++) delta[c] += s * SFX(ld)(bj[c]);
        }
        const float scale = scales[k];
        scalar_t *restrict yk = y + lo;
        for (int64_t c = 0; c < width; c++) yk[c] = SFX(st)(SFX(ld)(yk[c]) + delta[c] * scale);
    }
}

/* x [T, IN] rows x_stride apart; y [T, OUT] rows y_stride apart, updated in place;
   token_indices [N]; segments [G, 3] (start, end, slot) into token_indices; desc
   [num_slots, DESC_WIDTH] and scales [num_slots, MAX_SLICES] per slot (0 slices: no
   adapter in this group). Returns 1 when scratch memory could not be had. */
int SFX(lora_segments)(const scalar_t *x, int64_t x_stride, scalar_t *y, int64_t y_stride,
                    const int64_t *token_indices, const int64_t *segments,
                    int64_t num_segments, const int64_t *desc, const float *scales,
                    int64_t in_features, int64_t out_features, int64_t max_rank,
                    int64_t num_threads) {
    int failed = 0;
    const int64_t num_rows = segments[3 * (num_segments - 1) + 1];
#pragma omp parallel num_threads(num_threads) if (num_rows > 1)
    {
        float *scratch = (float *)malloc(sizeof(float) * (max_rank + out_features));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* Whole segments per thread when there are enough to share out, so that each
           adapter's weights come from memory once, into one core's cache; else rows. */
        const int64_t per_segment = num_segments >= 2 * num_threads;
        const int64_t items = per_segment ? num_segments : num_rows;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            int64_t g = 0, first = item, last = item + 1;
            if (per_segment) {
                g = item;
                first = segments[3 * g];
                last = segments[3 * g + 1];
            } else {
                while (item >= segments[3 * g + 1]) g++;
            }
            const int64_t slot = segments[3 * g + 2];
            for (int64_t n = first; n < last && scratch != NULL; n++) {
                const int64_t t = token_indices[n];
                SFX(lora_row)(x + t * x_stride, y + t * y_stride, desc + slot * DESC_WIDTH,
                           scales + slot * MAX_SLICES, in_features, scratch,
                           scratch + max_rank);
            }
        }
        free(scratch);
    }
    return failed;
}
