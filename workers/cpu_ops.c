/* The element-wise parts of a decoder layer for the CPU, in plain C (built by lora/native.py):
 * RMSNorm (with the residual add before it), q/k RMSNorm + rotary embedding + the KV-cache write
 * of a step's rows, SiLU-and-mul, and the greedy sampler's argmax over the logits.
 *
 * Why: torch runs each of these as 4-10 ops, each a dispatch, an allocation and a pass over the
 * rows (RMSNorm alone 36-60 us a call at batch 32); here each is one pass, rows split over the threads.
 *
 * Exactness: every value the torch reference rounds to the model's dtype is rounded here at the same
 * point (workers/models/llama.py's RMSNorm, rope.py's RotaryEmbedding, SiLU then mul), so bf16
 * results are the reference's up to the order of a row's sum of squares and exp's last bit.
 * Layout: rows of D elements with unit stride, given a row stride (a view of a wider tensor);
 * outputs dense. A position or a slot out of range fails the call (OUT_OF_RANGE).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../lora/vec.h"

enum { OUT_OF_RANGE = 1 };

/* Split over the threads from a batch-32 decode step's sizes up (16k elements: RMSNorm at 16 rows of 1024). Right
 * after a GEMM the pool's threads are still spinning, so the region starts at once; in the engine at batch 32 on
 * 2 cores (bench shape, step ~25 ms) a step's norms, SiLU and q/k rope went 4.2 -> 2.3 ms with the split, and the
 * GEMMs after them ran no slower. The catch: where other processes share the cores, a thread descheduled at the
 * region's barrier stalls the call for a time slice (load 8 on 2 cores: qkv_rope 15 ms a call split, 0.47 ms on
 * one thread), as it stalls every GEMM there. */
#define PARALLEL_MIN (1 << 14)

/* out = w * round(x * rsqrt(mean(x^2) + eps)), rounded: RMSNorm.forward of one row (fp32 maths) */
#define DEFINE_NORM_ROW(NAME, T, OUT, LD, ROUND, ST)                                                  \
static inline void NAME(const T *x, const T *w, float eps, int64_t D, OUT *out) {                  \
    vf acc = v_set(0.f);                                                                         \
    for (int64_t d = 0; d < D; d += W) {                                                           \
        const vf v = LD(x + d, (int)(D - d));                                                      \
        acc = v_add(acc, v_mul(v, v));                                                             \
    }                                                                                              \
    const vf r = v_set(1.f / sqrtf(v_sum(acc) / (float)D + eps));                                 \
    for (int64_t d = 0; d < D; d += W)                                                             \
        ST(out + d, v_mul(LD(w + d, (int)(D - d)), ROUND(v_mul(LD(x + d, (int)(D - d)), r))), (int)(D - d)); \
}
DEFINE_NORM_ROW(norm_row_bf16, uint16_t, uint16_t, ld_bf16, round_bf16, st_bf16)
DEFINE_NORM_ROW(norm_row_f32, float, float, ld_f32, round_f32, st_f32)
/* bf16's row rounded as norm_row_bf16 stores it, kept in fp32 lanes (q/k norm before rope, below) */
static inline void st_rounded_f32(float *p, vf v, int n) { st_f32(p, round_bf16(v), n); }
DEFINE_NORM_ROW(norm_row_bf16_wide, uint16_t, float, ld_bf16, round_bf16, st_rounded_f32)

/* x [rows, D] (row stride x_stride) -> out [rows, D]; with delta (row stride delta_stride): first
 * sum = round(x + delta) [rows, D], normalised in its place (the residual add of a decoder layer).
 * Every entry point takes one argument struct, so a captured decode step can run it from a program
 * (workers/cpu_program.c). */
typedef struct {
    const void *x;
    int64_t x_stride;
    const void *delta;
    int64_t delta_stride;
    void *sum;
    const void *w;
    float eps;
    int64_t rows, D;
    void *out;
} norm_args;

#define DEFINE_RMS_NORM(NAME, T, ROW, LD, ST)                                                         \
int NAME(const norm_args *p) {                                                                     \
    const T *x = p->x, *delta = p->delta, *w = p->w;                                               \
    T *sum = p->sum, *out = p->out;                                                                \
    const int64_t rows = p->rows, D = p->D, x_stride = p->x_stride, delta_stride = p->delta_stride; \
    const float eps = p->eps;                                                                      \
    _Pragma("omp parallel for if(rows * D > PARALLEL_MIN)")                                       \
    for (int64_t i = 0; i < rows; i++) {                                                           \
        const T *xi = x + i * x_stride;                                                            \
        if (delta) {                                                                               \
            for (int64_t d = 0; d < D; d += W)                                                     \
                ST(sum + i * D + d, v_add(LD(xi + d, (int)(D - d)), LD(delta + i * delta_stride + d, (int)(D - d))), \
                   (int)(D - d));                                                                  \
            xi = sum + i * D;                                                                      \
        }                                                                                          \
        ROW(xi, w, eps, D, out + i * D);                                                           \
    }                                                                                              \
    return 0;                                                                                      \
}
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, norm_row_bf16, ld_bf16, st_bf16)
DEFINE_RMS_NORM(rms_norm_f32, float, norm_row_f32, ld_f32, st_f32)

