"""What the default LoRA targets and the other CLI defaults cost in decode, with and without the skip of
untargeted modules (issue 22, item 4): every variant in one process, alternating.

    .venv/bin/python -m benchmarks.targets [--rounds 3] [--dtype bfloat16]

The bench checkpoint (benchmarks/checkpoint.py) with its 8 rank-16 adapters, which target the 7 projections
only. Variants: the benchmark's settings (targets = the 7 projections, max_num_seqs 32, max_model_len 96)
with one CLI default at a time (all targets, max_num_seqs 64, max_model_len unset), and all three; the
default targets with the skip turned off, as the code before it ran (every wrapped module computed in any
step that has an adapter: the slot pool reports every group, so captured decode replays the all-targets
graph), on the same engine as with it; and both again in captured decode (the CPU capture emulation); and
a second engine with the benchmark's settings, whose ratio to the first is the spread between engines.
Each round runs every variant once, in a rotated order, timing its decode steps (wall and process CPU
time, one thread) for c requests at once (c = 4, light serving load; c = 32, a full batch; 32 prompt tokens,
16 output tokens), one adapter per request in turn. Ratios are taken per round, then their median; CPU ms
per step is the figure judged (the machine is shared: wall time moves with other jobs, CPU time at one
thread barely does).
"""
from __future__ import annotations

import argparse
import json
import time

from benchmarks.checkpoint import ALL7, build_adapters, build_checkpoint
from benchmarks.common import FULL, machine_info, make_prompts, median, set_threads, write_result

CONCURRENCY = (4, 32)
MAX_TOKENS = 16          # per request: 15 decode steps a run (the machine is shared: every step counts)
BENCH = {"lora_target_modules": ALL7, "max_num_seqs": 32, "max_model_len": 96}   # prompt + output + slack
CLI = {"lora_target_modules": None, "max_num_seqs": 64, "max_model_len": None}     # None: EngineConfig's default
DEFAULT_TARGETS = {"lora_target_modules": None}
CAPTURED = {"lora_target_modules": None, "emulate_capture": True}
VARIANTS = {   # name -> (settings that differ from BENCH, skip on)
    "bench": ({}, True),
    "bench_again": ({"seed": 1}, True),   # a second engine doing the same work: the spread between engines
    "default_targets": (DEFAULT_TARGETS, True),
    "default_targets_no_skip": (DEFAULT_TARGETS, False),
    "max_num_seqs_64": ({"max_num_seqs": 64}, True),
    "max_model_len_default": ({"max_model_len": None}, True),
    "cli_defaults": (CLI, True),
    "captured_default_targets": (CAPTURED, True),
    "captured_default_targets_no_skip": (CAPTURED, False),
}
RATIOS = {   # label -> (variant, against)
    "bench_again_over_bench": ("bench_again", "bench"),
    "no_skip_over_skip": ("default_targets_no_skip", "default_targets"),
    "captured_no_skip_over_skip": ("captured_default_targets_no_skip", "captured_default_targets"),
    "default_targets_over_bench": ("default_targets", "bench"),
    "default_targets_no_skip_over_bench": ("default_targets_no_skip", "bench"),
    "max_num_seqs_64_over_bench": ("max_num_seqs_64", "bench"),
    "max_model_len_default_over_bench": ("max_model_len_default", "bench"),
    "cli_defaults_over_bench": ("cli_defaults", "bench"),
}


def make_engine(model_dir, dtype: str, settings: dict, threads: int):
    from workers import EngineConfig, LLMEngine

    config = {**BENCH, **settings}
    kw = {k: v for k, v in config.items() if v is not None}
    return LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, device="cpu", max_lora_rank=FULL.rank,
                                  max_loras_per_batch=8, max_loaded_loras=64, kv_cache_memory_gb=0.5,
                                  cpu_threads=threads, max_num_batched_tokens=2048, **kw))


def set_skip(engine, skip: bool) -> None:
    """Off: the code before the skip (every group for any slots); on: the slot pool's own groups_of."""
    pool = engine.executor.slot_pool
    if skip:
        pool.__dict__.pop("groups_of", None)
    else:
        pool.groups_of = lambda slots: frozenset(pool.groups)


def timed_run(engine, prompts, c: int, max_tokens: int) -> dict:
    """c requests at once (adapter i % 8); wall and CPU ms per decode step."""
    from workers import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=False)
    for i in range(c):
        engine.add_request(prompts[i], params, f"a{i % 8}")
    wall = cpu = 0.0
    steps = 0
    while engine.has_unfinished():
        engine.last_step = (0, 0)
        w0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        w1, c1 = time.perf_counter(), time.process_time()
        decode, prefill = engine.last_step
        if decode and not prefill:
            wall, cpu, steps = wall + w1 - w0, cpu + c1 - c0, steps + 1
    return {"wall_ms_per_step": 1e3 * wall / steps, "cpu_ms_per_step": 1e3 * cpu / steps}


def tape_ops(engine) -> dict:
    """Ops on each captured decode tape by (batch, LoRA tier): the time-independent count of what a tier skips."""
    runner = engine.executor.graph_runner
    names = {tier: "none" if not tier else "all" if tier == runner.tiers[-1] else "projections"
             for tier in runner.tiers}
    return {f"batch {b}, {names[tier]}": graph.num_ops for (b, _, tier), (graph, _) in sorted(
        runner.graphs.items(), key=lambda item: (item[0][0], runner.tiers.index(item[0][2])))}


