/* The CPU LoRA kernel's arithmetic (shrink then expand) over groups of rows, shared by lora/backends/cpu_sgmv.c
 * (its entries and threads) and workers/models/cpu_moe_fused.c (expert LoRA inside the fused MoE block): one
 * copy, so both give the same bits. lora/native.py hashes it with each kernel that includes it.
 *
 *   a  [L, SR, in]       contiguous; rows s*R + j of a slot, j < rank, are used
 *   b  (stack pointers)  b[s] [L, out_dims[s], R] contiguous; columns j >= rank must be zero (the
 *                        slot pool's contract: the bf16-dot paths multiply them by zero h)
 *   y  [T, >= y_offsets[stack-1] + out_dims[stack-1]], row stride y_stride, updated in place:
 *        y[t, y_offsets[s] + o] += sum_j b[s][slot, o, j] * (a[slot, s*R + j] . x[t])
 * Group g (one adapter) owns rows[group_start[g] .. group_start[g+1]) of x and y. The groups are
 * checked against num_rows, num_slots, R and num_indices before anything is read (OUT_OF_RANGE).
 * The bgmv entries take one slot per token instead (token_slots[num_rows], -1 = base) and group
 * the tokens themselves, every slot at rank R: the graph phase has no host plan to pass.
 * h is kept in fp32; bf16 y is read, updated in fp32 and rounded to nearest even once.
 * a_shared (NULL: none) [num_slots]: nonzero where every slice of the slot holds slice 0's A (a MoE
 * gate_up adapter in PEFT's fused format: gate and up share A), so slice 0's rows are read for all
 * of them: read once from memory, again from cache (the decode is bound by the bytes it reads).
 */
#ifndef LORASERVE_SGMV_H
#define LORASERVE_SGMV_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "status.h"

typedef struct {                   /* one call's operands; pointers to T (bf16 or fp32) */
    const void *x;
    int64_t x_stride, in_dim;
    const void *a;
    int64_t a_slot_stride, stack, R;
    const void *const *b;
    const int64_t *out_dims, *y_offsets;
    void *y;
    int64_t y_stride;
    const int64_t *group_slot, *group_rank, *group_start, *rows;
    int64_t num_rows, num_slots, num_indices;   /* rows of x and y, slots, entries of rows[] */
    const int64_t *a_shared;                     /* [num_slots] or NULL, see above */
} sgmv_args;

/* The row of a holding rank row q (= s * R + j) of slot's stacked A. */
static inline int64_t a_row(const sgmv_args *args, int64_t slot, int64_t q) {
    return args->a_shared && args->a_shared[slot] ? q % args->R : q;
}

/* The operands of sgmv_args as locals of element type T, for the typed range functions below. */
#define SGMV_OPERANDS(T)                                                                             \
    const T *x = args->x, *a = args->a, *const *b = (const T *const *)args->b;                       \
    T *y = args->y;                                                                                  \
    const int64_t x_stride = args->x_stride, in_dim = args->in_dim, a_slot_stride = args->a_slot_stride; \
    const int64_t stack = args->stack, R = args->R, y_stride = args->y_stride;                       \
    const int64_t *out_dims = args->out_dims, *y_offsets = args->y_offsets, *rows = args->rows;      \
    const int64_t *group_slot = args->group_slot, *group_rank = args->group_rank;                    \
    const int64_t *group_start = args->group_start;                                                  \
    const int64_t SR = stack * R;

#define CHUNK 32 /* tokens of one adapter processed together: their h stays in L1 */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <omp.h>

#define MAX_STACK 8

