/* Segmented LoRA (shrink then expand, one call per LoRA layer) for the CPU, in plain C.
 *
 * Why: with a few tokens per adapter, torch runs one bmm per shrink and per stacked slice,
 * and on CPU each costs ~10 us per adapter in the batch (bf16 small-GEMM dispatch), about
 * ten times the time to read that adapter's weights. Here every adapter's weights are read
 * once per step, its tokens' activations stay in L1, and nothing is padded.
 *
 * Layout (the slot pool's, see lora/slots.py; R = max rank, SR = stack * R):
 *   x  [T, in]           row stride x_stride (elements), unit column stride
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../native.h"

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

enum { OUT_OF_MEMORY = 1, OUT_OF_RANGE = 2 };   /* nonzero returns */

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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
/* bf16 with the AVX512-BF16 dot instruction (32 multiply-adds of bf16 pairs into fp32 lanes):
 * no conversions in the shrink, and in the expand two 16-rank rows of b per load. h is rounded
 * to bf16 for the expand, as torch's bf16 GEMMs round it. Needs R == 16 or R % 32 == 0. */
static inline __m512bh load_pairs(const uint16_t *p, int64_t n) {  /* first n (<= 32) elements */
    const __mmask32 m = n >= 32 ? 0xffffffffu : (__mmask32)((1u << n) - 1u);
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

/* v[k] holds rows 2k (lanes 0-7) and 2k+1 (lanes 8-15) as 8 partial sums each; lane i of the
 * result = the sum of row i. */
static inline __m512 reduce_pairs8(const __m512 *v) {
    const __m512 w0 = pair_sum_pd(pair_sum_ps(v[0], v[1]), pair_sum_ps(v[2], v[3]));
    const __m512 w1 = pair_sum_pd(pair_sum_ps(v[4], v[5]), pair_sum_ps(v[6], v[7]));
    /* blocks: w[k] block b = [S(v[4k], b) .. S(v[4k+3], b)]; row 2j sums blocks 0, 1 of v[j], row 2j+1
     * blocks 2, 3; so block_sum gives rows [0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15] */
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    return _mm512_permutexvar_ps(order, block_sum(w0, w1));
}

/* Shrink rows q = s * R + j in [q0, q1) of one chunk of one adapter's tokens into bf16 h
 * (rounded as torch's bf16 GEMMs round it); rows past the adapter's rank are exactly zero. */
static void dp_shrink(const sgmv_args *args, int64_t slot, int64_t rank, int64_t n, const int64_t *r, uint16_t *hb,
                      int64_t q0, int64_t q1) {
    const uint16_t *x = args->x, *a = args->a;
    const int64_t in_dim = args->in_dim, R = args->R, SR = args->stack * R;
    for (int64_t q = q0; q < q1; q++) {
        if (q % R >= rank) {
            for (int64_t t = 0; t < n; t++) hb[t * SR + q] = 0;
            continue;
        }
        const uint16_t *arow = a + slot * args->a_slot_stride + a_row(args, slot, q) * in_dim;
        for (int64_t t0 = 0; t0 < n; t0 += 4) {   /* each a row read once per 4 tokens */
            const int nt = n - t0 < 4 ? (int)(n - t0) : 4;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t k = 0; k < in_dim; k += 32) {
                const __m512bh av = load_pairs(arow + k, in_dim - k);
                for (int i = 0; i < nt; i++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], av, load_pairs(x + r[t0 + i] * args->x_stride + k, in_dim - k));
            }
            for (int i = 0; i < nt; i++) hb[(t0 + i) * SR + q] = bf16_store(_mm512_reduce_add_ps(acc[i]));
        }
    }
}

#define MANY_TOKENS 4   /* from this many tokens of one adapter, transposing b's blocks pays */

