/* Decode attention over a paged key/value cache, one query token per row (meshtron, engine.native_decode_attention).
 *
 * Row r attends to key positions lo[r]..hi[r] of its sequence; position p lives in cache block
 * table[r * table_stride + p / bs] at slot p % bs. Caches are (blocks, bs, kv_heads, d) float32;
 * q is (rows, heads, dk) and out is (rows, heads, dv), both contiguous. Query head h reads kv head
 * h / (heads / kv_heads). Only each row's own keys are read (no padding), front to back, and the
 * softmax is computed online a block at a time: per block the scores of its keys for every head,
 * per head their maximum and one rescale of the running sum and output, then the weighted values.
 * Work is split by row over num_threads threads.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *table, *lo, *hi;
    float *out;
    int64_t row_begin, row_end, table_stride, heads, kv_heads, bs, dk, dv;
    float scale;
    int status;
} Work;

static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void *run_rows(void *arg) {
    Work *w = (Work *)arg;
    const int64_t heads = w->heads, group = heads / w->kv_heads, bs = w->bs, dk = w->dk, dv = w->dv;
    const int64_t key_stride = w->kv_heads * dk, value_stride = w->kv_heads * dv;
    float *acc = malloc(sizeof(float) * (size_t)(heads * dv));
    float *m = malloc(sizeof(float) * (size_t)heads), *l = malloc(sizeof(float) * (size_t)heads);
    float *s = malloc(sizeof(float) * (size_t)(heads * bs));
    if (!acc || !m || !l || !s) {
        w->status = 1;
        free(acc), free(m), free(l), free(s);
        return NULL;
    }
    for (int64_t r = w->row_begin; r < w->row_end; r++) {
        const int64_t *blocks = w->table + r * w->table_stride;
        const float *q = w->q + r * heads * dk;
        memset(acc, 0, sizeof(float) * (size_t)(heads * dv));
        for (int64_t h = 0; h < heads; h++) m[h] = -INFINITY, l[h] = 0.0f;
        for (int64_t p0 = w->lo[r]; p0 <= w->hi[r]; p0 = (p0 / bs + 1) * bs) {
            const int64_t block = blocks[p0 / bs], first = p0 % bs;
            const int64_t last = (w->hi[r] / bs == p0 / bs) ? w->hi[r] % bs : bs - 1, n = last - first + 1;
            /* the block's keys, then its values, each read front to back once (every head of a key
               lies together) */
            const float *k = w->k_cache + (block * bs + first) * key_stride;
            const float *v = w->v_cache + (block * bs + first) * value_stride;
            for (int64_t j = 0; j < n; j++)
                for (int64_t h = 0; h < heads; h++)
                    s[h * bs + j] = dot(q + h * dk, k + j * key_stride + (h / group) * dk, dk) * w->scale;
            for (int64_t h = 0; h < heads; h++) {
                float block_max = m[h];
                for (int64_t j = 0; j < n; j++) block_max = s[h * bs + j] > block_max ? s[h * bs + j] : block_max;
                const float rescale = expf(m[h] - block_max); /* 0 on the first block (m = -inf) */
                float *o = acc + h * dv;
                l[h] *= rescale;
#pragma omp simd
                for (int64_t d = 0; d < dv; d++) o[d] *= rescale;
                for (int64_t j = 0; j < n; j++) {
                    s[h * bs + j] = expf(s[h * bs + j] - block_max);
                    l[h] += s[h * bs + j];
                }
                m[h] = block_max;
            }
            for (int64_t j = 0; j < n; j++)
                for (int64_t h = 0; h < heads; h++) {
                    const float p = s[h * bs + j], *vj = v + j * value_stride + (h / group) * dv;
                    float *o = acc + h * dv;
#pragma omp simd
                    for (int64_t d = 0; d < dv; d++) o[d] += p * vj[d];
                }
        }
        for (int64_t h = 0; h < heads; h++) {
            float *dst = w->out + (r * heads + h) * dv;
            const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f; /* an empty range gives zeros */
            for (int64_t d = 0; d < dv; d++) dst[d] = acc[h * dv + d] * inv;
        }
    }
    free(acc), free(m), free(l), free(s);
    return NULL;
}

/* Returns 0 on success, 1 if memory for the per-thread buffers could not be had. */
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                           int64_t table_stride, const int64_t *lo, const int64_t *hi, float *out, int64_t rows,
                           int64_t heads, int64_t kv_heads, int64_t bs, int64_t dk, int64_t dv, float scale,
                           int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > rows) num_threads = rows > 0 ? rows : 1;
    Work work[64];
    if (num_threads > 64) num_threads = 64;
    pthread_t threads[64];
    int started[64] = {0};
    for (int64_t t = 0; t < num_threads; t++) {
        work[t] = (Work){q, k_cache, v_cache, table, lo, hi, out, rows * t / num_threads, rows * (t + 1) / num_threads,
                         table_stride, heads, kv_heads, bs, dk, dv, scale, 0};
        if (t > 0) started[t] = pthread_create(&threads[t], NULL, run_rows, &work[t]) == 0;
    }
    run_rows(&work[0]);
    for (int64_t t = 1; t < num_threads; t++) {
        if (started[t])
            pthread_join(threads[t], NULL);
        else
            run_rows(&work[t]);  /* no thread could be started: do its rows here */
    }
    for (int64_t t = 0; t < num_threads; t++)
        if (work[t].status) return 1;
    return 0;
}
