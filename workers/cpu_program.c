/* A captured CPU decode step's kernel calls run back to back from one call (built by lora/native.py).
 *
 * Why: in eager decode every kernel call costs its Python around it (operand checks, output allocation, the
 * ctypes call): ~40 us a call, ~3 ms of a bench-checkpoint step (74 calls) that the kernels alone run in
 * 12-16 ms. A capture (workers/cpu_graph.py) records each call's function and argument struct, both fixed
 * for the captured batch bucket (the inputs live in static buffers, the outputs were allocated once), and
 * replays a run of them here.
 *
 * Every kernel takes one argument struct and returns 0 or a status (lora/status.h and the kernels' own). The
 * first nonzero status stops the run: *failed names the call. ns (or NULL): each call's wall time is added to
 * ns[i] (a profile of the step by kernel: benchmarks/step_profile.py). */
#include <stdint.h>
#include <time.h>

typedef int (*kernel_fn)(const void *args);

typedef struct {
    int64_t n;
    const kernel_fn *fns;
    const void *const *args;
    int64_t *failed;
    int64_t *ns;
} program;

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

int run_program(const program *p) {
    for (int64_t i = 0; i < p->n; i++) {
        const int64_t start = p->ns ? now_ns() : 0;
        const int status = p->fns[i](p->args[i]);
        if (p->ns) p->ns[i] += now_ns() - start;
        if (status) {
            *p->failed = i;
            return status;
        }
    }
    return 0;
}