/* Expand item q: a block of 16 outputs of one slice, or a slice's last (< 16) outputs. */
static void dp_expand(const sgmv_args *args, int64_t slot, int64_t rank, int64_t n, const int64_t *r,
                      const uint16_t *hb, const int64_t *item_start, int64_t q) {
    const int64_t R = args->R, SR = args->stack * R;
    int64_t s = 0;
    while (q >= item_start[s + 1]) s++;
    const int64_t out = args->out_dims[s], o = (q - item_start[s]) * 16;
    const uint16_t *bs = (const uint16_t *)args->b[s] + slot * out * R;
    uint16_t *y = (uint16_t *)args->y + args->y_offsets[s];
    if (o + 16 > out) {   /* the tail, scalar */
        for (int64_t t = 0; t < n; t++)
            for (int64_t oo = o; oo < out; oo++) {
                float acc = 0.f;
                for (int64_t j = 0; j < rank; j++) acc += bf16_load(bs[oo * R + j]) * bf16_load(hb[t * SR + s * R + j]);
                uint16_t *yp = y + r[t] * args->y_stride + oo;
                *yp = bf16_store(bf16_load(*yp) + acc);
            }
        return;
    }
    if (R == 16 && n >= MANY_TOKENS) {
        /* The block transposed once, so that lane i is output o+i: bt[p] lane i = the rank pair
         * (2p, 2p+1) of row o+i. Each token then needs 8 dots against its broadcast h pairs and
         * no reduction (a third of the work of the form below, which pays no transpose). */
        uint32_t bt[8][16] __attribute__((aligned(64)));
        for (int i = 0; i < 16; i++)
            for (int p = 0; p < 8; p++) memcpy(&bt[p][i], bs + (o + i) * 16 + 2 * p, sizeof(uint32_t));
        __m512bh btv[8];
        for (int p = 0; p < 8; p++) btv[p] = (__m512bh)_mm512_load_si512(bt[p]);
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *ht = hb + t * SR + s * R;
            __m512 acc = _mm512_setzero_ps();
            for (int p = 0; p < 8; p++) {
                uint32_t pair;
                memcpy(&pair, ht + 2 * p, sizeof pair);
                acc = _mm512_dpbf16_ps(acc, btv[p], (__m512bh)_mm512_set1_epi32((int)pair));
            }
            uint16_t *yp = y + r[t] * args->y_stride + o;
            _mm256_storeu_si256((__m256i *)yp, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(load_bf16(yp, 16), acc)));
        }
        return;
    }
    __m512bh bp[8];
    if (R == 16)   /* two rows of b per load, loaded once for all tokens */
        for (int k = 0; k < 8; k++) bp[k] = load_pairs(bs + (o + 2 * k) * 16, 32);
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *ht = hb + t * SR + s * R;
        __m512 sums;
        if (R == 16) {   /* h twice, matching the two rows */
            const __m512bh hh = (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)ht));
            __m512 v[8];
            for (int k = 0; k < 8; k++) v[k] = _mm512_dpbf16_ps(_mm512_setzero_ps(), bp[k], hh);
            sums = reduce_pairs8(v);
        } else {         /* R % 32 == 0: one row per dot */
            __m512 v[16];
            for (int i = 0; i < 16; i++) {
                v[i] = _mm512_setzero_ps();
                for (int64_t jc = 0; jc < rank; jc += 32)
                    v[i] = _mm512_dpbf16_ps(v[i], load_pairs(bs + (o + i) * R + jc, 32), load_pairs(ht + jc, 32));
            }
            sums = reduce16(v);
        }
        uint16_t *yp = y + r[t] * args->y_stride + o;
        /* the instruction's conversion: round to nearest even, NaN kept */
        _mm256_storeu_si256((__m256i *)yp, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(load_bf16(yp, 16), sums)));
    }
}

/* Threads come from torch's own OpenMP pool (the same libgomp is loaded), whose workers spin
 * between torch's ops: a pool of our own would fight them for the cores. Many adapters: a
 * thread takes whole adapters; few: the threads share each adapter's rows and output blocks. */
static int sgmv_bf16_dp_range(const sgmv_args *args, int64_t g_begin, int64_t g_end) {
    const int64_t stack = args->stack, SR = stack * args->R;
    int64_t item_start[MAX_STACK + 1] = {0};
    for (int64_t s = 0; s < stack; s++) item_start[s + 1] = item_start[s] + (args->out_dims[s] + 15) / 16;
    const int64_t items = item_start[stack];
    const int by_group = g_end - g_begin >= 2 * omp_get_max_threads();
    const size_t hb_bytes = sizeof(uint16_t) * (CHUNK * SR + 32);   /* + 32: whole-vector loads */
    uint16_t *shared_hb = NULL;
    if (!by_group && !(shared_hb = malloc(hb_bytes))) return OUT_OF_MEMORY;
    int status = 0;
    #pragma omp parallel
    {
        uint16_t *hb = by_group ? malloc(hb_bytes) : shared_hb;
        if (!hb) {
            #pragma omp atomic write
            status = OUT_OF_MEMORY;
        }
        /* All or nothing: a thread without scratch must not leave its share of y undone. */
        #pragma omp barrier
        if (by_group && !status) {
            #pragma omp for schedule(dynamic, 1)
            for (int64_t g = g_begin; g < g_end; g++) {
                const int64_t slot = args->group_slot[g], rank = args->group_rank[g];
                for (int64_t c0 = args->group_start[g]; c0 < args->group_start[g + 1]; c0 += CHUNK) {
                    const int64_t n = args->group_start[g + 1] - c0 < CHUNK ? args->group_start[g + 1] - c0 : CHUNK;
                    const int64_t *r = args->rows + c0;
                    dp_shrink(args, slot, rank, n, r, hb, 0, SR);
                    for (int64_t q = 0; q < items; q++) dp_expand(args, slot, rank, n, r, hb, item_start, q);
                }
            }
        } else if (!by_group) {   /* the shared buffer: the same branch on every thread */
            for (int64_t g = g_begin; g < g_end; g++) {
                const int64_t slot = args->group_slot[g], rank = args->group_rank[g];
                for (int64_t c0 = args->group_start[g]; c0 < args->group_start[g + 1]; c0 += CHUNK) {
                    const int64_t n = args->group_start[g + 1] - c0 < CHUNK ? args->group_start[g + 1] - c0 : CHUNK;
                    const int64_t *r = args->rows + c0;
                    #pragma omp for schedule(static)
                    for (int64_t q = 0; q < SR; q++) dp_shrink(args, slot, rank, n, r, hb, q, q + 1);
                    #pragma omp for schedule(static)
                    for (int64_t q = 0; q < items; q++) dp_expand(args, slot, rank, n, r, hb, item_start, q);
                }
            }
        }
        if (by_group) free(hb);
    }
    free(shared_hb);
    return status;
}
#define BF16_DP_OK(p) (((p)->R == 16 || (p)->R % 32 == 0) && (p)->stack <= MAX_STACK)
#else
#define BF16_DP_OK(p) 0
#define sgmv_bf16_dp_range sgmv_bf16_range
#endif

