/* The bf16 LoRA kernel's path on the AVX512-BF16 dot instruction, per group of rows (included by lora/sgmv.h). */
#ifndef LORASERVE_SGMV_DP_H
#define LORASERVE_SGMV_DP_H

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

/* Rows ar[0..4) of A dotted with token rows xr[0..NT) into sums[j][t] (fp32, each a chain over k ascending,
 * then one reduce: the bits do not depend on how many rows or tokens share the loop). Four rows at once keep four
 * independent chains per token in flight (one token alone is otherwise a chain of dependent dot instructions). */
static inline __attribute__((always_inline)) void shrink_block(const uint16_t *const *ar, const uint16_t *const *xr,
                                                               int NT, int64_t in_dim, float sums[4][4]) {
    __m512 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int t = 0; t < NT; t++) acc[j][t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in_dim; k += 32) {
        __m512bh xv[4];
        for (int t = 0; t < NT; t++) xv[t] = load_pairs(xr[t] + k, in_dim - k);
        for (int j = 0; j < 4; j++) {
            /* the next block's rows (these 4 rows' successors in A), ahead of the demand: a group's A is a few
             * scattered KiB, each new page's first misses were waited on (the fused MoE block's LoRA 0.9x) */
            _mm_prefetch((const char *)(ar[j] + 4 * in_dim + k), _MM_HINT_T0);
            const __m512bh av = load_pairs(ar[j] + k, in_dim - k);
            for (int t = 0; t < NT; t++) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], av, xv[t]);
        }
    }
    for (int j = 0; j < 4; j++)
        for (int t = 0; t < NT; t++) sums[j][t] = _mm512_reduce_add_ps(acc[j][t]);
}

/* Shrink rows q = s * R + j in [q0, q1) of one chunk of one adapter's tokens into bf16 h
 * (rounded as torch's bf16 GEMMs round it); rows past the adapter's rank are exactly zero. A slot whose slices share
 * slice 0's A (a_shared) has the same h in every slice: the rows of slice 0 this call computed are copied (a MoE
 * gate_up LoRA's shrink, half of its prefill arithmetic, was computed twice). */