#define DEFINE_SGMV(NAME, T, LOAD, STORE, LOAD16, STORE16)                                            \
static int NAME##_range(const sgmv_args *args, int64_t g_begin, int64_t g_end) {                  \
    SGMV_OPERANDS(T)                                                                                 \
    float *h = malloc(sizeof(float) * CHUNK * SR), *xf = malloc(sizeof(float) * CHUNK * in_dim);     \
    if (!h || !xf) { free(h); free(xf); return OUT_OF_MEMORY; }                                      \
    for (int64_t g = g_begin; g < g_end; g++) {                                                       \
        const int64_t slot = group_slot[g], rank = group_rank[g];                                    \
        for (int64_t c0 = group_start[g]; c0 < group_start[g + 1]; c0 += CHUNK) {                    \
            const int64_t n = group_start[g + 1] - c0 < CHUNK ? group_start[g + 1] - c0 : CHUNK;      \
            const int64_t *r = rows + c0;                                                            \
            /* shrink: h[t, s*R + j] = a[slot, s*R + j] . x[r[t]]; x rows converted once, each      \
               a row read once per 4 tokens */                                                       \
            for (int64_t t = 0; t < n; t++)                                                          \
                for (int64_t k = 0; k < in_dim; k++) xf[t * in_dim + k] = LOAD(x[r[t] * x_stride + k]); \
            for (int64_t s = 0; s < stack; s++) {                                                    \
                for (int64_t j = 0; j < rank; j++) {                                                 \
                    const T *arow = a + slot * a_slot_stride + a_row(args, slot, s * R + j) * in_dim; \
                    for (int64_t t0 = 0; t0 < n; t0 += 4) {                                          \
                        const int nt = n - t0 < 4 ? (int)(n - t0) : 4;                               \
                        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(),                   \
                                         _mm512_setzero_ps(), _mm512_setzero_ps()};                  \
                        for (int64_t k = 0; k < in_dim; k += 16) {                                   \
                            const int m = in_dim - k < 16 ? (int)(in_dim - k) : 16;                  \
                            const __m512 av = LOAD16(arow + k, m);                                   \
                            for (int i = 0; i < nt; i++)                                             \
                                acc[i] = _mm512_fmadd_ps(av, load_f32(xf + (t0 + i) * in_dim + k, m), acc[i]); \
                        }                                                                            \
                        for (int i = 0; i < nt; i++) h[(t0 + i) * SR + s * R + j] = _mm512_reduce_add_ps(acc[i]); \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            /* expand: 16 outputs at a time, their rank-long dots summed by one reduce16 */          \
            for (int64_t s = 0; s < stack; s++) {                                                    \
                const int64_t out = out_dims[s];                                                     \
                const T *bs = b[s] + slot * out * R;                                                 \
                int64_t o = 0;                                                                       \
                for (; o + 16 <= out; o += 16) {                                                     \
                    __m512 bv[16], p[16];                                                            \
                    if (rank <= 16) /* the usual case: the block's weights converted once */         \
                        for (int i = 0; i < 16; i++) bv[i] = LOAD16(bs + (o + i) * R, (int)rank);    \
                    for (int64_t t = 0; t < n; t++) {                                                \
                        const float *ht = h + t * SR + s * R;                                        \
                        __m512 sum = _mm512_setzero_ps();                                            \
                        for (int64_t jc = 0; jc < rank; jc += 16) {                                  \
                            const int m = rank - jc < 16 ? (int)(rank - jc) : 16;                    \
                            const __m512 hv = load_f32(ht + jc, m);                                  \
                            for (int i = 0; i < 16; i++)                                             \
                                p[i] = _mm512_mul_ps(rank <= 16 ? bv[i] : LOAD16(bs + (o + i) * R + jc, m), hv); \
                            sum = _mm512_add_ps(sum, reduce16(p));                                   \
                        }                                                                            \
                        T *yp = y + r[t] * y_stride + y_offsets[s] + o;                              \
                        STORE16(yp, _mm512_add_ps(LOAD16(yp, 16), sum));                             \
                    }                                                                                \
                }                                                                                    \
                for (; o < out; o++) {                                                               \
                    for (int64_t t = 0; t < n; t++) {                                                \
                        const float *ht = h + t * SR + s * R;                                        \
                        float acc = 0.f;                                                             \
                        for (int64_t j = 0; j < rank; j++) acc += LOAD(bs[o * R + j]) * ht[j];       \
                        T *yp = y + r[t] * y_stride + y_offsets[s] + o;                              \
                        *yp = STORE(LOAD(*yp) + acc);                                                \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    free(h);                                                                                         \
    free(xf);                                                                                        \
    return 0;                                                                                        \
}

DEFINE_SGMV(sgmv_bf16, uint16_t, bf16_load, bf16_store, load_bf16, store_bf16)
DEFINE_SGMV(sgmv_f32, float, f32_load, f32_store, load_f32, store_f32)

#else /* portable scalar version */

#define DEFINE_SGMV(NAME, T, LOAD, STORE)                                                              \
static int NAME##_range(const sgmv_args *args, int64_t g_begin, int64_t g_end) {                  \
    SGMV_OPERANDS(T)                                                                                 \
    float *h = malloc(sizeof(float) * CHUNK * SR);                                                  \
    float *bo = malloc(sizeof(float) * R);                                                          \
    if (!h || !bo) { free(h); free(bo); return OUT_OF_MEMORY; }                                     \
    for (int64_t g = g_begin; g < g_end; g++) {                                                       \
        const int64_t slot = group_slot[g], rank = group_rank[g];                                    \
        for (int64_t c0 = group_start[g]; c0 < group_start[g + 1]; c0 += CHUNK) {                    \
            const int64_t n = group_start[g + 1] - c0 < CHUNK ? group_start[g + 1] - c0 : CHUNK;      \
            const int64_t *r = rows + c0;                                                            \
            for (int64_t s = 0; s < stack; s++) {                                                    \
                for (int64_t j = 0; j < rank; j++) {                                                 \
                    const T *arow = a + slot * a_slot_stride + a_row(args, slot, s * R + j) * in_dim; \
                    for (int64_t t = 0; t < n; t++) {                                                \
                        const T *xr = x + r[t] * x_stride;                                           \
                        float acc = 0.f;                                                             \
                        _Pragma("omp simd reduction(+:acc)")                                         \
                        for (int64_t k = 0; k < in_dim; k++) acc += LOAD(xr[k]) * LOAD(arow[k]);     \
                        h[t * SR + s * R + j] = acc;                                                 \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            for (int64_t s = 0; s < stack; s++) {                                                    \
                const int64_t out = out_dims[s];                                                     \
                const T *bs = b[s] + slot * out * R;                                                 \
                for (int64_t o = 0; o < out; o++) {                                                  \
                    for (int64_t j = 0; j < rank; j++) bo[j] = LOAD(bs[o * R + j]);                  \
                    for (int64_t t = 0; t < n; t++) {                                                \
                        const float *ht = h + t * SR + s * R;                                        \
                        float acc = 0.f;                                                             \
                        _Pragma("omp simd reduction(+:acc)")                                         \
                        for (int64_t j = 0; j < rank; j++) acc += bo[j] * ht[j];                     \
                        T *yp = y + r[t] * y_stride + y_offsets[s] + o;                              \
                        *yp = STORE(LOAD(*yp) + acc);                                                \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    free(h);                                                                                         \
    free(bo);                                                                                        \
    return 0;                                                                                        \
}

DEFINE_SGMV(sgmv_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_SGMV(sgmv_f32, float, f32_load, f32_store)
#endif

#include "sgmv_dp.h"

#endif
