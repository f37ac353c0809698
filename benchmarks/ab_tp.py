"""A/B of decode at TP 1 and TP 2, batch 1 and 32, between two git revisions, alternating, in one run.

    .venv/bin/python -m benchmarks.ab_tp OLD_REV [NEW_REV=HEAD] [--pairs 2] [--tokens 32] [--dtype bfloat16]

Issue 40's criterion for driving the ranks through shared memory: decode tokens/s of the bench checkpoint at
batch 1 and 32, TP 1 and TP 2, not lower than before. benchmarks/ab.py times the throughput workloads of a
TP-1 engine by its own process's CPU time; at TP 2 the model runs in Ray actors, so the child here counts the
CPU time of its whole process tree (the engine's process, Ray's processes and the rank actors it starts:
every one is a descendant of a `ray.init(address="local")` driver). Each child (benchmarks.trees: one
revision's worktree first on the path, the shared generated checkpoint) runs one TP size, base requests
(LoRA enabled, no adapter), one torch thread per rank, after a warm-up: batch 32 (32 requests together) and
batch 1 (one request at a time, 4 runs), `tokens` each. Runs alternate old, new, new, old, ... per TP size.
"""
from __future__ import annotations

import argparse
import json

from benchmarks.common import machine_info, median, write_result
from benchmarks.trees import checkout, run_child

BATCHES = (1, 32)
CHILD = """
import json, shutil, sys, tempfile
import psutil
from benchmarks.checkpoint import build_checkpoint
from benchmarks.common import FULL, make_prompts, run_requests, set_threads
from workers import EngineConfig, LLMEngine
tp, tokens, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
set_threads(1)
work = tempfile.mkdtemp(prefix="abtp", dir="/tmp")   # short: Ray's socket paths have a length limit
if tp > 1:
    from workers.ray_utils import init_local_ray
    init_local_ray(work, num_cpus=tp)
engine = LLMEngine(EngineConfig(model=str(build_checkpoint(dtype, FULL.shape)), dtype=dtype, device="cpu",
                                tensor_parallel_size=tp, max_num_seqs=32, max_model_len=FULL.prompt_len + tokens + 16,
                                max_lora_rank=FULL.rank, cpu_threads=1, max_num_batched_tokens=2048))
prompts = make_prompts(FULL)

def cpu_by_process():
    me = psutil.Process()
    out = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        out[proc.pid] = times.user + times.system
    return out

for batch in (32, 1):
    run_requests(engine, prompts[:batch], [None] * batch, 2)
out = {}
for batch, runs in ((32, 1), (1, 4)):
    before, rows = cpu_by_process(), []
    for _ in range(runs):
        rows.append(run_requests(engine, prompts[:batch], [None] * batch, tokens))
    after = cpu_by_process()
    cpu = sum(t - before.get(pid, 0.0) for pid, t in after.items())
    out[batch] = {"cpu_ms_per_token": 1e3 * cpu / sum(r.output_tokens for r in rows),
                  "decode_tok_s": sum(r.decode_tokens for r in rows) / sum(r.decode_s for r in rows),
                  "processes": len(after)}
engine.close()
if tp > 1:
    import ray
    ray.shutdown()
shutil.rmtree(work, ignore_errors=True)
print("RESULT " + json.dumps(out))
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default="HEAD")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="generated per request")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    trees = {"old": checkout(args.old), "new": checkout(args.new)}
    pairs = []
    for i in range(args.pairs):
        for tp in (1, 2):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            got = {side: run_child(trees[side], CHILD, str(tp), str(args.tokens), args.dtype, timeout=600)
                   for side in order}
            pair = {"tp": tp, "order": order, "results": got,
                    **{f"{key}_new_over_old": {b: got["new"][str(b)][key] / got["old"][str(b)][key] for b in BATCHES}
                       for key in ("cpu_ms_per_token", "decode_tok_s")}}
            pairs.append(pair)
            print(f"pair {i} TP {tp}: CPU per token new/old {pair['cpu_ms_per_token_new_over_old']}; "
                  f"decode tok/s new/old {pair['decode_tok_s_new_over_old']}", flush=True)
    data = {"benchmark": "ab_tp", "old": args.old, "new": args.new, "dtype": args.dtype, "tokens": args.tokens,
            "machine": machine_info(), "pairs": pairs}
    for key in ("cpu_ms_per_token_new_over_old", "decode_tok_s_new_over_old"):
        data[f"median_{key}"] = {f"tp{tp}_b{b}": median([p[key][b] for p in pairs if p["tp"] == tp])
                                 for tp in (1, 2) for b in BATCHES}
    print(json.dumps({k: v for k, v in data.items() if k.startswith("median")}, indent=1))
    print(write_result("ab_tp", data))
    return data


if __name__ == "__main__":
    main()
