/* A decode step's rows (up to 32) times a dense bf16 weight, read in place from oneDNN's packed layout.
 *
 * Why: prepack_linears (workers/parallel.py) keeps every linear weight once, in oneDNN's blocked layout, because
 * oneDNN's AMX kernels on it are what prefill needs. For one to four rows oneDNN streams that weight at ~12 GB/s
 * a thread here; this loop streams the same bytes at ~15.5 (results/dense_gemv_t1.md), so a batch-1 step's GEMMs
 * take ~0.8x the time without a second copy of any weight; 5-32 rows run on AMX tiles below.
 *
 * Layout (what workers/cpu_gemv.py checks, value for value in three chunks, before this kernel reads a weight):
 *   w  blocks of 32 outputs, each the whole padded input as bf16 pairs: w[b][p][i][j] = W[32 b + i][2 p + j],
 *      i.e. for input pair p the 32 outputs' pairs as 64 bf16 (two cache lines), pairs in order.
 *   x  [rows, in_dim] bf16, row stride x_stride, unit column stride; in_dim even
 *   y  [rows, out_dim] bf16, row stride y_stride; bias (bf16 or fp32, or none) [out_dim]
 * Each output lane accumulates the pairs in ascending order in fp32 (the instruction multiplies bf16 pairs
 * exactly) and rounds once: a row's bits do not depend on how many rows share the call (within one path).
 * Threads (torch's OpenMP pool, as the other kernels) share the 32-output blocks past PARALLEL_MIN.
 */
#include <stdint.h>
#include <stdlib.h>

#include "../lora/status.h"
#include "../lora/vec.h"

typedef struct {
    const uint16_t *x;
    int64_t x_stride, rows, in_dim;
    const uint16_t *w;
    int64_t in_padded, out_dim;
    const void *bias;
    int64_t bias_bf16;
    uint16_t *y;
    int64_t y_stride;
    int64_t act;   /* SILU_AND_MUL: the outputs are [gate | up] (halves of whole blocks); y [rows, out_dim / 2] */
} gemv_args;

/* act: SILU_AND_MUL runs each gate block with its up block (half the outputs later) and stores
 * round(round(silu(g)) * u) of their rounded outputs (vec.h's silu_mul_row, cpu_ops.c's SiLU-and-mul kernel): the
 * same bits as the GEMV then that kernel, without its pass over the step's [rows, 2 I] and while the weight
 * streams (the activation's divisions overlap the memory-bound loop). */
enum { NO_ACT = 0, SILU_AND_MUL = 1 };

enum { NO_BF16_DOT = 3, WRONG_SHAPE = 4 };   /* after status.h's */
#define NB 32                     /* outputs of one block */
#define MOST_ROWS 32              /* a call's rows at most (the AMX path's; the fused activation's scratch) */
#define MAX_ROWS 8                /* rows of one pass over a block (16 accumulators) */
#define VECTOR_ROWS 4             /* up to which the vector path runs, the AMX one past it (when built) */
#define PREFETCH_PAIRS 16         /* 2 KiB ahead; without it ~0.94x oneDNN at one row, with it 1.26x (8: the
                                     same, 32: 1.13x) */
#define PARALLEL_MIN (1 << 20)    /* weight elements before threads share the blocks */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

static inline __m512 bias16(const gemv_args *a, int64_t o, __mmask16 m) {
    if (!a->bias) return _mm512_setzero_ps();
    if (a->bias_bf16) return load_bf16((const uint16_t *)a->bias + o, __builtin_popcount(m));
    return _mm512_maskz_loadu_ps(m, (const float *)a->bias + o);
}

/* block b for rows [r0, r0 + NT) into yb (its first output of row 0; row stride ys); NT a literal at each call, so
 * the row loops unroll */
