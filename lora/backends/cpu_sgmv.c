/* Segmented LoRA (shrink then expand, one call per LoRA layer) for the CPU, in plain C.
 *
 * Why: with a few tokens per adapter, torch runs one bmm per shrink and per stacked slice,
 * and on CPU each costs ~10 us per adapter in the batch (bf16 small-GEMM dispatch), about
 * ten times the time to read that adapter's weights. Here every adapter's weights are read
 * once per step, its tokens' activations stay in L1, and nothing is padded.
 *
 * The arithmetic per group of rows, and the operands' layout, are in lora/sgmv.h (shared with the fused MoE
 * block's expert LoRA, workers/models/cpu_moe_fused.c); here are the entries and their threads.
 */
#include "../sgmv.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
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
            for (int64_t g = g_begin; g < g_end; g++)
                dp_rows(args, args->group_slot[g], args->group_rank[g], args->group_start[g], args->group_start[g + 1],
                        hb);
        } else if (!by_group) {   /* the shared buffer: the same branch on every thread */
            for (int64_t g = g_begin; g < g_end; g++) {
                const int64_t slot = args->group_slot[g], rank = args->group_rank[g];
                for (int64_t c0 = args->group_start[g]; c0 < args->group_start[g + 1]; c0 += CHUNK) {
                    const int64_t n = args->group_start[g + 1] - c0 < CHUNK ? args->group_start[g + 1] - c0 : CHUNK;
                    const int64_t *r = args->rows + c0;
                    #pragma omp for schedule(static)
                    for (int64_t q = 0; q < SR; q += 4)   /* dp_shrink's blocks of 4 rows, one a thread */
                        dp_shrink(args, slot, rank, n, r, hb, q, q + 4 < SR ? q + 4 : SR);
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
#else
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

/* The graph phase's entry takes one argument struct (the arguments and the step's token slots), as every kernel a
 * CPU decode graph's program calls (workers/cpu_program.c). */
typedef struct {
    sgmv_args args;
    const int64_t *token_slots;
} bgmv_call;
int bgmv_add_bf16(const bgmv_call *p) { return by_token(add_bf16, &p->args, p->token_slots); }
int bgmv_add_f32(const bgmv_call *p) { return by_token(add_f32, &p->args, p->token_slots); }
