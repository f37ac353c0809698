/* Decode attention over the paged KV cache for the CPU, in plain C (built by lora/native.py).
 *
 * Why: torch's way on CPU is to gather every sequence's K and V blocks into new tensors and
 * run two batched GEMMs of one query row each; the copies and the small-GEMM dispatch cost
 * several times what reading the cache once does. Here each (sequence, kv head) reads its
 * blocks in place, once, for all the query heads of its group.
 *
 * Layout (workers/kv_cache.py): q and out [B, H, D] (row stride per sequence, heads D apart);
 * k_cache / v_cache [kv_heads, num_blocks, block_size, D] contiguous; block_tables [S, >= W]
 * int64 (row stride bt_stride); context_lens [B] int64; rows [B] int64 or NULL: query b reads the table
 * rows[b] (a prompt's tokens, each a query over its own context, share their sequence's table), else b (S = B).
 * Query head h reads kv head h / group.
 * Scores, softmax and the weighted sum are fp32; out is rounded once. A context length or a
 * block id out of range fails the call (OUT_OF_RANGE) instead of reading past the cache.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../lora/vec.h"

enum { OUT_OF_RANGE = 1, OUT_OF_MEMORY = 2 };   /* nonzero returns */

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
    const int64_t *rows;
    int64_t num_tables;
} attn_args;

/* query b's block table, or NULL where its row of the tables is out of range */
static inline const int64_t *table_of(const attn_args *p, int64_t b) {
    const int64_t row = p->rows ? p->rows[b] : b;
    return row >= 0 && row < p->num_tables ? p->block_tables + row * p->bt_stride : NULL;
}

#define DEFINE_ATTENTION(NAME, T, LOAD, STORE)                                                      \
static int NAME(const attn_args *p) {                                                                      \
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
                failed = !qf || !acc || !s ? OUT_OF_MEMORY : OUT_OF_RANGE;                          \
                continue;                                                                           \
            }                                                                                       \
            const int64_t *table = table_of(p, b);                                                  \
            int bad_block = !table;                                                                 \
            for (int64_t j = 0; table && j < (ctx + bs - 1) / bs; j++)                              \
                bad_block |= table[j] < 0 || table[j] >= p->num_blocks;                            \
            if (bad_block) {                                                                        \
                _Pragma("omp atomic write")                                                         \
                failed = OUT_OF_RANGE;                                                              \
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

DEFINE_ATTENTION(decode_attention_bf16_portable, uint16_t, bf16_load, bf16_store)
DEFINE_ATTENTION(decode_attention_f32_portable, float, f32_load, f32_store)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <omp.h>

/* bf16, head_dim a multiple of 32, at most 16 query heads per kv head: q . k by the bf16 dot
 * instruction, 16 keys' scores summed at once by reduce16, a vector exp. */
#define FAST_MAX_GROUP 16
static int decode_attention_bf16_fast(const attn_args *p) {
    const int64_t D = p->head_dim, G = p->group, bs = p->block_size, max_ctx = p->max_blocks * bs;
    const int64_t C = D / 32;
    int failed = 0;
    #pragma omp parallel
    {
        float *s = malloc(sizeof(float) * G * (max_ctx + 16)), *acc = malloc(sizeof(float) * G * D);
        #pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < p->batch * p->kv_heads; i++) {
            const int64_t b = i / p->kv_heads, h = i % p->kv_heads, ctx = p->context_lens[b];
            const int64_t *table = table_of(p, b);
            int bad = ctx < 1 || ctx > max_ctx || !table;
            for (int64_t j = 0; !bad && j < (ctx + bs - 1) / bs; j++) bad |= table[j] < 0 || table[j] >= p->num_blocks;
            if (bad || !s || !acc) {
                #pragma omp atomic write
                failed = bad ? OUT_OF_RANGE : OUT_OF_MEMORY;
                continue;
            }
            const uint16_t *q = (const uint16_t *)p->q + b * p->q_stride + h * G * D;
            const uint16_t *kh = (const uint16_t *)p->k_cache + h * p->num_blocks * bs * D;
            const uint16_t *vh = (const uint16_t *)p->v_cache + h * p->num_blocks * bs * D;
            __m512 m[FAST_MAX_GROUP];
            for (int64_t g = 0; g < G; g++) m[g] = _mm512_set1_ps(-INFINITY);
            for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
                const int nk = ctx - t0 < 16 ? (int)(ctx - t0) : 16;
                for (int64_t g = 0; g < G; g++) {
                    __m512 v[16];
                    for (int k = 0; k < 16; k++) {
                        v[k] = _mm512_setzero_ps();
                        if (k >= nk) continue;
                        const int64_t t = t0 + k;
                        const uint16_t *kr = kh + (table[t / bs] * bs + t % bs) * D;
                        for (int64_t c = 0; c < C; c++)
                            v[k] = _mm512_dpbf16_ps(v[k], (__m512bh)_mm512_loadu_si512(kr + 32 * c),
                                                    (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c));
                    }
                    const __mmask16 live = (__mmask16)((1u << nk) - 1u);
                    const __m512 sc = _mm512_mul_ps(reduce16(v), _mm512_set1_ps(p->scale));
                    _mm512_storeu_ps(s + g * (max_ctx + 16) + t0, sc);
                    m[g] = _mm512_mask_max_ps(m[g], live, m[g], sc);
                }
            }
            float inv[FAST_MAX_GROUP];
            for (int64_t g = 0; g < G; g++) {
                const __m512 mg = _mm512_set1_ps(_mm512_reduce_max_ps(m[g]));
                float *sg = s + g * (max_ctx + 16);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
                    const __mmask16 live = (__mmask16)(ctx - t0 >= 16 ? 0xffffu : (1u << (ctx - t0)) - 1u);
                    const __m512 e = _mm512_maskz_mov_ps(live, v_exp(_mm512_sub_ps(_mm512_loadu_ps(sg + t0), mg)));
                    _mm512_storeu_ps(sg + t0, e);
                    sum = _mm512_add_ps(sum, e);
                }
                inv[g] = 1.f / _mm512_reduce_add_ps(sum);
            }
            memset(acc, 0, sizeof(float) * G * D);
            for (int64_t t = 0; t < ctx; t++) {
                const uint16_t *vr = vh + (table[t / bs] * bs + t % bs) * D;
                for (int64_t c = 0; c < D; c += 16) {
                    const __m512 vv = load_bf16(vr + c, 16);
                    for (int64_t g = 0; g < G; g++) {
                        float *ag = acc + g * D + c;
                        _mm512_storeu_ps(ag, _mm512_fmadd_ps(_mm512_set1_ps(s[g * (max_ctx + 16) + t]), vv,
                                                             _mm512_loadu_ps(ag)));
                    }
                }
            }
            uint16_t *o = (uint16_t *)p->out + b * p->out_stride + h * G * D;
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < D; c += 16)
                    _mm256_storeu_si256((__m256i *)(o + g * D + c), (__m256i)_mm512_cvtneps_pbh(
                        _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c), _mm512_set1_ps(inv[g]))));
        }
        free(s);
        free(acc);
    }
    return failed;
}
#define FAST_OK(p) ((p)->head_dim % 32 == 0 && (p)->group <= FAST_MAX_GROUP)
#else
#define FAST_OK(p) 0
#define decode_attention_bf16_fast decode_attention_bf16_portable
#endif

int decode_attention_bf16(const attn_args *p) {
    return FAST_OK(p) ? decode_attention_bf16_fast(p) : decode_attention_bf16_portable(p);
}

int decode_attention_f32(const attn_args *p) { return decode_attention_f32_portable(p); }