/* SiLU-and-mul: x [rows, 2I] (gate | up, row stride x_stride) -> out [rows, I], each row by vec.h's silu_mul_row. */
typedef struct {
    const void *x;
    int64_t x_stride, rows, I;
    void *out;
} silu_args;

#define DEFINE_SILU_AND_MUL(NAME, T, ROW)                                                                  \
int NAME(const silu_args *p) {                                                                     \
    const T *x = p->x;                                                                             \
    T *out = p->out;                                                                               \
    const int64_t rows = p->rows, I = p->I, x_stride = p->x_stride;                                \
    _Pragma("omp parallel for if(rows * I > PARALLEL_MIN)")                                       \
    for (int64_t i = 0; i < rows; i++) ROW(x + i * x_stride, I, out + i * I);                      \
    return 0;                                                                                      \
}
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, silu_mul_row_bf16)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, silu_mul_row_f32)

/* A step's attention inputs from its qkv projection: qkv [T, (H + 2 KVH) D] (row stride qkv_stride).
 * q / k heads RMSNorm-ed where q_w / k_w are given (Qwen3), then rotated at positions[t] with the
 * cos / sin tables [max_positions, D] in the dtype (RotaryEmbedding.tables: its fp32 tables rounded once, as
 * its forward rounds each row): out = round(round(x * cos) + round(rotate_half(x) * sin)). Writes q_out [T, H, D] and
 * k_out [T, KVH, D], and k_out's and v's rows to the KV cache, [KVH, num_slots, D] each, at
 * slot_mapping[t] (kv_cache.write_kv). The cache rows written are far apart (each sequence's own blocks) and
 * cold: all of them are prefetched for writing first, so their misses overlap instead of stalling one head at a
 * time (in the batch-32 engine step: 176-188 -> 137-143 us a call). The fused head rows below, then the split:
 * 102 -> 69 us at one thread, 106 -> 61 at two (the call alone, batch 32, bench shape). */
typedef struct {
    const void *qkv;
    int64_t qkv_stride, tokens, num_heads, num_kv_heads, head_dim;
    const int64_t *positions;
    const void *cos, *sin;
    int64_t max_positions;
    const void *q_weight, *k_weight;
    float eps;
    void *k_cache, *v_cache;
    int64_t num_slots;
    const int64_t *slot_mapping;
    void *q_out, *k_out;
} qkv_args;

/* fp32 copy of n values */
#define DEFINE_WIDEN(NAME, T, LD)                                                                      \
static inline void NAME(const T *x, int64_t n, float *out) {                                       \
    for (int64_t d = 0; d < n; d += W)                                                             \
        st_f32(out + d, LD(x + d, (int)(n - d)), (int)(n - d));                                    \
}
DEFINE_WIDEN(widen_bf16, uint16_t, ld_bf16)
DEFINE_WIDEN(widen_f32, float, ld_f32)

/* One head row of the step: x (D, the qkv projection's) RMSNorm-ed by w (NULL: no q/k norm), rotated by one token's
 * cos / sin rows (fp32 copies), written to out. The row stays in fp32 lanes of `row` (a D-float buffer) between the
 * norm and the rotation, every value rounded where the torch path stores it (the norm kernel's values, then
 * out = round(round(x * cos) + round(rotate_half(x) * sin))): the same bits as the norm kernel and then a rotation,
 * without the store and the reload of the normed row, and the tables widened once a token instead of once a head. */
#define DEFINE_HEAD_ROW(NAME, T, NORM, WIDEN, ROUND, ST)                                              \
static inline void NAME(const T *x, const T *w, float eps, const float *cos, const float *sin,      \
                        int64_t D, float *row, T *out) {                                            \
    const int64_t half = D / 2;                                                                    \
    if (w)                                                                                         \
        NORM(x, w, eps, D, row);                                                                   \
    else                                                                                           \
        WIDEN(x, D, row);                                                                          \
    for (int64_t d = 0; d < half; d += W) {                                                        \
        const int n = (int)(half - d);                                                             \
        const vf a = ld_f32(row + d, n), b = ld_f32(row + half + d, n);                            \
        ST(out + d, v_sub(ROUND(v_mul(a, ld_f32(cos + d, n))), ROUND(v_mul(b, ld_f32(sin + d, n)))), n); \
        ST(out + half + d, v_add(ROUND(v_mul(b, ld_f32(cos + half + d, n))),                       \
                                 ROUND(v_mul(a, ld_f32(sin + half + d, n)))), n);                  \
    }                                                                                              \
}
DEFINE_HEAD_ROW(head_row_bf16, uint16_t, norm_row_bf16_wide, widen_bf16, round_bf16, st_bf16)
DEFINE_HEAD_ROW(head_row_f32, float, norm_row_f32, widen_f32, round_f32, st_f32)