static inline __attribute__((always_inline)) void block(const gemv_args *a, int64_t b, int64_t r0, int NT,
                                                        uint16_t *yb, int64_t ys) {
    const uint16_t *wb = a->w + b * NB * a->in_padded;
    const int64_t pairs = a->in_dim / 2;
    const uint32_t *xr[MAX_ROWS];
    for (int t = 0; t < NT; t++) xr[t] = (const uint32_t *)(a->x + (r0 + t) * a->x_stride);
    __m512 lo[MAX_ROWS], hi[MAX_ROWS];
    for (int t = 0; t < NT; t++) lo[t] = hi[t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        _mm_prefetch((const char *)(wb + (p + PREFETCH_PAIRS) * 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + (p + PREFETCH_PAIRS) * 64 + 32), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + p * 64);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + p * 64 + 32);
        for (int t = 0; t < NT; t++) {
            const __m512bh xp = (__m512bh)_mm512_set1_epi32((int)xr[t][p]);
            lo[t] = _mm512_dpbf16_ps(lo[t], w0, xp);
            hi[t] = _mm512_dpbf16_ps(hi[t], w1, xp);
        }
    }
    const int64_t o = b * NB, n = a->out_dim - o < NB ? a->out_dim - o : NB;
    const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1u);
    const __mmask16 m1 = n >= 32 ? 0xffff : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1u);
    const __m512 b0 = bias16(a, o, m0), b1 = m1 ? bias16(a, o + 16, m1) : _mm512_setzero_ps();
    for (int t = 0; t < NT; t++) {
        uint16_t *yr = yb + (r0 + t) * ys;
        /* the instruction's conversion: round to nearest even, NaN kept */
        _mm256_mask_storeu_epi16(yr, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(lo[t], b0)));
        if (m1) _mm256_mask_storeu_epi16(yr + 16, m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(hi[t], b1)));
    }
}

/* block b of every row into yb (row stride ys) */
static void rows_block(const gemv_args *a, int64_t b, uint16_t *yb, int64_t ys) {
    for (int64_t r = 0; r < a->rows; r += MAX_ROWS) {
        switch (a->rows - r) {
        case 1: block(a, b, r, 1, yb, ys); break;
        case 2: block(a, b, r, 2, yb, ys); break;
        case 3: block(a, b, r, 3, yb, ys); break;
        case 4: block(a, b, r, 4, yb, ys); break;
        case 5: block(a, b, r, 5, yb, ys); break;
        case 6: block(a, b, r, 6, yb, ys); break;
        case 7: block(a, b, r, 7, yb, ys); break;
        default: block(a, b, r, 8, yb, ys); break;
        }
    }
}

/* SILU_AND_MUL's epilogue: gu [rows][2 NB] holds gate block b | up block b, rounded */
static inline void silu_pair(const gemv_args *a, int64_t b, const uint16_t (*gu)[2 * NB]) {
    for (int64_t r = 0; r < a->rows; r++) silu_mul_row_bf16(gu[r], NB, a->y + r * a->y_stride + b * NB);
}

static int gemv_vector(const gemv_args *a) {
    if (a->act == SILU_AND_MUL) {
        const int64_t pairs = a->out_dim / 2 / NB;
        #pragma omp parallel for schedule(static) if (a->out_dim * a->in_dim > PARALLEL_MIN)
        for (int64_t b = 0; b < pairs; b++) {
            uint16_t gu[MOST_ROWS][2 * NB];
            rows_block(a, b, &gu[0][0], 2 * NB);
            rows_block(a, b + pairs, &gu[0][NB], 2 * NB);
            silu_pair(a, b, gu);
        }
        return 0;
    }
    const int64_t blocks = (a->out_dim + NB - 1) / NB;
    #pragma omp parallel for schedule(static) if (a->out_dim * a->in_dim > PARALLEL_MIN)
    for (int64_t b = 0; b < blocks; b++) rows_block(a, b, a->y + b * NB, a->y_stride);
    return 0;
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* More rows on AMX tiles, the weight as B tiles read in place: for 16 input pairs, the 32 outputs' pairs are 16
 * rows of 128 bytes, each tile half (16 outputs) 64 bytes of them at a 128-byte stride. x's rows, copied once
 * into a zero-padded buffer (whole 16-row tiles, the padded input), are the A tiles. Up to AMX_ROWS rows a call
 * (four C tiles). tdpbf16ps multiplies bf16 pairs exactly and sums in fp32 in its own order (not the vector
 * path's: a row's bits depend on which of the two paths its call took). */
#define AMX_ROWS 32
static void amx_block(const gemv_args *a, const uint16_t *xp, int64_t b, float (*acc)[16][16]) {
    const uint16_t *wb = a->w + b * NB * a->in_padded;
    const int64_t chunks = a->in_padded / 32, stride = 2 * a->in_padded, two = a->rows > 16;
    amx_zero_acc();
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *wc = wb + c * 16 * 64;   /* pairs 16 c .. 16 c + 15 */
        for (int l = 0; l < 32; l++)   /* the next chunk's 2 KiB into L2 (into L1, or 2-4 chunks ahead: the same) */
            _mm_prefetch((const char *)(wc + 16 * 64) + 64 * l, _MM_HINT_T1);
        _tile_loadd(6, wc, 128);
        _tile_loadd(7, wc + 32, 128);
        _tile_loadd(4, xp + 32 * c, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, xp + 16 * a->in_padded + 32 * c, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    amx_store_acc(&acc[0][0][0], two);
}

/* block b's accumulators (acc) into yb (its first output of row 0; row stride ys), the bias added */
static inline void amx_store(const gemv_args *a, float (*acc)[16][16], int64_t b, uint16_t *yb, int64_t ys) {
    const int64_t o = b * NB, n = a->out_dim - o < NB ? a->out_dim - o : NB;
    const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1u);
    const __mmask16 m1 = n >= 32 ? 0xffff : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1u);
    const __m512 b0 = bias16(a, o, m0), b1 = m1 ? bias16(a, o + 16, m1) : _mm512_setzero_ps();
    for (int64_t r = 0; r < a->rows; r++) {
        uint16_t *yr = yb + r * ys;
        const int q = 2 * (int)(r >> 4);
        _mm256_mask_storeu_epi16(yr, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(acc[q][r & 15]), b0)));
        if (m1) _mm256_mask_storeu_epi16(yr + 16, m1, (__m256i)_mm512_cvtneps_pbh(
            _mm512_add_ps(_mm512_load_ps(acc[q + 1][r & 15]), b1)));
    }
}

