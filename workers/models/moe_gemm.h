/* The grouped expert GEMM's pieces shared by workers/models/cpu_moe.c (the grouped GEMM of one projection) and
 * workers/models/cpu_moe_fused.c (a decode step's whole expert block in one call): the call's arguments, the
 * vector block of up to 4 outputs x 4 rows, a work item over one expert's rows, the active experts.
 * lora/native.py hashes this header with each kernel that includes it. */
#ifndef LORASERVE_MOE_GEMM_H
#define LORASERVE_MOE_GEMM_H

#include <stdint.h>
#include <stdlib.h>

#include "../../lora/native.h"
#include "../../lora/status.h"

typedef struct {
    const void *x;
    int64_t x_stride, in_dim;
    const void *w;
    int64_t out_dim, num_experts;
    const int64_t *offsets;
    void *y;
    int64_t y_stride, num_rows;
} moe_args;

enum { NO_AMX = 3, WRONG_SHAPE = 4 };   /* after status.h's */
#define OB 4               /* outputs of one block */
#define TB 4               /* rows of one block */
#define ITEM_OUT 64        /* outputs of one thread's work item */
#define PARALLEL_MIN (1 << 20)   /* weight elements of the active experts before threads share them */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* One block: y[r[t], o + i] for i < no, t < nt, over the full input dimension. NT is a compile-time bound of
 * nt (the calls pass literals, so the inner loop is unrolled for it); rows past nt repeat the last row. */
#if defined(__AVX512BF16__)
static inline __m512bh pairs(const uint16_t *p, int64_t n) {   /* first n (<= 32) bf16 elements */
    if (n >= 32) return (__m512bh)_mm512_loadu_si512(p);
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p);
}
#define BF16_STEP 32
#define BF16_FMA(acc, wp, xp, n) _mm512_dpbf16_ps(acc, pairs(wp, n), pairs(xp, n))
#else
#define BF16_STEP 16
#define BF16_FMA(acc, wp, xp, n) _mm512_fmadd_ps(load_bf16(wp, (int)(n)), load_bf16(xp, (int)(n)), acc)
#endif
#define F32_STEP 16
#define PREFETCH_ROWS 8   /* 4 and 16 measured the same */
#define F32_FMA(acc, wp, xp, n) _mm512_fmadd_ps(load_f32(wp, (int)(n)), load_f32(xp, (int)(n)), acc)

#define DEFINE_BLOCK(NAME, T, STEP, FMA, STORE)                                                             \
static inline __attribute__((always_inline)) void NAME(                                                  \
        const T *x, int64_t x_stride, const T *w, int64_t in_dim, int64_t row, int nt, int NT,             \
        int64_t o, int no, T *y, int64_t y_stride) {                                                      \
    __m512 acc[16];                                                                                      \
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();                                           \
    const T *wr[OB], *xr[TB];                                                                            \
    for (int i = 0; i < OB; i++) wr[i] = w + (o + (i < no ? i : no - 1)) * in_dim;                       \
    for (int t = 0; t < NT; t++) xr[t] = x + (row + (t < nt ? t : nt - 1)) * x_stride;                   \
    int64_t k = 0;                                                                                       \
    for (; k + STEP <= in_dim; k += STEP) {   /* whole vectors, then one masked tail */                  \
        for (int i = 0; i < OB; i++)   /* the next block's rows (the same columns), ahead of the demand */ \
            _mm_prefetch((const char *)(wr[i] + PREFETCH_ROWS * in_dim + k), _MM_HINT_T0);              \
        for (int i = 0; i < OB; i++)                                                                     \
            for (int t = 0; t < NT; t++) acc[i * TB + t] = FMA(acc[i * TB + t], wr[i] + k, xr[t] + k, STEP); \
    }                                                                                                    \
    if (k < in_dim)                                                                                      \
        for (int i = 0; i < OB; i++)                                                                     \
            for (int t = 0; t < NT; t++)                                                                 \
                acc[i * TB + t] = FMA(acc[i * TB + t], wr[i] + k, xr[t] + k, in_dim - k);                \
    float sums[16];                                                                                      \
    _mm512_storeu_ps(sums, reduce16(acc));                                                               \
    for (int t = 0; t < nt; t++)                                                                         \
        for (int i = 0; i < no; i++) y[(row + t) * y_stride + o + i] = STORE(sums[i * TB + t]);          \
}

