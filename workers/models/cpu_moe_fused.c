/* A MoE block's routing and its decode-sized expert work on the CPU, each in one call (built by lora/native.py):
 *
 *   moe_route:   the router's logits -> fp32 softmax, top-k, renormalised if asked, the weights cast to the
 *                dtype (HF's Qwen3-MoE router), and the (token, choice) rows sorted by expert (stable: by token
 *                within one) with the cumulative row counts per expert: what moe_experts.py's group_rows makes
 *                of torch.softmax / topk / argsort / searchsorted, in one pass instead of ~8 ops. Given a count
 *                of real tokens (a captured decode's padded bucket), the others get no rows: padding would
 *                otherwise stream experts no real token uses.
 *   moe_experts: for every active expert, its rows of x gathered, gate_up, SiLU-and-mul, down (the same vector
 *                block as cpu_moe.c's grouped GEMM, on the same [E, out, in] weights), then every token's rows
 *                weighted and summed: the block's partial output in one parallel region.
 *                With expert LoRA operands (experts_lora below), each row's LoRA after its gate_up and its down.
 *   moe_combine: that weighted sum alone (the paths that keep the projections apart: prefill, a captured decode
 *                with expert LoRA).
 *
 * Why: at decode a MoE layer streams ~190 MB of expert weights (Qwen3-30B-A3B's shape, 16 tokens) and every small
 * op between the streams runs on cold caches at 3-28x its isolated time (RESULTS.md, "What a small op costs after
 * a weight stream"): the router's softmax and top-k, the sort, the gather, SiLU-and-mul and the combine were ~9
 * calls and ~1 ms a layer. Here they are two calls, and the experts' three steps one parallel region.
 *
 * Exactness: every value the torch path rounds to the dtype is rounded at the same point (gate_up and down
 * outputs, silu, its product, the weighted row, each add of the combine: index_add_'s order, rows ascending), so
 * moe_experts and moe_combine give the unfused path's bits; moe_route differs from torch's softmax only in exp's
 * last bit (ties in the top-k go to the lower expert id).
 */
#include "../../lora/sgmv.h"
#include "../../lora/vec.h"
#include "moe_gemm.h"

typedef struct {
    const void *logits;          /* [tokens, num_experts], the dtype */
    int64_t tokens, num_experts, top_k, normalize;
    void *weight;                /* [tokens * top_k] out, the dtype: each sorted row's routing weight */
    int64_t *token, *expert;     /* [tokens * top_k] out: each sorted row's token and expert */
    int64_t *offsets;            /* [num_experts + 1] out: cumulative rows per expert */
    const int64_t *valid;        /* NULL, or how many leading tokens are real (a captured bucket's): the others get
                                    no rows (rows past offsets[E]: token t, expert -1, weight 0) */
} route_args;