static int gemv_amx(const gemv_args *a) {
    const int64_t groups = (a->rows + 15) / 16, blocks = (a->out_dim + NB - 1) / NB, pairs = a->out_dim / 2 / NB;
    uint16_t *xp = aligned_alloc(64, (size_t)(groups * 16 * a->in_padded * 2 + 63) / 64 * 64);
    if (!xp) return OUT_OF_MEMORY;
    memset(xp, 0, (size_t)groups * 16 * a->in_padded * 2);
    for (int64_t r = 0; r < a->rows; r++) memcpy(xp + r * a->in_padded, a->x + r * a->x_stride, 2 * a->in_dim);
    #pragma omp parallel if (a->out_dim * a->in_dim > PARALLEL_MIN)
    {
        amx_configure();
        float acc[4][16][16] __attribute__((aligned(64)));   /* C tile q: rows 16 (q >> 1) + t, outputs 16 (q & 1) */
        if (a->act == SILU_AND_MUL) {
            uint16_t gu[MOST_ROWS][2 * NB];
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < pairs; b++) {
                amx_block(a, xp, b, acc);
                amx_store(a, acc, b, &gu[0][0], 2 * NB);
                amx_block(a, xp, b + pairs, acc);
                amx_store(a, acc, b + pairs, &gu[0][NB], 2 * NB);
                silu_pair(a, b, gu);
            }
        } else {
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                amx_block(a, xp, b, acc);
                amx_store(a, acc, b, a->y + b * NB, a->y_stride);
            }
        }
        _tile_release();
    }
    free(xp);
    return 0;
}
static int amx_ok;   /* Linux lent the tile state (gemv_init) */
int gemv_init(void) {
    amx_ok = !amx_permit();
    return 0;
}
#else
#define AMX_ROWS 0
static const int amx_ok = 0;
static int gemv_amx(const gemv_args *a) { (void)a; return NO_BF16_DOT; }
int gemv_init(void) { return 0; }
#endif
/* the most rows a call takes on a path faster than oneDNN's (workers/cpu_gemv.py sends more to oneDNN) */
int gemv_max_rows(void) { return amx_ok ? AMX_ROWS : VECTOR_ROWS; }

int gemv_bf16(const gemv_args *a) {
    if (a->in_dim % 2 || a->in_padded < a->in_dim || a->rows < 0 || a->out_dim <= 0) return WRONG_SHAPE;
    if (a->act == SILU_AND_MUL && (a->out_dim % (2 * NB) || a->rows > MOST_ROWS)) return WRONG_SHAPE;
    if (a->act != NO_ACT && a->act != SILU_AND_MUL) return WRONG_SHAPE;
    if (amx_ok && a->rows > VECTOR_ROWS && a->rows <= AMX_ROWS && a->in_padded % 32 == 0) return gemv_amx(a);
    return gemv_vector(a);
}
#else
int gemv_bf16(const gemv_args *a) { (void)a; return NO_BF16_DOT; }
int gemv_init(void) { return NO_BF16_DOT; }
int gemv_max_rows(void) { return 0; }
#endif
