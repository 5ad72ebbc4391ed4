/* Paged decode attention built once per storage type: the query, the cache and the output
   in `scalar_t`; scores, softmax and the weighted sum in float32. Included by
   cpu_decode.c once per type through cpu_each_type.h; no guard. */

typedef struct {
    const scalar_t *query;
    int64_t q_stride;
    const scalar_t *key_cache;
    const scalar_t *value_cache;
    const int64_t *block_tables;
    int64_t table_stride;
    const int64_t *context_lens;
    scalar_t *out;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} SFX(Args);

/* Sequence s, KV heads [h0, h1): every cached row is read once, in place, and all the
   query heads of those KV heads are done with it. scores: [(h1 - h0) * groups, len];
   acc: [(h1 - h0) * groups * hd], the output before it is stored; vrow: [hd]. */
static inline __attribute__((always_inline)) void SFX(attend_impl)(
    const SFX(Args) *a, int64_t s, int64_t h0, int64_t h1, float *restrict scores,
    float *restrict acc, float *restrict vrow, const int64_t hd) {
    const int64_t groups = a->num_heads / a->num_kv_heads;
    const int64_t bs = a->block_size;
    const int64_t row = a->num_kv_heads * hd; /* one token slot of the cache */
    const int64_t len = a->context_lens[s];
    const int64_t heads = (h1 - h0) * groups;
    const int64_t *table = a->block_tables + s * a->table_stride;
    const scalar_t *q = a->query + s * a->q_stride + h0 * groups * hd;
    scalar_t *restrict o = a->out + (s * a->num_heads + h0 * groups) * hd;
    const int64_t row_bytes = (h1 - h0) * hd * (int64_t)sizeof(scalar_t);
    /* Block by block: a block's slots are consecutive rows of the cache. */
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const scalar_t *k = a->key_cache + table[t0 / bs] * bs * row + h0 * hd;
        const scalar_t *next =
            t0 + bs < len ? a->key_cache + table[t0 / bs + 1] * bs * row + h0 * hd : NULL;
        for (int64_t i = 0; i < n; i++) {
            if (next != NULL) prefetch_row(next + i * row, row_bytes);
            /* KV head by KV head, its query heads reading the same K in L1 */
            for (int64_t kh = 0, j = 0; kh < h1 - h0; kh++) {
                const scalar_t *kr = k + i * row + kh * hd;
                for (int64_t g = 0; g < groups; g++, j++)
                    scores[j * len + t0 + i] = SFX(dot)(q + j * hd, kr, hd) * a->scale;
            }
        }
    }
    softmax_rows(scores, heads, len);
    for (int64_t i = 0; i < heads * hd; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const scalar_t *v = a->value_cache + table[t0 / bs] * bs * row + h0 * hd;
        const scalar_t *next =
            t0 + bs < len ? a->value_cache + table[t0 / bs + 1] * bs * row + h0 * hd : NULL;
        for (int64_t i = 0; i < n; i++) {
            if (next != NULL) prefetch_row(next + i * row, row_bytes);
            for (int64_t kh = 0, j = 0; kh < h1 - h0; kh++) {
                const scalar_t *restrict vi = v + i * row + kh * hd;
                /* bf16: the row in float32 once, for all of its query heads */
                const float *restrict vf = (const float *)vi;
                if (sizeof(scalar_t) != sizeof(float)) {
                    for (int64_t d = 0; d < hd; d++) vrow[d] = SFX(ld)(vi[d]);
                    vf = vrow;
                }
                for (int64_t g = 0; g < groups; g++, j++) {
                    const float p = scores[j * len + t0 + i];
                    float *restrict oj = acc + j * hd;
                    for (int64_t d = 0; d < hd; d++) oj[d] += p * vf[d];
                }
            }
        }
    }
    for (int64_t i = 0; i < heads * hd; i++) o[i] = SFX(st)(acc[i]);
}

/* Head dims the models use get a loop of known length (unrolled, in registers). The bf16
   loop takes the thread's next item from `queue` into `next` as it nears its end; the
   others leave `next` for the caller to fill. */
