"""The CPU MoE kernels (workers/models/cpu_moe.py, moe_fused.py) beside vLLM's CPU build, at 1 and 2 threads, base.

    .venv/bin/python -m benchmarks.moe_grouped_vllm [pairs]      (vLLM from .cache/vllm-venv, as benchmarks.moe_vllm)

benchmarks/moe_vllm.py's checkpoint, prompts and jobs (each system in a process of its own), four systems per
round in rotated order: vLLM; ours; ours with the fused routing and expert block off (LORASERVE_MOE_FUSED=0: the
grouped GEMM per projection with torch's routing, gather, SiLU-and-mul and index_add_ between); ours with the
grouped GEMM off too (LORASERVE_MOE_KERNEL=0: one oneDNN GEMM per active expert, what moe_vllm.py measured before
either). Every ratio is taken within its round. Writes results/moe_grouped_vllm.json.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from benchmarks import moe, moe_vllm, peer_vllm
from benchmarks.common import RESULTS, make_prompts, median, sizes_from_json

SYSTEMS = {"vllm": ("vllm", {}), "ours": ("ours", {"LORASERVE_MOE_KERNEL": "1", "LORASERVE_MOE_FUSED": "1"}),
           "ours_unfused": ("ours", {"LORASERVE_MOE_KERNEL": "1", "LORASERVE_MOE_FUSED": "0"}),
           "ours_per_expert": ("ours", {"LORASERVE_MOE_KERNEL": "0"})}
RATIOS = {"ours_over_vllm": ("ours", "vllm"), "unfused_over_vllm": ("ours_unfused", "vllm"),
          "per_expert_over_vllm": ("ours_per_expert", "vllm"), "ours_over_unfused": ("ours", "ours_unfused"),
          "ours_over_per_expert": ("ours", "ours_per_expert")}


def _job(name: str, spec: dict) -> dict:
    system, env = SYSTEMS[name]
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)   # read by the job's process at import
    try:
        return peer_vllm.run_job(system, spec)
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run(threads: int, pairs: int) -> dict:
    sizes = replace(sizes_from_json(moe_vllm.SIZES), shape=moe.SHAPE, num_requests=16, threads=threads)
    spec = moe_vllm.spec_for(moe.build_checkpoint("bfloat16"), make_prompts(sizes), sizes, {})
    names, rounds = list(SYSTEMS), []
    for r in range(pairs):
        jobs = {name: _job(name, spec) for name in names[r % len(names):] + names[:r % len(names)]}
        tok_s = {name: job["workloads"]["base"]["output_tok_s"] for name, job in jobs.items()}
        rounds.append({"tok_s": tok_s, **{key: tok_s[a] / tok_s[b] for key, (a, b) in RATIOS.items()},
                       "agree_with_vllm": peer_vllm.agreement(jobs["ours"], jobs["vllm"]),
                       "agree_with_unfused": peer_vllm.agreement(jobs["ours"], jobs["ours_unfused"]),
                       "agree_with_per_expert": peer_vllm.agreement(jobs["ours"], jobs["ours_per_expert"])})
        print(threads, rounds[-1], flush=True)
    return {"rounds": rounds, **{key: median([r[key] for r in rounds]) for key in RATIOS}}


def main(pairs: int = 3) -> dict:
    out = {"benchmark": "moe_grouped_vllm", "sizes": moe_vllm.SIZES,
           "threads": {str(t): run(t, pairs) for t in (1, 2)}}
    (RESULTS / "moe_grouped_vllm.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
