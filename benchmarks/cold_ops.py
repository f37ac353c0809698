"""What a decode step's small ops cost right after a weight stream, against the same ops hot.

    .venv/bin/python -m benchmarks.cold_ops [--threads 1] [--stream-mb 200] [--repeats 30]

A decode step streams its weights once (a GEMM or, in a MoE layer, cpu_moe.c's grouped GEMM over the active
experts: ~190 MB a layer at batch 16 on benchmarks.moe's shape), and between the streams runs small ops: norms,
rope, the router, the rows' sort, gathers, combines, the forward's Python. Measured in the engine those take 2-6x
their isolated time (benchmarks.step_profile's "other"; the MoE layer's non-GEMM ops). This times each op hot
(run again at once) and cold (right after reading `--stream-mb` of another buffer, as a GEMM's weights are read),
alternating, medians over the repeats, so what the stream costs the ops after it is read off directly. Writes
results/cold_ops_t<threads>_<stream-mb>mb.json (25 MB: a dense layer of the bench checkpoint; 200 MB: a MoE layer).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import machine_info, write_result


def python_calls(n: int = 200) -> int:
    """The forward's Python without torch: calls and attribute reads, as a layer's modules make."""
    class Box:
        value = 1
    box, total = Box(), 0
    for _ in range(n):
        total += box.value
    return total


def ops() -> dict:
    from workers import cpu_ops
    from workers.models import moe_experts

    bf = torch.bfloat16
    x16, router = torch.randn(16, 1024, dtype=bf), torch.randn(128, 1024, dtype=bf) * 0.02
    logits = F.linear(x16, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, 8, dim=-1)
    rows = moe_experts.group_rows(weights.to(bf), ids, 128, graph_safe=False, grouped=True)
    y = torch.randn(128, 1024, dtype=bf)
    x32, delta, w = torch.randn(32, 1024, dtype=bf), torch.randn(32, 1024, dtype=bf), torch.ones(1024, dtype=bf)
    gate_up = torch.randn(32, 6144, dtype=bf)
    return {"python: 200 attribute reads": python_calls,
            "router linear 16x1024 @ 128": lambda: F.linear(x16, router),
            "softmax 16x128 (fp32)": lambda: torch.softmax(logits, dim=-1, dtype=torch.float32),
            "topk 8 of 128": lambda: torch.topk(probs, 8, dim=-1),
            "group_rows (sort by expert, offsets)": lambda: moe_experts.group_rows(weights, ids, 128, False, True),
            "gather 128 rows": lambda: x16[rows.token],
            "combine (weighted index_add)": lambda: moe_experts.MoeExperts.combine(y, rows, 16),
            "add + RMSNorm 32x1024 (cpu_ops.c)": lambda: cpu_ops.add_rms_norm(x32, delta, w, 1e-6),
            "SiLU-and-mul 32x3072 (cpu_ops.c)": lambda: cpu_ops.silu_and_mul(gate_up)}


def run(threads: int, stream_mb: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    stream = torch.ones(stream_mb * 2 ** 20 // 4, dtype=torch.float32)
    table = ops()
    result = {}
    for name, fn in table.items():
        for _ in range(3):
            fn()
        hot, cold = [], []
        for _ in range(repeats):
            stream.sum()            # the weights of a GEMM, read once: everything else leaves the caches
            start = time.perf_counter()
            fn()
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            fn()
            hot.append(time.perf_counter() - start)
        result[name] = {"hot_us": statistics.median(hot) * 1e6, "cold_us": statistics.median(cold) * 1e6}
        result[name]["cold_over_hot"] = result[name]["cold_us"] / result[name]["hot_us"]
        print(f"{name:40s} hot {result[name]['hot_us']:8.1f} us  cold {result[name]['cold_us']:8.1f} us  "
              f"x{result[name]['cold_over_hot']:.1f}", flush=True)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stream-mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    data = {"benchmark": "cold_ops", "stream_mb": args.stream_mb, "repeats": args.repeats,
            "ops": run(args.threads, args.stream_mb, args.repeats), "machine": machine_info()}
    print(write_result(f"cold_ops_t{args.threads}_{args.stream_mb}mb", data))
    print(json.dumps({k: round(v["cold_over_hot"], 1) for k, v in data["ops"].items()}))
    return data


if __name__ == "__main__":
    main()