/* One token's heads (they share its tables). Inlined with D a constant where head_dim is 128 (Qwen3, Llama,
 * Qwen2 from 7B): the rows' loops then run unrolled, unmasked (the call 58 -> XX us, batch 32, 2 threads). */
#define DEFINE_QKV_TOKEN(NAME, T, HEAD_ROW, WIDEN)                                                    \
static inline __attribute__((always_inline)) void NAME(const qkv_args *p, int64_t t, const int64_t D) { \
    const int64_t H = p->num_heads, KVH = p->num_kv_heads;                                         \
    float cos_t[D], sin_t[D], row[D];   /* this token's tables, and a head row's scratch */         \
    WIDEN((const T *)p->cos + p->positions[t] * D, D, cos_t);                                      \
    WIDEN((const T *)p->sin + p->positions[t] * D, D, sin_t);                                      \
    const T *qkv = (const T *)p->qkv + t * p->qkv_stride;                                          \
    for (int64_t h = 0; h < H; h++)                                                                \
        HEAD_ROW(qkv + h * D, (const T *)p->q_weight, p->eps, cos_t, sin_t, D, row,                    \
                 (T *)p->q_out + (t * H + h) * D);                                                 \
    for (int64_t h = 0; h < KVH; h++) {                                                            \
        T *k = (T *)p->k_out + (t * KVH + h) * D;                                                  \
        HEAD_ROW(qkv + (H + h) * D, (const T *)p->k_weight, p->eps, cos_t, sin_t, D, row, k);          \
        const int64_t slot = h * p->num_slots + p->slot_mapping[t];                                \
        memcpy((T *)p->k_cache + slot * D, k, sizeof(T) * D);                                      \
        memcpy((T *)p->v_cache + slot * D, qkv + (H + KVH + h) * D, sizeof(T) * D);                \
    }                                                                                              \
}
DEFINE_QKV_TOKEN(qkv_token_bf16, uint16_t, head_row_bf16, widen_bf16)
DEFINE_QKV_TOKEN(qkv_token_f32, float, head_row_f32, widen_f32)

/* Tokens split over the threads. */
#define DEFINE_QKV(NAME, T, TOKEN)                                                                    \
int NAME(const qkv_args *p) {                                                                      \
    const int64_t H = p->num_heads, KVH = p->num_kv_heads, D = p->head_dim;                        \
    for (int64_t t = 0; t < p->tokens; t++)                                                        \
        if (p->positions[t] < 0 || p->positions[t] >= p->max_positions                             \
            || p->slot_mapping[t] < 0 || p->slot_mapping[t] >= p->num_slots)                       \
            return OUT_OF_RANGE;                                                                   \
    for (int64_t t = 0; t < p->tokens; t++)                                                        \
        for (int64_t h = 0; h < KVH; h++) {                                                        \
            const int64_t slot = h * p->num_slots + p->slot_mapping[t];                            \
            for (int64_t b = 0; b < (int64_t)sizeof(T) * D; b += 64) {                             \
                __builtin_prefetch((char *)p->k_cache + slot * D * (int64_t)sizeof(T) + b, 1, 3);  \
                __builtin_prefetch((char *)p->v_cache + slot * D * (int64_t)sizeof(T) + b, 1, 3);  \
            }                                                                                      \
        }                                                                                          \
    _Pragma("omp parallel for if(p->tokens * (H + KVH) * D > PARALLEL_MIN)")                      \
    for (int64_t t = 0; t < p->tokens; t++) {                                                      \
        if (D == 128)                                                                              \
            TOKEN(p, t, 128);                                                                      \
        else                                                                                       \
            TOKEN(p, t, D);                                                                        \
    }                                                                                              \
    return 0;                                                                                      \
}
DEFINE_QKV(qkv_rope_bf16, uint16_t, qkv_token_bf16)
DEFINE_QKV(qkv_rope_f32, float, qkv_token_f32)