def skipped_op_ms(dtype: str, c: int, reps: int = 30) -> dict:
    """CPU ms of one decode step's embed_tokens and lm_head LoRA ops alone (what the skip saves when no adapter
    of the step targets them), on the cpu backend, c tokens over min(c, 8) adapters of the bench shape."""
    import torch

    from benchmarks.checkpoint import DTYPES
    from lora.backends import get_backend
    from lora.slots import GroupShape, SlotPool

    shape, dt = FULL.shape, DTYPES[dtype]
    groups = {"embed_tokens": GroupShape(shape.vocab_size, (shape.hidden_size,)),
              "lm_head": GroupShape(shape.hidden_size, (shape.vocab_size,))}
    pool = SlotPool(1, groups, 8, FULL.rank, dt, "cpu")
    backend = get_backend("cpu", "cpu", dt, FULL.rank)
    (ea, eb), (ha, hb) = pool.buffers[(-1, "embed_tokens")], pool.buffers[(-1, "lm_head")]
    embed, head = backend.bind_embedding("embed", ea, eb[0]), backend.bind("head", ha, hb, (0, shape.vocab_size))
    for buf in (ea, eb[0], ha, hb[0]):
        buf.normal_()
    info = backend.batch_info([i % 8 for i in range(c)], [FULL.rank] * 8, "decode")
    ids, h = torch.randint(0, shape.vocab_size, (c,)), torch.randn(c, shape.hidden_size, dtype=dt)
    y_embed, logits = torch.zeros(c, shape.hidden_size, dtype=dt), torch.zeros(c, shape.vocab_size, dtype=dt)
    times = {"embed_tokens": [], "lm_head": []}
    for _ in range(reps):
        for name, run in (("embed_tokens", lambda: embed(y_embed, ids, info)),
                          ("lm_head", lambda: head(logits, h, info))):
            c0 = time.process_time()
            run()
            times[name].append(1e3 * (time.process_time() - c0))
    return {name: median(v) for name, v in times.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    set_threads(args.threads)
    model_dir, paths = build_checkpoint(args.dtype, FULL.shape), build_adapters(8, FULL.shape, FULL.rank)
    prompts = make_prompts(FULL)
    engines = {}   # one per distinct settings: a variant without the skip shares its twin's engine
    for settings, _ in VARIANTS.values():
        key = json.dumps(settings, sort_keys=True)
        if key not in engines:
            engines[key] = make_engine(model_dir, args.dtype, settings, args.threads)
            for i in range(8):
                engines[key].load_adapter(f"a{i}", str(paths[i]))
    engine_of = {name: engines[json.dumps(settings, sort_keys=True)] for name, (settings, _) in VARIANTS.items()}
    for name, (_, skip) in VARIANTS.items():       # warm-up; captured: this variant's graphs of each batch
        set_skip(engine_of[name], skip)
        for c in CONCURRENCY:
            timed_run(engine_of[name], prompts, c, 4)
    names, rounds = list(VARIANTS), []
    for r in range(args.rounds):
        got = {}
        for name in names[r % len(names):] + names[:r % len(names)]:   # rotated: none always first or last
            set_skip(engine_of[name], VARIANTS[name][1])
            got[name] = {str(c): timed_run(engine_of[name], prompts, c, MAX_TOKENS) for c in CONCURRENCY}
            line = ", ".join(f"c={c} {v['cpu_ms_per_step']:.1f} ms CPU / {v['wall_ms_per_step']:.1f} ms wall"
                             for c, v in got[name].items())
            print(f"round {r} {name}: {line}", flush=True)
        rounds.append(got)
    ops = tape_ops(engine_of["captured_default_targets"])
    for engine in engines.values():
        engine.close()
    data = {"benchmark": "targets", "dtype": args.dtype, "threads": args.threads, "max_tokens": MAX_TOKENS,
            "concurrency": list(CONCURRENCY), "bench_settings": {**BENCH, "lora_target_modules": list(ALL7)},
            "cli_settings": CLI, "variants": {k: {"settings": s, "skip": on} for k, (s, on) in VARIANTS.items()},
            "machine": machine_info(), "rounds": rounds, "tape_ops": ops,
            "skipped_op_cpu_ms": {str(c): skipped_op_ms(args.dtype, c) for c in CONCURRENCY}}
    for key in ("cpu_ms_per_step", "wall_ms_per_step"):
        data[key] = {name: {str(c): median([r[name][str(c)][key] for r in rounds]) for c in CONCURRENCY}
                     for name in VARIANTS}
    data["cpu_ratios"] = {label: {str(c): median([r[a][str(c)]["cpu_ms_per_step"] / r[b][str(c)]["cpu_ms_per_step"]
                                                  for r in rounds]) for c in CONCURRENCY}
                          for label, (a, b) in RATIOS.items()}
    print(json.dumps(data["cpu_ratios"], indent=1))
    print(write_result(f"targets_{args.dtype}", data))
    return data


if __name__ == "__main__":
    main()
