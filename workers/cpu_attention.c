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
 * instruction, 16 keys' scores summed at once by reduce16, a vector exp. Each key's row offset is found once per
 * (sequence, kv head) (off[t]), q . k runs the 16 keys' dot chains side by side (one key's chain of D / 32 dependent
 * dots alone kept the core waiting), and for head_dim 64 / 128 / 256 the weighted sum of V keeps its accumulators
 * in registers (pv_tile) instead of a scratch row read and written per key: the batch-32 bench step's attention
 * 0.8x (the same bits: every sum in the same order). */
#define FAST_MAX_GROUP 16

/* out[g] = round(sum over t < ctx, ascending, of s[g][t] * v[t]) * inv[g] for the GT heads of one tile, C16 vectors of
 * 16 a row (head_dim = 16 C16): GT * C16 <= 16 accumulators, constants after inlining. */
static inline __attribute__((always_inline)) void pv_tile(const uint16_t *vh, const int64_t *off, int64_t ctx,
                                                          const float *s, int64_t s_stride, const int C16,
                                                          const int GT, const float *inv, uint16_t *o, int64_t D) {
    __m512 acc[4][16];
    for (int g = 0; g < GT; g++)
        for (int c = 0; c < C16; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < ctx; t++) {
        const uint16_t *vr = vh + off[t];
        __m512 w[4];
        for (int g = 0; g < GT; g++) w[g] = _mm512_set1_ps(s[g * s_stride + t]);
        for (int c = 0; c < C16; c++) {
            const __m512 vv = load_bf16(vr + 16 * c, 16);
            for (int g = 0; g < GT; g++) acc[g][c] = _mm512_fmadd_ps(w[g], vv, acc[g][c]);
        }
    }
    for (int g = 0; g < GT; g++)
        for (int c = 0; c < C16; c++)
            st_bf16(o + g * D + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])), 16);
}

/* The weighted sum of V for heads [0, G) in register tiles; 0 where head_dim has none (the caller's loop then). */
static int pv_registers(const uint16_t *vh, const int64_t *off, int64_t ctx, const float *s, int64_t s_stride,
                        int64_t G, const float *inv, uint16_t *o, int64_t D) {
    int64_t g = 0;
    switch (D) {
    case 64:
        for (; g + 4 <= G; g += 4) pv_tile(vh, off, ctx, s + g * s_stride, s_stride, 4, 4, inv + g, o + g * D, D);
        for (; g < G; g++) pv_tile(vh, off, ctx, s + g * s_stride, s_stride, 4, 1, inv + g, o + g * D, D);
        return 1;
    case 128:
        for (; g + 2 <= G; g += 2) pv_tile(vh, off, ctx, s + g * s_stride, s_stride, 8, 2, inv + g, o + g * D, D);
        for (; g < G; g++) pv_tile(vh, off, ctx, s + g * s_stride, s_stride, 8, 1, inv + g, o + g * D, D);
        return 1;
    case 256:
        for (; g < G; g++) pv_tile(vh, off, ctx, s + g * s_stride, s_stride, 16, 1, inv + g, o + g * D, D);
        return 1;
    default:
        return 0;
    }
}

