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

#include "../lora/native.h"
#include "../lora/status.h"

typedef struct {
    const uint16_t *x;
    int64_t x_stride, rows, in_dim;
    const uint16_t *w;
    int64_t in_padded, out_dim;
    const void *bias;
    int64_t bias_bf16;
    uint16_t *y;
    int64_t y_stride;
} gemv_args;

enum { NO_BF16_DOT = 3, WRONG_SHAPE = 4 };   /* after status.h's */
#define NB 32                     /* outputs of one block */
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

/* block b for rows [r0, r0 + NT); NT a literal at each call, so the row loops unroll */
static inline __attribute__((always_inline)) void block(const gemv_args *a, int64_t b, int64_t r0, int NT) {
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
        uint16_t *yr = a->y + (r0 + t) * a->y_stride + o;
        /* the instruction's conversion: round to nearest even, NaN kept */
        _mm256_mask_storeu_epi16(yr, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(lo[t], b0)));
        if (m1) _mm256_mask_storeu_epi16(yr + 16, m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(hi[t], b1)));
    }
}

static int gemv_vector(const gemv_args *a) {
    const int64_t blocks = (a->out_dim + NB - 1) / NB;
    #pragma omp parallel for schedule(static) if (a->out_dim * a->in_dim > PARALLEL_MIN)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r = 0; r < a->rows; r += MAX_ROWS) {
            switch (a->rows - r) {
            case 1: block(a, b, r, 1); break;
            case 2: block(a, b, r, 2); break;
            case 3: block(a, b, r, 3); break;
            case 4: block(a, b, r, 4); break;
            case 5: block(a, b, r, 5); break;
            case 6: block(a, b, r, 6); break;
            case 7: block(a, b, r, 7); break;
            default: block(a, b, r, 8); break;
            }
        }
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

static int gemv_amx(const gemv_args *a) {
    const int64_t groups = (a->rows + 15) / 16, blocks = (a->out_dim + NB - 1) / NB;
    uint16_t *xp = aligned_alloc(64, (size_t)(groups * 16 * a->in_padded * 2 + 63) / 64 * 64);
    if (!xp) return OUT_OF_MEMORY;
    memset(xp, 0, (size_t)groups * 16 * a->in_padded * 2);
    for (int64_t r = 0; r < a->rows; r++) memcpy(xp + r * a->in_padded, a->x + r * a->x_stride, 2 * a->in_dim);
    #pragma omp parallel if (a->out_dim * a->in_dim > PARALLEL_MIN)
    {
        amx_configure();
        float acc[4][16][16] __attribute__((aligned(64)));   /* C tile q: rows 16 (q >> 1) + t, outputs 16 (q & 1) */
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            amx_block(a, xp, b, acc);
            const int64_t o = b * NB, n = a->out_dim - o < NB ? a->out_dim - o : NB;
            const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1u);
            const __mmask16 m1 = n >= 32 ? 0xffff : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1u);
            const __m512 b0 = bias16(a, o, m0), b1 = m1 ? bias16(a, o + 16, m1) : _mm512_setzero_ps();
            for (int64_t r = 0; r < a->rows; r++) {
                uint16_t *yr = a->y + r * a->y_stride + o;
                const int q = 2 * (int)(r >> 4);
                _mm256_mask_storeu_epi16(yr, m0, (__m256i)_mm512_cvtneps_pbh(
                    _mm512_add_ps(_mm512_load_ps(acc[q][r & 15]), b0)));
                if (m1) _mm256_mask_storeu_epi16(yr + 16, m1, (__m256i)_mm512_cvtneps_pbh(
                    _mm512_add_ps(_mm512_load_ps(acc[q + 1][r & 15]), b1)));
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
    if (amx_ok && a->rows > VECTOR_ROWS && a->rows <= AMX_ROWS && a->in_padded % 32 == 0) return gemv_amx(a);
    return gemv_vector(a);
}
#else
int gemv_bf16(const gemv_args *a) { (void)a; return NO_BF16_DOT; }
int gemv_init(void) { return NO_BF16_DOT; }
int gemv_max_rows(void) { return 0; }
#endif
