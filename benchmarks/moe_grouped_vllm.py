"""The grouped expert GEMM (workers/models/cpu_moe.py) beside vLLM's CPU build, at 1 and 2 threads, base only.

    .venv/bin/python -m benchmarks.moe_grouped_vllm [pairs]      (vLLM from .cache/vllm-venv, as benchmarks.moe_vllm)

benchmarks/moe_vllm.py's checkpoint, prompts and jobs (each system in a process of its own), three systems per
round in rotated order: vLLM, ours, and ours with the grouped GEMM off (LORASERVE_MOE_KERNEL=0: one oneDNN GEMM
per active expert, what moe_vllm.py measured before it); every ratio is taken within its round. Writes
results/moe_grouped_vllm.json.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from benchmarks import moe, moe_vllm, peer_vllm
from benchmarks.common import RESULTS, make_prompts, median, sizes_from_json

SYSTEMS = {"vllm": ("vllm", None), "ours": ("ours", "1"), "ours_per_expert": ("ours", "0")}


def _job(name: str, spec: dict) -> dict:
    system, kernel = SYSTEMS[name]
    previous = os.environ.get("LORASERVE_MOE_KERNEL")
    if kernel is not None:
        os.environ["LORASERVE_MOE_KERNEL"] = kernel   # read by the job's process at import
    try:
        return peer_vllm.run_job(system, spec)
    finally:
        if previous is None:
            os.environ.pop("LORASERVE_MOE_KERNEL", None)
        else:
            os.environ["LORASERVE_MOE_KERNEL"] = previous


def run(threads: int, pairs: int) -> dict:
    sizes = replace(sizes_from_json(moe_vllm.SIZES), shape=moe.SHAPE, num_requests=16, threads=threads)
    spec = moe_vllm.spec_for(moe.build_checkpoint("bfloat16"), make_prompts(sizes), sizes, {})
    names, rounds = list(SYSTEMS), []
    for r in range(pairs):
        jobs = {name: _job(name, spec) for name in names[r % 3:] + names[:r % 3]}
        tok_s = {name: job["workloads"]["base"]["output_tok_s"] for name, job in jobs.items()}
        rounds.append({"tok_s": tok_s, "ours_over_vllm": tok_s["ours"] / tok_s["vllm"],
                       "per_expert_over_vllm": tok_s["ours_per_expert"] / tok_s["vllm"],
                       "ours_over_per_expert": tok_s["ours"] / tok_s["ours_per_expert"],
                       "agree_with_vllm": peer_vllm.agreement(jobs["ours"], jobs["vllm"]),
                       "agree_with_per_expert": peer_vllm.agreement(jobs["ours"], jobs["ours_per_expert"])})
        print(threads, rounds[-1], flush=True)
    return {"rounds": rounds, **{key: median([r[key] for r in rounds]) for key in
                                 ("ours_over_vllm", "per_expert_over_vllm", "ours_over_per_expert")}}


def main(pairs: int = 3) -> dict:
    out = {"benchmark": "moe_grouped_vllm", "sizes": moe_vllm.SIZES,
           "threads": {str(t): run(t, pairs) for t in (1, 2)}}
    (RESULTS / "moe_grouped_vllm.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