static int decode_attention_bf16_fast(const attn_args *p) {
    const int64_t D = p->head_dim, G = p->group, bs = p->block_size, max_ctx = p->max_blocks * bs;
    const int64_t C = D / 32, s_stride = max_ctx + 16;
    int failed = 0;
    #pragma omp parallel
    {
        float *s = malloc(sizeof(float) * G * s_stride), *acc = malloc(sizeof(float) * G * D);
        int64_t *off = malloc(sizeof(int64_t) * s_stride);   /* key t's row: element offset in a head's cache */
        #pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < p->batch * p->kv_heads; i++) {
            const int64_t b = i / p->kv_heads, h = i % p->kv_heads, ctx = p->context_lens[b];
            const int64_t *table = table_of(p, b);
            int bad = ctx < 1 || ctx > max_ctx || !table;
            for (int64_t j = 0; !bad && j < (ctx + bs - 1) / bs; j++) bad |= table[j] < 0 || table[j] >= p->num_blocks;
            if (bad || !s || !acc || !off) {
                #pragma omp atomic write
                failed = bad ? OUT_OF_RANGE : OUT_OF_MEMORY;
                continue;
            }
            for (int64_t t0 = 0, j = 0; t0 < ctx; t0 += bs, j++)
                for (int64_t r = 0; r < bs && t0 + r < ctx; r++) off[t0 + r] = (table[j] * bs + r) * D;
            const uint16_t *q = (const uint16_t *)p->q + b * p->q_stride + h * G * D;
            const uint16_t *kh = (const uint16_t *)p->k_cache + h * p->num_blocks * bs * D;
            const uint16_t *vh = (const uint16_t *)p->v_cache + h * p->num_blocks * bs * D;
            __m512 m[FAST_MAX_GROUP];
            for (int64_t g = 0; g < G; g++) m[g] = _mm512_set1_ps(-INFINITY);
            for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
                const int nk = ctx - t0 < 16 ? (int)(ctx - t0) : 16;
                const uint16_t *kr[16];   /* past the context: key t0's row again, its lanes masked below */
                for (int k = 0; k < 16; k++) kr[k] = kh + off[t0 + (k < nk ? k : 0)];
                for (int64_t g = 0; g < G; g++) {
                    __m512 v[16];
                    for (int k = 0; k < 16; k++) v[k] = _mm512_setzero_ps();
                    for (int64_t c = 0; c < C; c++) {
                        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c);
                        for (int k = 0; k < 16; k++)
                            v[k] = _mm512_dpbf16_ps(v[k], (__m512bh)_mm512_loadu_si512(kr[k] + 32 * c), qv);
                    }
                    const __mmask16 live = (__mmask16)((1u << nk) - 1u);
                    const __m512 sc = _mm512_mul_ps(reduce16(v), _mm512_set1_ps(p->scale));
                    _mm512_storeu_ps(s + g * s_stride + t0, sc);
                    m[g] = _mm512_mask_max_ps(m[g], live, m[g], sc);
                }
            }
            float inv[FAST_MAX_GROUP];
            for (int64_t g = 0; g < G; g++) {
                const __m512 mg = _mm512_set1_ps(_mm512_reduce_max_ps(m[g]));
                float *sg = s + g * s_stride;
                __m512 sum = _mm512_setzero_ps();
                for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
                    const __mmask16 live = (__mmask16)(ctx - t0 >= 16 ? 0xffffu : (1u << (ctx - t0)) - 1u);
                    const __m512 e = _mm512_maskz_mov_ps(live, v_exp(_mm512_sub_ps(_mm512_loadu_ps(sg + t0), mg)));
                    _mm512_storeu_ps(sg + t0, e);
                    sum = _mm512_add_ps(sum, e);
                }
                inv[g] = 1.f / _mm512_reduce_add_ps(sum);
            }
            uint16_t *o = (uint16_t *)p->out + b * p->out_stride + h * G * D;
            if (pv_registers(vh, off, ctx, s, s_stride, G, inv, o, D))
                continue;
            memset(acc, 0, sizeof(float) * G * D);
            for (int64_t t = 0; t < ctx; t++) {
                const uint16_t *vr = vh + off[t];
                for (int64_t c = 0; c < D; c += 16) {
                    const __m512 vv = load_bf16(vr + c, 16);
                    for (int64_t g = 0; g < G; g++) {
                        float *ag = acc + g * D + c;
                        _mm512_storeu_ps(ag, _mm512_fmadd_ps(_mm512_set1_ps(s[g * s_stride + t]), vv,
                                                             _mm512_loadu_ps(ag)));
                    }
                }
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < D; c += 16)
                    st_bf16(o + g * D + c, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c), _mm512_set1_ps(inv[g])), 16);
        }
        free(s);
        free(acc);
        free(off);
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
