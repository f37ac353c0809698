"""Where a decode step's time goes: base GEMMs, attention, LoRA, sampling, the rest.

    .venv/bin/python -m benchmarks.profile_decode      (about half a minute)

Wraps the engine's hot functions with wall-clock accumulators (torch CPU ops are
synchronous, so this is exact up to the wrapper's own ~1 us per call) and runs the
same batch under three workloads. "base_linear" is every base layer's matmul
(workers.parallel.linear: oneDNN with prepacked weights on the CPU; the LM head included);
"other" is the rest of the step (norms, rope, activations, KV writes, input building,
scheduling, detokenization). A step that replays a CPU decode graph (workers/cpu_graph.py) runs
none of those functions: its kernels' own times, taken inside the replay, go to the same parts.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from benchmarks.checkpoint import build_adapters, build_checkpoint
from benchmarks.common import (FULL, Sizes, bench_main, machine_info, make_engine, make_prompts,
                               run_requests, set_threads, sizes_dict)
from benchmarks.throughput import adapter_name, workload_adapters

PARTS = ("base_linear", "attention", "lora", "sampling")


@contextmanager
def timed_parts(totals: dict):
    """Patch the hot functions of the parts named in `totals` to add their wall time to totals[part]; restored
    on exit. Parts: base_linear, attention, lora, sampling; and, for benchmarks/step_profile.py, elementwise (the
    norms, rope + KV write, SiLU-and-mul: the work of workers/cpu_ops.c) and forward (the whole decode forward,
    its input buffers included)."""
    import workers.graph_runner as graph_runner
    import workers.models.llama as llama
    import workers.parallel as parallel
    import workers.runner as runner
    from lora.backends.base import LayerLoRA

    depth = dict.fromkeys(totals, 0)

    def wrap(fn, part):
        def timed(*args, **kwargs):
            depth[part] += 1   # a part's functions may call each other (the torch q/k norm inside rope's inputs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[part] -= 1
                if not depth[part]:
                    totals[part] += time.perf_counter() - start
        return timed

    # Every backend binds each wrapped layer's op once, at start, as a LayerLoRA (lora/backends/base.py): its
    # call is where a step's LoRA maths runs, whatever backend and kernel (patching lora.ops' functions missed
    # the ops already bound: they reported 0).
    patches = [(parallel, "linear", "base_linear"), (llama, "linear_silu", "base_linear"),   # gate_up + SiLU fused
               (llama, "paged_attention", "attention"),
               (LayerLoRA, "__call__", "lora"), (runner, "sample", "sampling"),
               (llama.RMSNorm, "forward", "elementwise"), (llama.RMSNorm, "add_and_norm", "elementwise"),
               (llama.Attention, "attention_inputs", "elementwise"), (llama.MLP, "act", "elementwise"),
               (graph_runner.GraphRunner, "decode", "forward")]
    patches = [patch for patch in patches if patch[2] in totals]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, part in patches:
            fn = owner.__dict__[name]   # MLP.act is a staticmethod: wrapped as one
            timed = wrap(fn.__func__ if isinstance(fn, staticmethod) else fn, part)
            setattr(owner, name, staticmethod(timed) if isinstance(fn, staticmethod) else timed)
        yield totals
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


# a CPU graph's kernels (by symbol, less its dtype suffix) -> the part they time (timed_parts' Python wrappers do
# not run in a replay)
GRAPH_PARTS = {"gemv": "base_linear", "decode_attention": "attention", "bgmv_add": "lora", "rms_norm": "elementwise",
               "silu_and_mul": "elementwise", "qkv_rope": "elementwise"}


@contextmanager
def timed_graphs(engine, totals: dict):
    """The kernel time of the engine's CPU decode graphs replayed inside (workers/cpu_graph.py), added to
    totals[part] on exit for the parts named in totals (decode steps only: prefill never replays a graph)."""
    from workers import cpu_graph

    def graphs():
        return [entry[0] for entry in engine.executor.graph_runner.cpu_graphs.values() if entry is not None]
    for graph in graphs():
        graph.reset_times()
    cpu_graph.PROFILE = True
    try:
        yield totals
    finally:
        cpu_graph.PROFILE = False
        for graph in graphs():
            for symbol, seconds in graph.kernel_seconds().items():
                part = GRAPH_PARTS[symbol.rsplit("_", 1)[0]]
                if part in totals:
                    totals[part] += seconds


def run(sizes: Sizes = FULL, dtype: str = "bfloat16", workloads=("base", "one", "eight"), log=print) -> dict:
    set_threads(sizes.threads)
    engine = make_engine(build_checkpoint(dtype, sizes.shape), dtype, sizes)
    for i, path in enumerate(build_adapters(8, sizes.shape, sizes.rank)):
        engine.load_adapter(adapter_name(i), str(path))
    prompts = make_prompts(sizes)[:sizes.batch]
    run_requests(engine, prompts, workload_adapters("eight", sizes)[:sizes.batch], 2)   # warm-up
    out = {}
    for w in workloads:
        adapters = workload_adapters(w, sizes)[:sizes.batch]
        run_requests(engine, prompts, adapters, 2)            # slot loads for this workload, untimed
        # Prefill excluded: one request per step would mix the two, so time decode steps only
        # by running the batch to its end and subtracting the prefill step's parts.
        totals = dict.fromkeys(PARTS, 0.0)
        prefill = dict.fromkeys(PARTS, 0.0)
        with timed_parts(totals), timed_graphs(engine, totals):
            timing = run_requests_split(engine, prompts, adapters, sizes.max_tokens, totals, prefill)
        steps = timing.decode_steps
        parts = {p: (totals[p] - prefill[p]) / steps * 1e3 for p in PARTS}
        step_ms = timing.decode_s / steps * 1e3
        parts["other"] = step_ms - sum(parts.values())
        out[w] = {"decode_step_ms": step_ms, "parts_ms": parts, "decode_batch": timing.decode_tokens / steps}
        log(f"[profile {dtype}] {w:>6}: {step_ms:6.1f} ms/step = " +
            ", ".join(f"{p} {v:.1f}" for p, v in parts.items()))
    engine.close()
    return {"benchmark": "profile_decode", "dtype": dtype, "sizes": sizes_dict(sizes), "machine": machine_info(),
            "workloads": out}


def run_requests_split(engine, prompts, adapters, max_tokens, totals, prefill):
    """run_requests, recording the parts' totals as they stood after the (single) prefill step."""
    state = {"done": False}
    original = engine.step

    def step():
        outputs = original()
        if not state["done"] and outputs:
            prefill.update(totals)
            state["done"] = True
        return outputs

    engine.step = step
    try:
        return run_requests(engine, prompts, adapters, max_tokens)
    finally:
        del engine.step


def main(argv=None) -> dict:
    return bench_main("profile_decode", __doc__, run, argv)


if __name__ == "__main__":
    main()
