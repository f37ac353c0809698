"""One MoE layer's expert GEMMs at Qwen3-30B-A3B's expert shape (128 experts, top 8, hidden 1024 / expert 384 as
benchmarks/moe.py scales it), bf16: the grouped kernel (workers/models/cpu_moe.c), torch._grouped_mm and one oneDNN
GEMM per active expert on prepacked weights (the path before), each projection, alternating in every repetition.

    .venv/bin/python -m benchmarks.moe_grouped_gemm [threads] [tokens,...]

Prints and writes results/moe_grouped_gemm_<threads>t.json: median ms per call and the active experts' weight bytes
per second (the decode is bound by them).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from benchmarks.common import RESULTS
from workers.models import cpu_moe
from workers.parallel import linear

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, REPEATS = 128, 1024, 384, 8, 7


def main(threads: int = 1, tokens=(1, 4, 16, 32, 64, 128)) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    weights = {"gate_up": torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, dtype=torch.bfloat16) * 0.02,
               "down": torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, dtype=torch.bfloat16) * 0.02}
    packed = {name: [torch.ops.mkldnn._reorder_linear_weight(w[e].contiguous(), 16) for e in range(EXPERTS)]
              for name, w in weights.items()}
    out = {}
    for T in tokens:
        ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(T)])
        offsets = cpu_moe.expert_offsets(ids.reshape(-1).sort().values, EXPERTS)
        bounds = offsets.tolist()
        runs = [(e, bounds[e], bounds[e + 1]) for e in range(EXPERTS) if bounds[e + 1] > bounds[e]]
        for name, w in weights.items():
            x = torch.randn(T * TOP_K, w.shape[2], dtype=torch.bfloat16)

            def per_expert(x=x, w=w, name=name):
                y = x.new_empty(x.shape[0], w.shape[1])
                for e, lo, hi in runs:
                    y[lo:hi] = linear(x[lo:hi], packed[name][e])

            calls = {"kernel": lambda x=x, w=w: cpu_moe._impl(x, w, offsets),
                     "grouped_mm": lambda x=x, w=w: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:].int()),
                     "onednn_per_expert": per_expert}
            times = {key: [] for key in calls}
            for _ in range(REPEATS):
                for key, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[key].append(time.perf_counter() - start)
            gb = len(runs) * w.shape[1] * w.shape[2] * 2 / 1e9
            out[f"{T}/{name}"] = {key: {"ms": statistics.median(v) * 1e3, "gb_s": gb / statistics.median(v)}
                                  for key, v in times.items()} | {"active_experts": len(runs)}
            print(T, name, {k: v if isinstance(v, int) else f"{v['ms']:.2f} ms {v['gb_s']:.1f} GB/s"
                            for k, v in out[f"{T}/{name}"].items()}, flush=True)
    (RESULTS / f"moe_grouped_gemm_{threads}t.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1,
         tuple(int(t) for t in sys.argv[2].split(",")) if len(sys.argv) > 2 else (1, 4, 16, 32, 64, 128))