static void dp_shrink(const sgmv_args *args, int64_t slot, int64_t rank, int64_t n, const int64_t *r, uint16_t *hb,
                      int64_t q0, int64_t q1) {
    const uint16_t *x = args->x, *a = args->a;
    const int64_t in_dim = args->in_dim, R = args->R, SR = args->stack * R;
    int64_t live[4];
    int nq = 0;
    const int shared = args->a_shared && args->a_shared[slot];
    for (int64_t q = q0; q < q1; q++) {
        if (q % R >= rank) {
            for (int64_t t = 0; t < n; t++) hb[t * SR + q] = 0;
        } else if (shared && q >= R && q0 <= q % R) {
            for (int64_t t = 0; t < n; t++) hb[t * SR + q] = hb[t * SR + q % R];
        } else {
            live[nq++] = q;
        }
        /* a shared slot's slice 0 is computed whole before its rows are copied */
        if (nq < 4 && q + 1 < q1 && !(shared && q + 1 == R)) continue;
        if (!nq) continue;
        const uint16_t *ar[4];   /* up to 4 live rows; a short block repeats its last row */
        for (int j = 0; j < 4; j++)
            ar[j] = a + slot * args->a_slot_stride + a_row(args, slot, live[j < nq ? j : nq - 1]) * in_dim;
        for (int64_t t0 = 0; t0 < n; t0 += 4) {   /* each a row read once per 4 tokens */
            const int nt = n - t0 < 4 ? (int)(n - t0) : 4;
            const uint16_t *xr[4];
            for (int t = 0; t < 4; t++) xr[t] = x + r[t0 + (t < nt ? t : nt - 1)] * args->x_stride;
            float sums[4][4];
            switch (nt) {   /* literal bounds: each case its own unrolled block */
            case 1: shrink_block(ar, xr, 1, in_dim, sums); break;
            case 2: shrink_block(ar, xr, 2, in_dim, sums); break;
            case 3: shrink_block(ar, xr, 3, in_dim, sums); break;
            default: shrink_block(ar, xr, 4, in_dim, sums); break;
            }
            for (int j = 0; j < nq; j++)
                for (int t = 0; t < nt; t++) hb[(t0 + t) * SR + live[j]] = bf16_store(sums[j][t]);
        }
        nq = 0;
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

/* Expand items read ahead of their use. A decode group's b is a few scattered KiB (a MoE expert's, an adapter's
 * slice), read once, a 512-byte block per item for a few dozen cycles of work: the hardware's prefetchers start too
 * late on it and each item waited on its lines (perf: the block's loads, the expert LoRA's hottest lines). */
#define EXPAND_AHEAD 8

static inline void prefetch_lines(const void *start, int64_t bytes) {   /* every cache line of [start, +bytes) */
    for (uintptr_t line = (uintptr_t)start & ~(uintptr_t)63; line < (uintptr_t)start + (uintptr_t)bytes; line += 64)
        _mm_prefetch((const char *)line, _MM_HINT_T0);
}

static inline void prefetch_item(const sgmv_args *args, int64_t slot, const int64_t *item_start, int64_t q) {
    if (q >= item_start[args->stack]) return;
    int64_t s = 0;
    while (q >= item_start[s + 1]) s++;
    const int64_t out = args->out_dims[s], o = (q - item_start[s]) * 16, rows = out - o < 16 ? out - o : 16;
    prefetch_lines((const uint16_t *)args->b[s] + (slot * out + o) * args->R, rows * args->R * sizeof(uint16_t));
}

/* The chunk's rows of y asked for ahead of the expand that updates them, under the shrink: at prefill sizes y is a
 * MoE layer's whole gate_up or down output (MBs, written by the grouped GEMM long before) and an expert's rows are
 * scattered in it, beyond the hardware prefetchers' reach (perf: the expand's loads of y were its hottest lines). */
static inline void prefetch_rows(const sgmv_args *args, int64_t n, const int64_t *r) {
    for (int64_t s = 0; s < args->stack; s++)
        for (int64_t t = 0; t < n; t++)
            prefetch_lines((const uint16_t *)args->y + r[t] * args->y_stride + args->y_offsets[s],
                           args->out_dims[s] * sizeof(uint16_t));
}

/* Rows [lo, hi) of one adapter (rows[] entries), CHUNK at a time: shrink, then every expand item. hb: the scratch of
 * CHUNK * stack * R + 32 bf16 (+ 32: whole-vector loads). */
static void dp_rows(const sgmv_args *args, int64_t slot, int64_t rank, int64_t lo, int64_t hi, uint16_t *hb) {
    int64_t item_start[MAX_STACK + 1] = {0};
    for (int64_t s = 0; s < args->stack; s++) item_start[s + 1] = item_start[s] + (args->out_dims[s] + 15) / 16;
    const int64_t items = item_start[args->stack];
    for (int64_t q = 0; q < EXPAND_AHEAD; q++) prefetch_item(args, slot, item_start, q);   /* under the shrink */
    for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
        const int64_t n = hi - c0 < CHUNK ? hi - c0 : CHUNK;
        prefetch_rows(args, n, args->rows + c0);
        dp_shrink(args, slot, rank, n, args->rows + c0, hb, 0, args->stack * args->R);
        for (int64_t q = 0; q < items; q++) {
            if (c0 == lo) prefetch_item(args, slot, item_start, q + EXPAND_AHEAD);
            dp_expand(args, slot, rank, n, args->rows + c0, hb, item_start, q);
        }
    }
}
#define BF16_DP_OK(p) (((p)->R == 16 || (p)->R % 32 == 0) && (p)->stack <= MAX_STACK)
#else
#define BF16_DP_OK(p) 0
#endif

/* Group g alone, on the calling thread, with the bits of the threaded entries (lora/backends/cpu_sgmv.c): the
 * bf16-dot path where it applies (hb its scratch, as dp_rows'), else the range code. */
static inline int sgmv_group_bf16(const sgmv_args *args, int64_t g, uint16_t *hb) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    if (BF16_DP_OK(args)) {
        dp_rows(args, args->group_slot[g], args->group_rank[g], args->group_start[g], args->group_start[g + 1], hb);
        return 0;
    }
#endif
    (void)hb;
    return sgmv_bf16_range(args, g, g + 1);
}
static inline int sgmv_group_f32(const sgmv_args *args, int64_t g, float *unused) {
    (void)unused;
    return sgmv_f32_range(args, g, g + 1);
}

#endif