/* Greedy sampling: out[i] = argmax of row i of x [rows, V] (row stride x_stride), as torch.argmax: the first
 * index of the largest value, the first NaN where the row has one. torch's CPU argmax took 0.7-1.2 ms for
 * the 32 rows of a 32k vocabulary of a batch-32 decode step (this: ~0.1 ms), and it needs the fp32 copy of
 * the logits; this reads them in their own dtype (bf16 widens to fp32 exactly: the same index). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Four independent (best, index) lane sets, so consecutive compares do not wait on each other; each lane keeps
 * the first index of its maximum (strictly greater replaces), so the row's first maximum is the smallest index
 * among the lanes that hold the largest value. */
#define ARGMAX_STEP(LD, K, OFF, MASK)                                                              \
    {                                                                                              \
        const __m512 v = LD(row + d + (OFF), 16);                                                  \
        nan |= _mm512_mask_cmp_ps_mask(MASK, v, v, _CMP_UNORD_Q);                                  \
        const __mmask16 up = _mm512_mask_cmp_ps_mask(MASK, v, best[K], _CMP_GT_OQ);                \
        best[K] = _mm512_mask_mov_ps(best[K], up, v);                                              \
        at[K] = _mm512_mask_mov_epi32(at[K], up, _mm512_add_epi32(idx, _mm512_set1_epi32((int)(d + (OFF))))); \
    }
#define DEFINE_ARGMAX(NAME, T, LD)                                                                 \
int NAME(const T *x, int64_t x_stride, int64_t rows, int64_t V, int64_t *out) {                    \
    const __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);   \
    for (int64_t i = 0; i < rows; i++) {                                                           \
        const T *row = x + i * x_stride;                                                           \
        __m512 best[4];                                                                            \
        __m512i at[4];                                                                             \
        for (int k = 0; k < 4; k++) {                                                              \
            best[k] = _mm512_set1_ps(-INFINITY);                                                   \
            at[k] = _mm512_set1_epi32(-1);   /* never raised: a row of -inf only is index 0 */     \
        }                                                                                          \
        __mmask16 nan = 0;                                                                         \
        int64_t d = 0;                                                                             \
        for (; d + 64 <= V && !nan; d += 64) {                                                     \
            ARGMAX_STEP(LD, 0, 0, 0xffff) ARGMAX_STEP(LD, 1, 16, 0xffff)                           \
            ARGMAX_STEP(LD, 2, 32, 0xffff) ARGMAX_STEP(LD, 3, 48, 0xffff)                          \
        }                                                                                          \
        for (; d < V && !nan; d += 16)                                                             \
            ARGMAX_STEP(LD, 0, 0, lanes((int)(V - d < 16 ? V - d : 16)))                           \
        if (nan) {   /* torch's argmax: the first NaN */                                           \
            int64_t j = 0;                                                                         \
            while (!isnan(_mm512_cvtss_f32(LD(row + j, 1))))                                       \
                j++;                                                                               \
            out[i] = j;                                                                            \
            continue;                                                                              \
        }                                                                                          \
        const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(best[0], best[1]),      \
                                                             _mm512_max_ps(best[2], best[3])));    \
        int64_t first = -1;                                                                        \
        for (int k = 0; k < 4; k++) {                                                              \
            const __mmask16 ties = _mm512_cmp_ps_mask(best[k], _mm512_set1_ps(top), _CMP_EQ_OQ)    \
                & _mm512_cmp_epi32_mask(at[k], _mm512_setzero_si512(), _MM_CMPINT_NLT);            \
            if (ties) {                                                                            \
                const int64_t j = _mm512_mask_reduce_min_epi32(ties, at[k]);                       \
                first = first < 0 || j < first ? j : first;                                        \
            }                                                                                      \
        }                                                                                          \
        out[i] = first < 0 ? 0 : first;                                                            \
    }                                                                                              \
    return 0;                                                                                      \
}
#else
#define DEFINE_ARGMAX(NAME, T, LD)                                                                 \
int NAME(const T *x, int64_t x_stride, int64_t rows, int64_t V, int64_t *out) {                    \
    for (int64_t i = 0; i < rows; i++) {                                                           \
        const T *row = x + i * x_stride;                                                           \
        int64_t at = 0;                                                                            \
        float best = V ? LD(row, 1) : 0.f;                                                         \
        for (int64_t d = 0; d < V && best == best; d++) {                                          \
            const float v = LD(row + d, 1);                                                        \
            if (v > best || v != v) {                                                              \
                best = v;                                                                          \
                at = d;                                                                            \
            }                                                                                      \
        }                                                                                          \
        out[i] = at;                                                                               \
    }                                                                                              \
    return 0;                                                                                      \
}
#endif
DEFINE_ARGMAX(argmax_bf16, uint16_t, ld_bf16)
DEFINE_ARGMAX(argmax_f32, float, ld_f32)
