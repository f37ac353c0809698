/* Grouped expert GEMM for the CPU, in plain C: one call runs every routed expert of a MoE layer over its rows.
 *
 * Why: at decode a layer has a few (token, choice) rows per active expert, and each expert's weights are read
 * from memory for them: the step is bound by those bytes. One oneDNN GEMM per expert and projection from
 * Python costs a dispatch each (~160 a layer at batch 16) and re-lays small GEMMs out; here every active
 * expert's rows of W are read once, streaming, with all of its rows' activations in L1 beside them.
 *
 * Layout (npu_grouped_matmul's grouped form, with our [E, out, in] weight):
 *   x       [N, in]        rows sorted by expert, row stride x_stride, unit column stride
 *   w       [E, out, in]   contiguous
 *   offsets [E + 1]        int64: expert e owns rows offsets[e] .. offsets[e+1]; offsets[0] = 0, offsets[E] = N
 *   y       [N, out]       row stride y_stride: y[n] = x[n] @ w[e].T, accumulated in fp32, rounded once
 * Offsets that are not non-decreasing from 0 to N are refused (OUT_OF_RANGE) before anything is read.
 *
 * Work: blocks of up to 4 outputs x 4 rows; 16 fp32 accumulators summed across lanes at once (reduce16). Each
 * step prefetches the weight rows PREFETCH_ROWS ahead: the hardware's stream prefetch alone left a thread at
 * ~7.5 GB/s on this shape, with it ~10.5 (results/moe_grouped.md).
 * Threads (torch's OpenMP pool, as the other kernels) share (expert, output-block) items when the layer's
 * weight bytes pass PARALLEL_MIN: below it a parallel region costs more than it saves on shared cores.
 */
#include "moe_gemm.h"

static int run(const moe_args *a, void (*item)(const moe_args *, int64_t, int64_t, int64_t, int64_t, int64_t)) {
    const int64_t *off = a->offsets;
    int64_t *experts;
    const int64_t active = active_experts(a, &experts);
    if (active < 0) return (int)-active;
    const int64_t per_expert = (a->out_dim + ITEM_OUT - 1) / ITEM_OUT, items = active * per_expert;
    /* static: each thread one contiguous run of the weights (as the AMX items below): 0.80-0.82x the time of
     * dynamic items at 2 threads, 16 and 32 tokens */
    #pragma omp parallel for schedule(static) if (active * a->out_dim * a->in_dim > PARALLEL_MIN)
    for (int64_t i = 0; i < items; i++) {
        const int64_t e = experts[i / per_expert], o = (i % per_expert) * ITEM_OUT;
        item(a, e, o, o + ITEM_OUT < a->out_dim ? o + ITEM_OUT : a->out_dim, off[e], off[e + 1]);
    }
    free(experts);
    return 0;
}

int moe_gemm_bf16(const moe_args *a) { return run(a, item_bf16); }
int moe_gemm_f32(const moe_args *a) { return run(a, item_f32); }

/* Many rows per expert (prefill), bf16, on AMX tiles: y^T = w . x^T per expert, so that w is read as it is stored
 * (an A tile is 16 of its rows x 32 inputs) and only the expert's rows of x are re-laid out, once a call, as B
 * tiles. The dot products above are compute-bound there (32 rows an expert at 512 tokens: ~5x the weight's
 * read time); tdpbf16ps multiplies bf16 pairs exactly and accumulates in fp32 (another order than the vector
 * kernel's: within one bf16 rounding step of the exact sum, as torch._grouped_mm). Needs in_dim and out_dim
 * multiples of 32 (WRONG_SHAPE otherwise: cpu_moe.py sends those shapes to the other paths). */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
int moe_amx_init(void) { return amx_permit() ? NO_AMX : 0; }
/* rows of one expert per task: 256 x 2 KiB of x's tiles (in 1024) stay in L2 while the 32-output items stream the
 * weights past them; one task per expert re-read them from L3 per item: 1024 rows of a 1024 x 4096 GEMM 0.80x the
 * time (results/moe_fused_lora.md) */
#define ROW_CHUNK 256

/* x's rows [lo, hi) as B tiles: for each 16-row block and 32-input slice c, tile[r][t] = the bf16 pair
 * x[lo + 16 block + t][32 c + 2 r .. + 1] (a 32-bit word); rows past hi are zero. */
static void pack_rows(const moe_args *a, int64_t lo, int64_t hi, uint32_t *tiles) {
    const int64_t chunks = a->in_dim / 32, blocks = (hi - lo + 15) / 16;
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int64_t row = 0; row < 16 * blocks; row++) {
        uint32_t *at = tiles + (row / 16) * chunks * 256 + row % 16;
        const uint32_t *src = (const uint32_t *)((const uint16_t *)a->x + (lo + row) * a->x_stride);
        for (int64_t c = 0; c < chunks; c++)
            _mm512_i32scatter_epi32(at + c * 256, column,
                                    lo + row < hi ? _mm512_loadu_si512(src + 16 * c) : _mm512_setzero_si512(), 4);
    }
}

