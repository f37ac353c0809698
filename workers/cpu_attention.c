/* Decode attention over the paged KV cache for the CPU, in plain C (built by lora/native.py).
 *
 * Why: torch's way on CPU is to gather every sequence's K and V blocks into new tensors and
 * run two batched GEMMs of one query row each; the copies and the small-GEMM dispatch cost
 * several times what reading the cache once does. Here each (sequence, kv head) reads its
 * blocks in place, once, for all the query heads of its group.
 *
 * Layout (workers/kv_cache.py): q and out [B, H, D] (row stride per sequence, heads D apart);
 * k_cache / v_cache [kv_heads, num_blocks, block_size, D] contiguous; block_tables [B, >= W]
 * int64 (row stride bt_stride); context_lens [B] int64. Query head h reads kv head h / group.
 * Scores, softmax and the weighted sum are fp32; out is rounded once. A context length or a
 * block id out of range fails the call (nonzero return) instead of reading past the cache.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *q;
    int64_t q_stride;
    const void *k_cache, *v_cache;
    int64_t kv_heads, num_blocks, block_size, head_dim, group;
    const int64_t *block_tables;
    int64_t bt_stride, max_blocks;
    const int64_t *context_lens;
    void *out;
    int64_t out_stride, batch;
    float scale;
} attn_args;

static inline float bf16_load(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_load(float v) { return v; }
static inline float f32_store(float f) { return f; }

#define DEFINE_ATTENTION(NAME, T, LOAD, STORE)                                                      \
int NAME(const attn_args *p) {                                                                      \
    const int64_t D = p->head_dim, G = p->group, bs = p->block_size;                               \
    const int64_t max_ctx = p->max_blocks * bs;                                                     \
    int failed = 0;                                                                                 \
    _Pragma("omp parallel")                                                                         \
    {                                                                                               \
        /* per thread: the group's queries and outputs in fp32, and its scores */                  \
        float *qf = malloc(sizeof(float) * G * D), *acc = malloc(sizeof(float) * G * D);            \
        float *s = malloc(sizeof(float) * G * (max_ctx > 0 ? max_ctx : 1));                        \
        _Pragma("omp for schedule(dynamic, 4)")                                                     \
        for (int64_t i = 0; i < p->batch * p->kv_heads; i++) {                                     \
            const int64_t b = i / p->kv_heads, h = i % p->kv_heads, ctx = p->context_lens[b];      \
            if (!qf || !acc || !s || ctx < 1 || ctx > max_ctx) {                                    \
                _Pragma("omp atomic write")                                                         \
                failed = 1;                                                                         \
                continue;                                                                           \
            }                                                                                       \
            const int64_t *table = p->block_tables + b * p->bt_stride;                            \
            int bad_block = 0;                                                                      \
            for (int64_t j = 0; j < (ctx + bs - 1) / bs; j++)                                       \
                bad_block |= table[j] < 0 || table[j] >= p->num_blocks;                            \
            if (bad_block) {                                                                        \
                _Pragma("omp atomic write")                                                         \
                failed = 1;                                                                         \
                continue;                                                                           \
            }                                                                                       \
            const T *q = (const T *)p->q + b * p->q_stride + h * G * D;                            \
            for (int64_t g = 0; g < G; g++)                                                         \
                for (int64_t d = 0; d < D; d++) qf[g * D + d] = LOAD(q[g * D + d]) * p->scale;     \
            const T *kh = (const T *)p->k_cache + h * p->num_blocks * bs * D;                     \
            const T *vh = (const T *)p->v_cache + h * p->num_blocks * bs * D;                     \
            float m[G], inv[G];                                                                     \
            for (int64_t g = 0; g < G; g++) m[g] = -INFINITY;                                       \
            for (int64_t t = 0; t < ctx; t++) {                                                     \
                const T *k = kh + (table[t / bs] * bs + t % bs) * D;                               \
                for (int64_t g = 0; g < G; g++) {                                                   \
                    const float *qg = qf + g * D;                                                   \
                    float dot = 0.f;                                                                \
                    _Pragma("omp simd reduction(+:dot)")                                            \
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * LOAD(k[d]);                      \
                    s[g * max_ctx + t] = dot;                                                       \
                    if (dot > m[g]) m[g] = dot;                                                     \
                }                                                                                   \
            }                                                                                       \
            for (int64_t g = 0; g < G; g++) {                                                       \
                float sum = 0.f, *sg = s + g * max_ctx;                                             \
                for (int64_t t = 0; t < ctx; t++) {                                                 \
                    sg[t] = expf(sg[t] - m[g]);                                                     \
                    sum += sg[t];                                                                   \
                }                                                                                   \
                inv[g] = 1.f / sum;                                                                 \
            }                                                                                       \
            memset(acc, 0, sizeof(float) * G * D);                                                  \
            for (int64_t t = 0; t < ctx; t++) {                                                     \
                const T *v = vh + (table[t / bs] * bs + t % bs) * D;                               \
                for (int64_t g = 0; g < G; g++) {                                                   \
                    const float w = s[g * max_ctx + t];                                             \
                    float *ag = acc + g * D;                                                        \
                    _Pragma("omp simd")                                                             \
                    for (int64_t d = 0; d < D; d++) ag[d] += w * LOAD(v[d]);                        \
                }                                                                                   \
            }                                                                                       \
            T *o = (T *)p->out + b * p->out_stride + h * G * D;                                    \
            for (int64_t g = 0; g < G; g++)                                                         \
                for (int64_t d = 0; d < D; d++) o[g * D + d] = STORE(acc[g * D + d] * inv[g]);     \
        }                                                                                           \
        free(qf);                                                                                   \
        free(acc);                                                                                  \
        free(s);                                                                                    \
    }                                                                                               \
    return failed;                                                                                  \
}

DEFINE_ATTENTION(decode_attention_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_ATTENTION(decode_attention_f32, float, f32_load, f32_store)
