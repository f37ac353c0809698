"""Tensor parallel on the CPU: what a decode step's all-reduces cost over gloo, and what one all-gather plus a local
sum (TPGroup's path for small tensors, workers/parallel.py) saves.

    .venv/bin/python -m benchmarks.tp_all_reduce [--calls 300] [--rev OLD_REV --pairs 2]

1. Two gloo ranks (processes, one thread each) time TPGroup.all_reduce both ways at each size, alternating: gloo's
   all-reduce and the gather (forced at every size here, to show where it stops paying), wall and CPU per call.
2. With --rev: the engine at TP=2 (Ray ranks, the benchmark checkpoint in bf16, 8 sequences, 64 greedy tokens
   each) in OLD_REV's tree and in this checkout, alternating a, b, b, a (benchmarks/trees.py): wall and CPU
   seconds (driver and ranks) per decode step.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import machine_info, median, write_result
from benchmarks.trees import ROOT, alternating, checkout, revision, run_child

SIZES_KIB = (4, 16, 64, 256, 1024)
DTYPES = ("float32", "bfloat16")
ENGINE_CHILD = """
import json, os, shutil, sys, tempfile, time
from benchmarks.checkpoint import build_checkpoint
from benchmarks.procfs import process_cpu_seconds, process_tree
from workers.ray_utils import init_local_ray

model = build_checkpoint("bfloat16")
temp_dir = tempfile.mkdtemp(prefix="lstp-", dir="/tmp")
init_local_ray(temp_dir, num_cpus=3)
import ray
from workers import EngineConfig, LLMEngine, SamplingParams

engine = LLMEngine(EngineConfig(model=str(model), dtype="bfloat16", device="cpu", tensor_parallel_size=2,
                                max_model_len=256, enable_lora=False, cpu_threads=1))
prompts = [[2 + (7 * i + j) % 30000 for j in range(16)] for i in range(8)]
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
engine.generate(prompts, params)   # warm-up
rounds = []
for _ in range(int(sys.argv[1])):
    cpu = lambda: sum(process_cpu_seconds(pid) for pid in process_tree(os.getpid()))
    c0, t0 = cpu(), time.perf_counter()
    engine.generate(prompts, params)
    wall, used = time.perf_counter() - t0, cpu() - c0
    rounds.append({"wall_ms_per_step": 1e3 * wall / 64, "cpu_ms_per_step": 1e3 * used / 64})
ray.shutdown()
shutil.rmtree(temp_dir, ignore_errors=True)
print("RESULT " + json.dumps(rounds))
"""


def _rank(rank: int, port: int, calls: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from workers import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    parallel.GATHER_MAX_BYTES = 1 << 40   # the gather at every size: where it stops paying is the point
    paths = {"all_reduce": parallel.TPGroup(rank, 2, dist.group.WORLD),
             "gather": parallel.TPGroup(rank, 2, dist.group.WORLD, gather_small=True)}
    rows = []
    for dtype in DTYPES:
        for kib in SIZES_KIB:
            x = torch.randn(kib * 1024 // torch.empty(0, dtype=getattr(torch, dtype)).element_size() // 1024,
                            1024).to(getattr(torch, dtype))
            timed = {name: [] for name in paths}
            for order in (("all_reduce", "gather"), ("gather", "all_reduce")) * 2:
                for name in order:
                    for _ in range(10):
                        paths[name].all_reduce(x.clone())
                    dist.barrier()
                    t, c = time.perf_counter(), time.process_time()
                    for _ in range(calls):
                        paths[name].all_reduce(x.clone())
                    wall, used = time.perf_counter() - t, time.process_time() - c
                    timed[name].append((1e6 * wall / calls, 1e6 * used / calls))
            rows.append({"dtype": dtype, "kib": kib, **{f"{name}_{what}_us": median([s[i] for s in samples])
                                                       for name, samples in timed.items()
                                                       for i, what in enumerate(("wall", "cpu"))}})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def micro(calls: int) -> list[dict]:
    import torch.multiprocessing as mp

    from workers.ray_utils import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rows.json"
        mp.spawn(_rank, args=(free_port(), calls, out), nprocs=2)
        return json.loads(Path(out).read_text())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="timed calls per path, size and sample")
    parser.add_argument("--rev", help="also run the TP=2 engine in this revision's tree and in this checkout")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="timed generate calls per engine run")
    args = parser.parse_args(argv)
    result = {"machine": machine_info(), "micro": micro(args.calls)}
    for row in result["micro"]:
        print(f"{row['dtype']:>8} {row['kib']:5d} KiB: all_reduce {row['all_reduce_wall_us']:6.0f} us "
              f"(cpu {row['all_reduce_cpu_us']:5.0f}), gather {row['gather_wall_us']:6.0f} us "
              f"(cpu {row['gather_cpu_us']:5.0f})", flush=True)
    if args.rev:
        trees = [checkout(args.rev), ROOT]
        label = {tree: revision(tree) if tree != ROOT else "checkout" for tree in trees}   # ROOT: the work tree
        order = alternating(trees, args.pairs)
        runs = {label[tree]: [] for tree in trees}
        for tree in order:
            got = run_child(tree, ENGINE_CHILD, str(args.rounds))
            runs[label[tree]] += got
            print(f"{label[tree]}: {[round(r['wall_ms_per_step'], 1) for r in got]} ms/step wall, "
                  f"{[round(r['cpu_ms_per_step'], 1) for r in got]} ms/step CPU", flush=True)
        result["engine"] = {"rev": args.rev, "order": [label[tree] for tree in order],
                            "runs": runs, "median": {name: {k: median([r[k] for r in rs]) for k in rs[0]}
                                                     for name, rs in runs.items()}}
    write_result("tp_all_reduce", result)
    return result


if __name__ == "__main__":
    main()