/* The code above trusts the groups: every index is checked here first. */
static int check_groups(const sgmv_args *args, int64_t num_groups) {
    for (int64_t g = 0; g < num_groups; g++) {
        const int64_t lo = args->group_start[g], hi = args->group_start[g + 1];
        if (args->group_slot[g] < 0 || args->group_slot[g] >= args->num_slots || args->group_rank[g] < 0
            || args->group_rank[g] > args->R || lo < 0 || hi < lo || hi > args->num_indices)
            return OUT_OF_RANGE;
        for (int64_t i = lo; i < hi; i++)
            if (args->rows[i] < 0 || args->rows[i] >= args->num_rows) return OUT_OF_RANGE;
    }
    return 0;
}

/* The bf16-dot path runs on torch's OpenMP threads (above); the others on the calling thread. */
static int add_bf16(const sgmv_args *args, int64_t num_groups) {
    return BF16_DP_OK(args) ? sgmv_bf16_dp_range(args, 0, num_groups) : sgmv_bf16_range(args, 0, num_groups);
}
static int add_f32(const sgmv_args *args, int64_t num_groups) { return sgmv_f32_range(args, 0, num_groups); }

int sgmv_add_bf16(const sgmv_args *args, int64_t num_groups) {
    const int bad = check_groups(args, num_groups);
    return bad ? bad : add_bf16(args, num_groups);
}
int sgmv_add_f32(const sgmv_args *args, int64_t num_groups) {
    const int bad = check_groups(args, num_groups);
    return bad ? bad : add_f32(args, num_groups);
}

/* Tokens grouped by slot (a counting sort, in token order within a slot), each slot at rank R. */
static int by_token(int (*add)(const sgmv_args *, int64_t), const sgmv_args *args, const int64_t *token_slots) {
    const int64_t T = args->num_rows, L = args->num_slots;
    int64_t *scratch = malloc(sizeof(int64_t) * (5 * L + 2 + T));
    if (!scratch) return OUT_OF_MEMORY;
    int64_t *count = scratch, *slot = count + L, *rank = slot + L, *start = rank + L, *next = start + L + 1;
    int64_t *rows = next + L + 1;
    memset(count, 0, sizeof(int64_t) * L);
    for (int64_t t = 0; t < T; t++) {
        if (token_slots[t] >= L) { free(scratch); return OUT_OF_RANGE; }
        if (token_slots[t] >= 0) count[token_slots[t]]++;
    }
    int64_t G = 0;
    start[0] = 0;
    for (int64_t l = 0; l < L; l++)
        if (count[l]) {
            slot[G] = l, rank[G] = args->R, next[l] = start[G], start[G + 1] = start[G] + count[l];
            G++;
        }
    for (int64_t t = 0; t < T; t++)
        if (token_slots[t] >= 0) rows[next[token_slots[t]]++] = t;
    sgmv_args grouped = *args;
    grouped.group_slot = slot, grouped.group_rank = rank, grouped.group_start = start, grouped.rows = rows;
    grouped.num_indices = T;
    const int status = add(&grouped, G);
    free(scratch);
    return status;
}

int bgmv_add_bf16(const sgmv_args *args, const int64_t *token_slots) { return by_token(add_bf16, args, token_slots); }
int bgmv_add_f32(const sgmv_args *args, const int64_t *token_slots) { return by_token(add_f32, args, token_slots); }
