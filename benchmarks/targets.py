"""What the default LoRA targets and the other CLI defaults cost in decode, before and after the skip of
untargeted modules (issue 22, item 4), alternating in one run.

    .venv/bin/python -m benchmarks.targets [--old REV] [--rounds 2] [--threads 1] [--dtype bfloat16]

Every variant runs the same child in a process of its own (the old revision from a git worktree of it,
benchmarks/ab.py's `checkout`, the new one from this tree), on the bench checkpoint (benchmarks/checkpoint.py)
with its 8 rank-16 adapters targeting the 7 projections only; the variants run in a rotated order each round.
Variants: the old and the new code with the default targets (embed_tokens and lm_head too), eager decode (the
CPU default) and captured decode (the CPU capture emulation); then, on the new code, the benchmark's settings
(targets = the 7 projections, max_num_seqs 32, max_model_len 96) with one CLI default at a time, and all three.
The child times decode steps (wall and process CPU time, one thread) of c requests at once (c = 4, light
serving load; c = 32, a full batch; 32 prompt tokens, 16 output tokens), one adapter per request in turn. CPU ms per decode step is the figure
judged (the machine is shared: wall time moves with other jobs, CPU time at one thread barely does).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.ab import checkout
from benchmarks.checkpoint import ALL7, cache_root
from benchmarks.common import machine_info, median, write_result

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (4, 32)
BENCH = {"lora_target_modules": list(ALL7), "max_num_seqs": 32, "max_model_len": 96}   # prompt + output + slack
CLI = {"lora_target_modules": None, "max_num_seqs": 64, "max_model_len": None}           # None: EngineConfig's
VARIANTS = {   # name -> (revision, settings that differ from BENCH)
    "old_default_targets": ("old", {"lora_target_modules": None}),
    "new_default_targets": ("new", {"lora_target_modules": None}),
    "old_default_targets_captured": ("old", {"lora_target_modules": None, "emulate_capture": True}),
    "new_default_targets_captured": ("new", {"lora_target_modules": None, "emulate_capture": True}),
    "new_bench": ("new", {}),
    "new_max_num_seqs_64": ("new", {"max_num_seqs": 64}),
    "new_max_model_len_default": ("new", {"max_model_len": None}),
    "new_cli_defaults": ("new", CLI),
}
MAX_TOKENS = 16   # per request: 15 decode steps a run (the machine is shared: every step counts)
CHILD = """
import json, sys, time
import torch
from benchmarks.checkpoint import build_adapters, build_checkpoint
from benchmarks.common import FULL, make_prompts
from workers import EngineConfig, LLMEngine, SamplingParams
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
engine_kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in args["engine"].items() if v is not None}
sizes = FULL
engine = LLMEngine(EngineConfig(model=str(build_checkpoint(args["dtype"], sizes.shape)), dtype=args["dtype"],
                                device="cpu", max_lora_rank=sizes.rank, max_loras_per_batch=8, max_loaded_loras=64,
                                kv_cache_memory_gb=1.0, cpu_threads=args["threads"], max_num_batched_tokens=2048,
                                **engine_kw))
paths = build_adapters(8, sizes.shape, sizes.rank)
for i in range(8):
    engine.load_adapter(f"a{i}", str(paths[i]))
prompts = make_prompts(sizes)

def run(c, max_tokens=args["max_tokens"]):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=False)
    for i in range(c):
        engine.add_request(prompts[i], params, f"a{i % 8}")
    wall, cpu, steps = 0.0, 0.0, 0
    while engine.has_unfinished():
        engine.last_step = (0, 0)
        w0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        w1, c1 = time.perf_counter(), time.process_time()
        decode, prefill = engine.last_step
        if decode and not prefill:
            wall, cpu, steps = wall + w1 - w0, cpu + c1 - c0, steps + 1
    return wall, cpu, steps

out = {}
for c in args["concurrency"]:
    run(c, 4)          # warm-up; captured: the graphs of this batch (the same width bucket: 4 blocks)
    totals = [run(c) for _ in range(args["reps"])]
    steps = sum(t[2] for t in totals)
    out[str(c)] = {"wall_ms_per_step": 1e3 * sum(t[0] for t in totals) / steps,
                   "cpu_ms_per_step": 1e3 * sum(t[1] for t in totals) / steps, "steps": steps}
engine.close()
print(json.dumps(out))
"""


def run_variant(tree: Path, settings: dict, dtype: str, threads: int, reps: int) -> dict:
    args = {"dtype": dtype, "threads": threads, "reps": reps, "concurrency": list(CONCURRENCY), "max_tokens": MAX_TOKENS,
            "engine": {**BENCH, **settings}}
    env = dict(os.environ, PYTHONPATH=str(tree), LORASERVE_BENCH_CACHE=str(cache_root()), OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=tree, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"child failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict]) -> dict:
    """Per variant and concurrency the median CPU / wall ms per step; ratios per round, then their median."""
    out = {"cpu_ms_per_step": {}, "wall_ms_per_step": {}, "ratios": {}}
    for name in VARIANTS:
        for key in ("cpu_ms_per_step", "wall_ms_per_step"):
            out[key][name] = {c: median([r[name][c][key] for r in rounds]) for c in rounds[0][name]}
    pairs = {"default_targets_new_over_old": ("new_default_targets", "old_default_targets"),
             "default_targets_captured_new_over_old": ("new_default_targets_captured", "old_default_targets_captured"),
             "new_default_targets_over_bench": ("new_default_targets", "new_bench"),
             "max_num_seqs_64_over_bench": ("new_max_num_seqs_64", "new_bench"),
             "max_model_len_default_over_bench": ("new_max_model_len_default", "new_bench"),
             "cli_defaults_over_bench": ("new_cli_defaults", "new_bench")}
    for label, (a, b) in pairs.items():
        out["ratios"][label] = {c: median([r[a][c]["cpu_ms_per_step"] / r[b][c]["cpu_ms_per_step"] for r in rounds])
                                for c in rounds[0][a]}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="7f7b849", help="the revision before the change")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=1, help="timed runs of each concurrency per process")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    trees = {"old": checkout(args.old), "new": ROOT}
    names, rounds = list(VARIANTS), []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]    # rotated: no variant always first / last
        got = {}
        for name in order:
            side, settings = VARIANTS[name]
            got[name] = run_variant(trees[side], settings, args.dtype, args.threads, args.reps)
            print(f"round {r} {name}: " + ", ".join(f"c={c} {v['cpu_ms_per_step']:.1f} ms CPU / "
                                                    f"{v['wall_ms_per_step']:.1f} ms wall" for c, v in got[name].items()),
                  flush=True)
        rounds.append(got)
    data = {"benchmark": "targets", "old": args.old, "max_tokens": MAX_TOKENS, "dtype": args.dtype, "threads": args.threads,
            "concurrency": list(CONCURRENCY), "bench_settings": BENCH, "cli_settings": CLI,
            "variants": {k: {"revision": v[0], "settings": v[1]} for k, v in VARIANTS.items()},
            "machine": machine_info(), "rounds": rounds, **summarize(rounds)}
    print(json.dumps(data["ratios"], indent=1))
    print(write_result(f"targets_{args.dtype}", data))
    return data


if __name__ == "__main__":
    main()