static void SFX(attend)(const SFX(Args) *a, int64_t s, int64_t h0, int64_t h1,
                     float *restrict scores, float *restrict acc, float *restrict vrow,
                     const struct work_queue *queue, struct next_item *next) {
#ifdef HAVE_DPBF16
    if (sizeof(scalar_t) == sizeof(bf16_t) && a->block_size >= 16 &&
        (a->head_dim == 64 || a->head_dim == 128)) {
        const int64_t groups = a->num_heads / a->num_kv_heads;
        const int64_t *table = a->block_tables + s * a->table_stride;
        const bf16_t *q = (const bf16_t *)(a->query + s * a->q_stride + h0 * groups * a->head_dim);
        const bf16_t *kc = (const bf16_t *)a->key_cache, *vc = (const bf16_t *)a->value_cache;
        const int64_t row = a->num_kv_heads * a->head_dim, len = a->context_lens[s];
        if (a->head_dim == 64)
            attend_dpbf16_64(q, kc, vc, table, a->block_size, row, h0, h1, groups, len,
                             a->scale, scores, acc, queue, next);
        else
            attend_dpbf16_128(q, kc, vc, table, a->block_size, row, h0, h1, groups, len,
                              a->scale, scores, acc, queue, next);
        scalar_t *o = a->out + (s * a->num_heads + h0 * groups) * a->head_dim;
        for (int64_t i = 0; i < (h1 - h0) * groups * a->head_dim; i++) o[i] = SFX(st)(acc[i]);
        return;
    }
#endif
    switch (a->head_dim) {
    case 64: SFX(attend_impl)(a, s, h0, h1, scores, acc, vrow, 64); break;
    case 128: SFX(attend_impl)(a, s, h0, h1, scores, acc, vrow, 128); break;
    default: SFX(attend_impl)(a, s, h0, h1, scores, acc, vrow, a->head_dim);
    }
    next->item = take_item(queue), next->covered = FETCH_AHEAD;
}

/* query [S, H, D] (rows q_stride apart, heads contiguous); key/value cache
   [NB, BS, KVH, D] contiguous; block_tables [S, >= ceil(len / BS)] rows table_stride
   apart; context_lens [S], each <= max_len; out [S, H, D] contiguous. Query head h
   reads KV head h / (H / KVH). */
int SFX(paged_decode_attention)(
    const scalar_t *query, int64_t q_stride, const scalar_t *key_cache,
    const scalar_t *value_cache, const int64_t *block_tables, int64_t table_stride,
    const int64_t *context_lens, scalar_t *out, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t max_len,
    int64_t num_threads) {
    const SFX(Args) a = {query, q_stride, key_cache, value_cache, block_tables, table_stride,
                      context_lens, out, num_heads, num_kv_heads, head_dim, block_size, scale};
    /* Whole sequences per work item when there are enough of them to share out; else
       one KV head each, so that a few long sequences still use every thread. */
    const int64_t split = num_seqs >= 4 * num_threads ? 1 : num_kv_heads;
    const int64_t per_item = num_kv_heads / split;
    int failed = 0;
    int64_t taken = 0;
    const struct work_queue queue = {&taken, num_seqs * split, split, per_item, block_tables,
                                     table_stride, context_lens, block_size};
#pragma omp parallel num_threads(num_threads)
    {
        /* scores [heads, width], and at least the bf16 loop's work */
        const int64_t width = max_len > DPBF16_WORK_PER_HEAD ? max_len : DPBF16_WORK_PER_HEAD;
        const int64_t heads = num_heads / split;
        float *scores = (float *)malloc(sizeof(float) * (heads * (width + head_dim) + head_dim));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* items one at a time from the queue (see struct work_queue) */
        struct next_item next = {take_item(&queue), FETCH_AHEAD};
        while (scores != NULL && next.item < queue.total) {
            const int64_t s = next.item / split, h0 = (next.item % split) * per_item;
            SFX(attend)(&a, s, h0, h0 + per_item, scores, scores + heads * width,
                     scores + heads * (width + head_dim), &queue, &next);
        }
        free(scores);
    }
    return failed;
}
