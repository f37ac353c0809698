"""A/B of the engine between two git revisions, alternating, in one run, robust to a busy machine.

    .venv/bin/python -m benchmarks.ab OLD_REV [NEW_REV=HEAD] [--pairs 4] [--dtype float32] [--threads 1]

Each revision is checked out once into .cache/ab/<sha> (a git worktree) and runs the same child
(CHILD below, written against benchmarks.common, which both revisions share) in a process of its
own with that tree first on the path; both use one generated checkpoint and adapter set. The child
times the throughput benchmark's workloads (base / one / eight, `benchmarks.common` sizes) after a
warm-up, each as wall time and as the process's CPU time. Runs alternate old, new, new, old, ...

On a machine shared with other jobs the wall figures move with their load; CPU seconds per output
token at a fixed thread count barely do (threads=1: nothing spins waiting for a preempted peer), so
that is the figure a regression is judged by, with wall tok/s beside it.
"""
from __future__ import annotations

import argparse
import json

from benchmarks.common import machine_info, median, write_result
from benchmarks.trees import checkout, revision, run_child

WORKLOADS = ("base", "one", "eight")
CHILD = """
import json, sys, time
from dataclasses import replace
from benchmarks.checkpoint import build_adapters, build_checkpoint
from benchmarks.common import FULL, make_engine, make_prompts, run_requests, set_threads
from benchmarks.throughput import adapter_name, workload_adapters
dtype, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sizes = replace(FULL, threads=threads)
set_threads(threads)
engine = make_engine(build_checkpoint(dtype, sizes.shape), dtype, sizes)
paths = build_adapters(8, sizes.shape, sizes.rank)
for i in range(8):
    engine.load_adapter(adapter_name(i), str(paths[i]))
prompts = make_prompts(sizes)
for w in ("base", "eight"):
    run_requests(engine, prompts[:sizes.batch], workload_adapters(w, sizes)[:sizes.batch], 2)
out = {}
for w in sys.argv[4].split(","):
    cpu0, rows = time.process_time(), []
    for _ in range(reps):
        rows.append(run_requests(engine, prompts, workload_adapters(w, sizes), sizes.max_tokens))
    cpu = time.process_time() - cpu0
    tokens = sum(t.output_tokens for t in rows)
    out[w] = {"cpu_ms_per_token": 1e3 * cpu / tokens, "output_tok_s": tokens / sum(t.wall_s for t in rows),
              "prefill_s": sum(t.prefill_s for t in rows) / reps, "decode_s": sum(t.decode_s for t in rows) / reps}
engine.close()
print("RESULT " + json.dumps(out))
"""


def ratios(got: dict, key: str) -> dict:
    return {w: got["new"][w][key] / got["old"][w][key] for w in WORKLOADS}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default="HEAD")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2, help="timed runs of each workload per process")
    args = parser.parse_args(argv)
    trees = {"old": checkout(args.old), "new": checkout(args.new)}
    pairs = []
    for i in range(args.pairs):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")
        got = {side: run_child(trees[side], CHILD, args.dtype, str(args.threads), str(args.reps), ",".join(WORKLOADS),
                         timeout=3600) for side in order}
        pair = {"order": order, "results": got, "cpu_new_over_old": ratios(got, "cpu_ms_per_token"),
                "tok_s_new_over_old": ratios(got, "output_tok_s"), "prefill_new_over_old": ratios(got, "prefill_s")}
        pairs.append(pair)
        print(f"pair {i}: CPU per token new/old {pair['cpu_new_over_old']}; "
              f"tok/s new/old {pair['tok_s_new_over_old']}", flush=True)
    # the commits themselves: a name such as HEAD moves
    data = {"benchmark": "ab", "old": revision(trees["old"]), "new": revision(trees["new"]), "dtype": args.dtype,
            "threads": args.threads,
            "machine": machine_info(), "pairs": pairs}
    for key in ("cpu_new_over_old", "tok_s_new_over_old", "prefill_new_over_old"):
        data[f"median_{key}"] = {w: median([p[key][w] for p in pairs]) for w in WORKLOADS}
    print(json.dumps({k: v for k, v in data.items() if k.startswith("median")}, indent=1))
    print(write_result(f"ab_{args.dtype}_t{args.threads}", data))
    return data


if __name__ == "__main__":
    main()