#define DEFINE_ROUTE(NAME, T, LOAD, STORE)                                                                 \
int NAME(const route_args *a) {                                                                          \
    const int64_t E = a->num_experts, K = a->top_k, all = a->tokens;                                     \
    if (E < 1 || K < 1 || K > E || all < 0) return OUT_OF_RANGE;                                         \
    const int64_t n = !a->valid ? all : *a->valid < 0 ? 0 : *a->valid < all ? *a->valid : all;          \
    float *p = malloc(sizeof(float) * (E + n * K));                                                      \
    int64_t *ids = malloc(sizeof(int64_t) * (n * K + 1)), *cursor = calloc(E + 1, sizeof(int64_t));      \
    char *taken = malloc(E);                                                                             \
    if (!p || !ids || !cursor || !taken) {                                                               \
        free(p); free(ids); free(cursor); free(taken);                                                   \
        return OUT_OF_MEMORY;                                                                            \
    }                                                                                                    \
    float *chosen = p + E;                                                                               \
    for (int64_t t = 0; t < n; t++) {                                                                    \
        const T *l = (const T *)a->logits + t * E;                                                       \
        float top = LOAD(l[0]), sum = 0.f;                                                               \
        for (int64_t e = 1; e < E; e++) top = LOAD(l[e]) > top ? LOAD(l[e]) : top;                       \
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(LOAD(l[e]) - top);                            \
        for (int64_t e = 0; e < E; e++) p[e] /= sum;                                                     \
        memset(taken, 0, E);                                                                             \
        float kept = 0.f;                                                                                \
        for (int64_t j = 0; j < K; j++) {   /* the k largest, ties to the lower id (k <= E: a scan each) */ \
            int64_t best = -1;                                                                           \
            for (int64_t e = 0; e < E; e++)                                                              \
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;                                 \
            taken[best] = 1;                                                                             \
            ids[t * K + j] = best;                                                                       \
            kept += chosen[t * K + j] = p[best];                                                         \
            cursor[best + 1]++;                                                                          \
        }                                                                                                \
        if (a->normalize)                                                                                \
            for (int64_t j = 0; j < K; j++) chosen[t * K + j] /= kept;                                   \
    }                                                                                                    \
    for (int64_t e = 0; e < E; e++) cursor[e + 1] += cursor[e];                                          \
    memcpy(a->offsets, cursor, sizeof(int64_t) * (E + 1));                                               \
    for (int64_t i = 0; i < n * K; i++) {   /* counting sort: rows of one expert keep the tokens' order */ \
        const int64_t row = cursor[ids[i]]++;                                                            \
        a->token[row] = i / K;                                                                           \
        a->expert[row] = ids[i];                                                                         \
        ((T *)a->weight)[row] = STORE(chosen[i]);                                                        \
    }                                                                                                    \
    for (int64_t i = n * K; i < all * K; i++)                                                            \
        a->token[i] = i / K, a->expert[i] = -1, ((T *)a->weight)[i] = STORE(0.f);                        \
    free(p); free(ids); free(cursor); free(taken);                                                       \
    return 0;                                                                                            \
}
DEFINE_ROUTE(moe_route_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_ROUTE(moe_route_f32, float, f32_load, f32_store)

typedef struct {
    const void *x;               /* [tokens, hidden], row stride x_stride */
    int64_t x_stride, tokens, hidden, inter, num_experts;
    const void *w13, *w2;        /* [E, 2 inter, hidden] (gate rows, then up rows), [E, hidden, inter] */
    const int64_t *offsets, *token;   /* the sorted rows: moe_route's */
    const void *weight;
    int64_t num_rows;
    void *rows_out;              /* [num_rows, hidden] scratch: each row's down output */
    void *out;                   /* [tokens, hidden] out */
    const struct experts_lora *lora;   /* NULL: the base experts only */
} experts_args;

/* Expert LoRA inside the block: row n (token t, expert e) of a token whose adapter holds expert slot m =
 * slot_map[token_slot[t]] >= 0 gets, after gate_up and after down, the LoRA delta of combined index m * E + e of
 * the slot pool's expert buffers (lora/expert_layers.py), computed by lora/sgmv.h's code on the expert's thread: an
 * expert's rows of one expert slot are one group, rows in order, as the separate sgmv calls group them. The slots
 * are read at the call (a captured decode's static slot buffer, the pool's map as loads leave it). */
typedef struct experts_lora {
    const int64_t *token_slot;   /* [tokens]: each token's LoRA slot, -1 none */
    const int64_t *rank;         /* [num_expert_slots]: each expert slot's rank (0: empty), clamped to R */
    int64_t num_expert_slots;
    sgmv_args gate_up, down;     /* the buffers' fixed operands; a NULL: that projection has no LoRA this step */
    const int64_t *slot_map;     /* [num_slots]: each LoRA slot's expert slot, -1 none */
    int64_t num_slots;
} experts_lora;

#define BAD_SLOT 3   /* a token's LoRA slot or its expert slot past the slots */

static inline int64_t expert_slot(const experts_lora *l, int64_t t) {
    return l->token_slot[t] < 0 ? -1 : l->slot_map[l->token_slot[t]];
}

/* The groups of expert e's rows [0, n) (token[] theirs): each expert slot's rows in order, at most 4n + 1 of
 * scratch; their count. */
static int64_t lora_groups(const experts_lora *l, int64_t R, int64_t E, int64_t e, const int64_t *token, int64_t n,
                           int64_t *scratch, int64_t **slot, int64_t **rank, int64_t **start, int64_t **rows) {
    *slot = scratch, *rank = scratch + n, *start = scratch + 2 * n, *rows = scratch + 3 * n + 1;
    int64_t G = 0, taken = 0;
    (*start)[0] = 0;
    for (int64_t r = 0; r < n; r++) {
        const int64_t m = expert_slot(l, token[r]);
        const int64_t k = m < 0 ? 0 : l->rank[m] < R ? l->rank[m] : R;
        int seen = 0;
        for (int64_t q = 0; q < r && !seen; q++) seen = expert_slot(l, token[q]) == m;
        if (k <= 0 || seen) continue;
        (*slot)[G] = m * E + e, (*rank)[G] = k;
        for (int64_t q = r; q < n; q++)
            if (expert_slot(l, token[q]) == m) (*rows)[taken++] = q;
        (*start)[++G] = taken;
    }
    return G;
}

/* y [n, .] (row stride y_stride) += each row's delta of one projection (`fixed`; NULL a: none), x [n, .] its input,
 * for the groups of lora_groups. */
#define DEFINE_EXPERT_LORA(NAME, T, GROUP)                                                                  \
static int NAME(const sgmv_args *fixed, int64_t G, int64_t *slot, int64_t *rank, int64_t *start, int64_t *rows, \
                int64_t n, const T *x, int64_t x_stride, T *y, int64_t y_stride, T *hb) {                \
    if (!fixed->a) return 0;                                                                             \
    sgmv_args args = *fixed;                                                                             \
    args.x = x, args.x_stride = x_stride, args.y = y, args.y_stride = y_stride, args.num_rows = n;       \
    args.group_slot = slot, args.group_rank = rank, args.group_start = start, args.rows = rows;          \
    args.num_indices = n;                                                                                \
    for (int64_t g = 0; g < G; g++) {                                                                    \
        const int status = GROUP(&args, g, hb);                                                          \
        if (status) return status;                                                                       \
    }                                                                                                    \
    return 0;                                                                                            \
}
DEFINE_EXPERT_LORA(expert_lora_bf16, uint16_t, sgmv_group_bf16)
DEFINE_EXPERT_LORA(expert_lora_f32, float, sgmv_group_f32)

/* out[t] = round(the fp32 sum over t's rows n, ascending, of round(y[n] * weight[n])), zero for a token without
 * rows: index_add_'s result (it accumulates a bf16 self in fp32 and rounds once); columns [c0, c1) only, at most
 * COMBINE_CHUNK (threads split the columns: each element keeps its order). No fused multiply-add: torch rounds the
 * product before the sum, in fp32 too. 1 when the accumulators' scratch could not be had. */
#define COMBINE_CHUNK 256
#define DEFINE_COMBINE_COLUMNS(NAME, T, LOAD, LD, ROUND, ST)                                               \
__attribute__((optimize("fp-contract=off")))                                                             \
static int NAME(const T *y, const int64_t *token, const T *weight, int64_t num_rows, int64_t tokens,       \
                int64_t H, T *out, int64_t c0, int64_t c1) {                                             \
    const int64_t C = c1 - c0;                                                                           \
    float *acc = calloc(tokens * C + 1, sizeof(float));                                                  \
    if (!acc) return 1;                                                                                  \
    for (int64_t n = 0; n < num_rows; n++) {                                                             \
        const vf w = v_set(LOAD(weight[n]));                                                             \
        float *s = acc + token[n] * C;                                                                   \
        for (int64_t d = 0; d < C; d += W) {                                                             \
            const int k = (int)(C - d);                                                                  \
            st_f32(s + d, v_add(ld_f32(s + d, k), ROUND(v_mul(LD(y + n * H + c0 + d, k), w))), k);      \
        }                                                                                                \
    }                                                                                                    \
    for (int64_t t = 0; t < tokens; t++)                                                                 \
        for (int64_t d = 0; d < C; d += W)                                                               \
            ST(out + t * H + c0 + d, ld_f32(acc + t * C + d, (int)(C - d)), (int)(C - d));               \
    free(acc);                                                                                           \
    return 0;                                                                                            \
}
DEFINE_COMBINE_COLUMNS(combine_columns_bf16, uint16_t, bf16_load, ld_bf16, round_bf16, st_bf16)
DEFINE_COMBINE_COLUMNS(combine_columns_f32, float, f32_load, ld_f32, round_f32, st_f32)

#define DEFINE_COMBINE(NAME, T, COLUMNS)                                                                   \
int NAME(const T *y, const int64_t *token, const T *weight, int64_t num_rows, int64_t tokens, int64_t H,  \
         T *out) {                                                                                       \
    for (int64_t n = 0; n < num_rows; n++)                                                               \
        if (token[n] < 0 || token[n] >= tokens) return OUT_OF_RANGE;                                     \
    int failed = 0;                                                                                      \
    _Pragma("omp parallel for reduction(|:failed) if(num_rows * H > (1 << 18))")                        \
    for (int64_t c = 0; c < H; c += COMBINE_CHUNK)                                                       \
        failed |= COLUMNS(y, token, weight, num_rows, tokens, H, out, c,                                 \
                          c + COMBINE_CHUNK < H ? c + COMBINE_CHUNK : H);                                \
    return failed ? OUT_OF_MEMORY : 0;                                                                   \
}
DEFINE_COMBINE(moe_combine_bf16, uint16_t, combine_columns_bf16)
DEFINE_COMBINE(moe_combine_f32, float, combine_columns_f32)

/* One active expert: its rows [lo, hi) gathered into xs, gate_up into h, SiLU-and-mul into act, down into rows_out,
 * each projection's expert LoRA (if any) added right after it. scratch: lora_groups' and the LoRA's hb. */
#define DEFINE_EXPERT(NAME, T, ITEM, SILU, LORA)                                                           \
static int NAME(const experts_args *a, int64_t e, int64_t lo, int64_t hi, T *xs, T *h, T *act,           \
                int64_t *scratch, T *hb) {                                                               \
    const int64_t H = a->hidden, I = a->inter, rows = hi - lo, E = a->num_experts;                      \
    const int64_t *token = a->token + lo;                                                                \
    const experts_lora *l = a->lora;                                                                     \
    for (int64_t r = 0; r < rows; r++)                                                                   \
        memcpy(xs + r * H, (const T *)a->x + token[r] * a->x_stride, sizeof(T) * H);                    \
    int64_t G = 0, *slot = NULL, *rank = NULL, *start = NULL, *idx = NULL;                               \
    if (l)   /* one R for both (a projection without buffers has 0) */                                    \
        G = lora_groups(l, l->gate_up.R > l->down.R ? l->gate_up.R : l->down.R, E, e, token, rows, scratch, \
                        &slot, &rank, &start, &idx);                                                     \
    const moe_args gate_up = {.x = xs, .x_stride = H, .in_dim = H, .w = a->w13, .out_dim = 2 * I,       \
                              .num_experts = E, .y = h, .y_stride = 2 * I, .num_rows = rows};            \
    ITEM(&gate_up, e, 0, 2 * I, 0, rows);                                                                \
    int status = 0;                                                                                      \
    if (G) status = LORA(&l->gate_up, G, slot, rank, start, idx, rows, xs, H, h, 2 * I, hb);            \
    for (int64_t r = 0; r < rows; r++) SILU(h + r * 2 * I, I, act + r * I);                              \
    T *y = (T *)a->rows_out + lo * H;                                                                    \
    const moe_args down = {.x = act, .x_stride = I, .in_dim = I, .w = a->w2, .out_dim = H,               \
                           .num_experts = E, .y = y, .y_stride = H, .num_rows = rows};                   \
    ITEM(&down, e, 0, H, 0, rows);                                                                       \
    if (G && !status) status = LORA(&l->down, G, slot, rank, start, idx, rows, act, I, y, H, hb);       \
    return status;                                                                                       \
}
DEFINE_EXPERT(expert_bf16, uint16_t, item_bf16, silu_mul_row_bf16, expert_lora_bf16)
DEFINE_EXPERT(expert_f32, float, item_f32, silu_mul_row_f32, expert_lora_f32)

#define DEFINE_EXPERTS(NAME, T, EXPERT, COLUMNS)                                                           \
int NAME(const experts_args *a) {                                                                        \
    const int64_t H = a->hidden, I = a->inter, *off = a->offsets, N = off[a->num_experts];               \
    if (N < 0 || N > a->num_rows) return OUT_OF_RANGE;   /* rows past offsets[E]: a padded bucket's, none */ \
    const moe_args shape = {.in_dim = H, .out_dim = 2 * I, .num_experts = a->num_experts, .offsets = off,  \
                            .num_rows = N};                                                              \
    int64_t *experts;                                                                                    \
    const int64_t active = active_experts(&shape, &experts);                                             \
    if (active < 0) return (int)-active;                                                                 \
    int64_t most = 0;                                                                                    \
    for (int64_t n = 0; n < N; n++)                                                                      \
        if (a->token[n] < 0 || a->token[n] >= a->tokens) {                                               \
            free(experts);                                                                               \
            return OUT_OF_RANGE;                                                                         \
        }                                                                                                \
    const experts_lora *l = a->lora;                                                                     \
    for (int64_t t = 0; l && t < a->tokens; t++)                                                         \
        if (l->token_slot[t] >= l->num_slots || expert_slot(l, t) >= l->num_expert_slots) {              \
            free(experts);                                                                               \
            return BAD_SLOT;                                                                             \
        }                                                                                                \
    for (int64_t i = 0; i < active; i++)                                                                 \
        most = off[experts[i] + 1] - off[experts[i]] > most ? off[experts[i] + 1] - off[experts[i]] : most; \
    /* the LoRA's scratch: lora_groups' 4 most + 1 indices, sgmv.h's hb of CHUNK * stack * R (+ 32) */     \
    const int64_t R = l ? (l->gate_up.R > l->down.R ? l->gate_up.R : l->down.R) : 0;                    \
    const int64_t SR = (l && l->gate_up.stack > l->down.stack ? l->gate_up.stack : l ? l->down.stack : 0) * R; \
    const size_t lora_bytes = l ? sizeof(int64_t) * (4 * most + 1) + sizeof(T) * (CHUNK * SR + 32) : 0; \
    int failed = 0;                                                                                      \
    _Pragma("omp parallel if(active * 3 * I * H > PARALLEL_MIN) reduction(|:failed)")                   \
    {                                                                                                    \
        /* xs [most, H], h [most, 2I], act [most, I], then the LoRA's scratch */                          \
        T *xs = malloc(sizeof(T) * (most * (H + 3 * I) + 1) + lora_bytes + 64);                          \
        int64_t *scratch = xs ? (int64_t *)(((uintptr_t)(xs + most * (H + 3 * I) + 1) + 63) & ~(uintptr_t)63) : NULL; \
        if (!xs) failed = 1;                                                                             \
        _Pragma("omp for schedule(dynamic, 1)")                                                         \
        for (int64_t i = 0; i < active; i++)                                                             \
            if (xs) failed |= EXPERT(a, experts[i], off[experts[i]], off[experts[i] + 1], xs, xs + most * H, \
                                     xs + most * (H + 2 * I), scratch, (T *)(scratch + 4 * most + 1));   \
        free(xs);                                                                                        \
        _Pragma("omp for")   /* after the loop's barrier: every row's down output is in rows_out */      \
        for (int64_t c = 0; c < H; c += COMBINE_CHUNK)                                                   \
            failed |= COLUMNS((const T *)a->rows_out, a->token, (const T *)a->weight, N,                 \
                              a->tokens, H, (T *)a->out, c, c + COMBINE_CHUNK < H ? c + COMBINE_CHUNK : H); \
    }                                                                                                    \
    free(experts);                                                                                       \
    return failed ? OUT_OF_MEMORY : 0;                                                                   \
}
DEFINE_EXPERTS(moe_experts_bf16, uint16_t, expert_bf16, combine_columns_bf16)
DEFINE_EXPERTS(moe_experts_f32, float, expert_f32, combine_columns_f32)