/* expert e's outputs [o, o + 32) for its rows [lo, hi), from its packed rows */
static void amx_item(const moe_args *a, const uint32_t *tiles, int64_t e, int64_t o, int64_t lo, int64_t hi) {
    const int64_t K = a->in_dim, chunks = K / 32, blocks = (hi - lo + 15) / 16;
    const uint16_t *w = (const uint16_t *)a->w + (e * a->out_dim + o) * K;
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    float acc[4][256];   /* tile q: outputs o + 16 (q & 1) + i (rows i), x rows of block b + (q >> 1) (columns) */
    for (int64_t b = 0; b < blocks; b += 2) {
        const int two = b + 1 < blocks;
        const uint32_t *b0 = tiles + b * chunks * 256, *b1 = b0 + chunks * 256;
        amx_zero_acc();
        for (int64_t c = 0; c < chunks; c++) {
            if (b == 0)   /* the next 32 rows of w (this thread's next item's) into L2, over this item's
                           * slices: 40.5 -> 37.2 ms a layer at 512 tokens */
                for (int l = 0; l < 32; l++)
                    _mm_prefetch((const char *)(w + 32 * K) + 2048 * c + 64 * l, _MM_HINT_T1);
            _tile_loadd(4, w + 32 * c, 2 * K);
            _tile_loadd(5, w + 16 * K + 32 * c, 2 * K);
            _tile_loadd(6, b0 + 256 * c, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            if (two) {
                _tile_loadd(7, b1 + 256 * c, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        amx_store_acc(acc[0], two);
        for (int q = 0; q < (two ? 4 : 2); q++) {
            const int64_t first = lo + 16 * (b + (q >> 1));
            for (int t = 0; t < 16 && first + t < hi; t++)   /* column t: the 16 outputs of row first + t */
                store_bf16((uint16_t *)a->y + (first + t) * a->y_stride + o + 16 * (q & 1),
                           _mm512_i32gather_ps(column, acc[q] + t, 4));
        }
    }
}

int moe_gemm_bf16_amx(const moe_args *a) {
    if (a->in_dim % 32 || a->out_dim % 32) return WRONG_SHAPE;
    const int64_t *off = a->offsets, chunks = a->in_dim / 32;
    int64_t *experts;
    const int64_t active = active_experts(a, &experts);
    if (active < 0) return (int)-active;
    int64_t *at = malloc(sizeof(int64_t) * (active + 1));   /* each active expert's packed rows in `tiles` */
    if (!at) {
        free(experts);
        return OUT_OF_MEMORY;
    }
    at[0] = 0;
    for (int64_t i = 0; i < active; i++)
        at[i + 1] = at[i] + (off[experts[i] + 1] - off[experts[i]] + 15) / 16 * chunks * 256;
    uint32_t *tiles = aligned_alloc(64, (sizeof(uint32_t) * at[active] + 63) / 64 * 64 + 64);
    if (!tiles) {
        free(experts);
        free(at);
        return OUT_OF_MEMORY;
    }
    /* tasks: each active expert's rows in chunks of ROW_CHUNK; a task's items its 32-output blocks */
    int64_t tasks = 0;
    for (int64_t i = 0; i < active; i++) tasks += (off[experts[i] + 1] - off[experts[i]] + ROW_CHUNK - 1) / ROW_CHUNK;
    int64_t *task = malloc(sizeof(int64_t) * 2 * (tasks + 1));   /* (active index, first row) per task */
    if (!task) {
        free(tiles);
        free(at);
        free(experts);
        return OUT_OF_MEMORY;
    }
    for (int64_t i = 0, t = 0; i < active; i++)
        for (int64_t r = off[experts[i]]; r < off[experts[i] + 1]; r += ROW_CHUNK, t++)
            task[2 * t] = i, task[2 * t + 1] = r;
    const int64_t per_expert = a->out_dim / 32, items = tasks * per_expert;
    #pragma omp parallel
    {
        amx_configure();   /* once per thread and call */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < active; i++)
            pack_rows(a, off[experts[i]], off[experts[i] + 1], tiles + at[i]);
        /* static: each thread streams one contiguous run of the weights (items are alike: 32 outputs of a task's
         * rows), so the prefetch of the next item's rows fetches its own next item: at 2 threads 0.73x the time
         * of dynamic items, which alternate between the threads (3 layers at 512 tokens) */
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++) {
            const int64_t t = i / per_expert, k = task[2 * t], e = experts[k], lo = task[2 * t + 1];
            const int64_t hi = lo + ROW_CHUNK < off[e + 1] ? lo + ROW_CHUNK : off[e + 1];
            amx_item(a, tiles + at[k] + (lo - off[e]) / 16 * chunks * 256, e, (i % per_expert) * 32, lo, hi);
        }
        _tile_release();
    }
    free(task);
    free(tiles);
    free(at);
    free(experts);
    return 0;
}
#else   /* no AMX bf16 in this build (LORASERVE_KERNEL_ARCH, or the CPU): cpu_moe.py keeps torch._grouped_mm */
int moe_amx_init(void) { return NO_AMX; }
int moe_gemm_bf16_amx(const moe_args *a) { (void)a; return NO_AMX; }
#endif