DEFINE_BLOCK(block_bf16, uint16_t, BF16_STEP, BF16_FMA, bf16_store)
DEFINE_BLOCK(block_f32, float, F32_STEP, F32_FMA, f32_store)

#else /* portable scalar version */

#define DEFINE_BLOCK(NAME, T, LOAD, STORE)                                                                  \
static inline void NAME(const T *x, int64_t x_stride, const T *w, int64_t in_dim, int64_t row, int nt,    \
                        int NT, int64_t o, int no, T *y, int64_t y_stride) {                              \
    (void)NT;                                                                                            \
    for (int t = 0; t < nt; t++)                                                                         \
        for (int i = 0; i < no; i++) {                                                                   \
            const T *wr = w + (o + i) * in_dim, *xr = x + (row + t) * x_stride;                          \
            float acc = 0.f;                                                                             \
            _Pragma("omp simd reduction(+:acc)")                                                         \
            for (int64_t k = 0; k < in_dim; k++) acc += LOAD(wr[k]) * LOAD(xr[k]);                       \
            y[(row + t) * y_stride + o + i] = STORE(acc);                                                \
        }                                                                                                \
}

DEFINE_BLOCK(block_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_BLOCK(block_f32, float, f32_load, f32_store)
#endif

/* One work item: expert e's outputs [o_begin, o_end) for all of its rows [lo, hi). */
#define DEFINE_ITEM(NAME, T, BLOCK)                                                                         \
static inline void NAME(const moe_args *a, int64_t e, int64_t o_begin, int64_t o_end, int64_t lo, int64_t hi) {   \
    const T *x = a->x, *w = (const T *)a->w + e * a->out_dim * a->in_dim;                                 \
    T *y = a->y;                                                                                         \
    for (int64_t o = o_begin; o < o_end; o += OB) {                                                       \
        const int no = o_end - o < OB ? (int)(o_end - o) : OB;                                           \
        for (int64_t r = lo; r < hi; r += TB) {                                                          \
            const int nt = hi - r < TB ? (int)(hi - r) : TB;                                             \
            switch (nt) {   /* literal bounds: each case is its own unrolled block */                    \
            case 1: BLOCK(x, a->x_stride, w, a->in_dim, r, 1, 1, o, no, y, a->y_stride); break;          \
            case 2: BLOCK(x, a->x_stride, w, a->in_dim, r, 2, 2, o, no, y, a->y_stride); break;          \
            case 3: BLOCK(x, a->x_stride, w, a->in_dim, r, 3, 3, o, no, y, a->y_stride); break;          \
            default: BLOCK(x, a->x_stride, w, a->in_dim, r, 4, 4, o, no, y, a->y_stride); break;         \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
}

DEFINE_ITEM(item_bf16, uint16_t, block_bf16)
DEFINE_ITEM(item_f32, float, block_f32)

/* The active experts (those with rows), in order, into *experts (malloc'ed; the caller frees it); their count,
 * or -OUT_OF_RANGE / -OUT_OF_MEMORY. */
static inline int64_t active_experts(const moe_args *a, int64_t **experts) {
    const int64_t E = a->num_experts, *off = a->offsets;
    if (E < 1 || off[0] != 0 || off[E] != a->num_rows || a->in_dim < 1 || a->out_dim < 1) return -OUT_OF_RANGE;
    int64_t active = 0;
    for (int64_t e = 0; e < E; e++) {
        if (off[e + 1] < off[e]) return -OUT_OF_RANGE;
        active += off[e + 1] > off[e];
    }
    *experts = malloc(sizeof(int64_t) * (active ? active : 1));
    if (!*experts) return -OUT_OF_MEMORY;
    for (int64_t e = 0, i = 0; e < E; e++)
        if (off[e + 1] > off[e]) (*experts)[i++] = e;
    return active;
}

#endif
