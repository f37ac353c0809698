"""A decode step's dense bf16 GEMMs at up to 32 rows: oneDNN against workers/cpu_gemv.c, on the same packed weight.

    .venv/bin/python -m benchmarks.dense_gemv [--threads 1] [--rows 1,2,3,4,5,8,16,32] [--rounds 3]

The bench checkpoint's linear shapes (benchmarks.dense_gemm_kernel's step: qkv, o, gate_up, down x 8 layers, the
LM head once), 8 distinct copies of each weight taken in turn so that every call reads its weight from memory as a
step does; the same prepack_linears weights for both sides (cpu_gemv.adopt checks that the kernel reads their
layout), rounds alternating which side runs first; ms for a step's GEMMs at each row count. Run as the engine
process runs (glibc's malloc on huge pages). Writes results/dense_gemv_t<threads>.json / .md: the evidence behind
cpu_gemv's two paths and max_rows() (issue 39: dense bf16 at batch 1, 8 and 32).
"""
from __future__ import annotations

import argparse
import os
import sys
from statistics import median

import torch

from benchmarks.common import RESULTS, as_engine_process, machine_info, write_result
from benchmarks.dense_gemm_kernel import COPIES, step_shapes, timed


def run(rows: list[int], rounds: int) -> dict:
    from torch import nn

    from workers import cpu_gemv
    from workers.parallel import PACK_BATCH_HINT

    shapes = step_shapes()
    packed = {}
    for name, (o, i, _) in shapes.items():
        packed[name] = []
        for _ in range(COPIES):
            dense = torch.randn(o, i, dtype=torch.bfloat16) * 0.02
            weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(dense, PACK_BATCH_HINT), requires_grad=False)
            if not cpu_gemv.adopt(weight, dense):
                raise SystemExit(f"cpu_gemv does not read oneDNN's layout of {name} here: nothing to compare")
            packed[name].append(weight)
    out = {}
    for m in rows:
        sides = {"onednn": [], "gemv": []}
        for r in range(rounds):
            for side in (("onednn", "gemv") if r % 2 == 0 else ("gemv", "onednn")):
                total = 0.0
                for name, (_, k, calls) in shapes.items():
                    x, turn = torch.randn(m, k, dtype=torch.bfloat16), iter(range(10**9))
                    if side == "onednn":
                        fn = lambda: torch.ops.mkldnn._linear_pointwise(   # noqa: E731
                            x, packed[name][next(turn) % COPIES], None, "none", [], "")
                    else:
                        fn = lambda: cpu_gemv.linear(x, packed[name][next(turn) % COPIES], None)   # noqa: E731
                    total += timed(fn) * calls
                sides[side].append(total)
        ratios = [o / k for o, k in zip(sides["onednn"], sides["gemv"])]
        out[m] = {"onednn_ms": round(median(sides["onednn"]), 2), "gemv_ms": round(median(sides["gemv"]), 2),
                  "onednn / gemv": round(median(ratios), 3), "per_round": [round(r, 3) for r in ratios]}
        print(m, out[m], flush=True)
    return out


def markdown(data: dict) -> str:
    lines = [f"# A step's dense bf16 GEMMs at up to 32 rows: oneDNN vs cpu_gemv.c on the same packed weight "
             f"({data['threads']} threads)", "",
             f"`{data['command']}`; medians of {data['rounds']} alternating rounds (GLIBC_TUNABLES="
             f"'{data['glibc_tunables']}'). > 1: cpu_gemv.c is faster.", "",
             "| rows | oneDNN ms | cpu_gemv ms | oneDNN / cpu_gemv | per round |", "|---|---|---|---|---|"]
    for m, r in data["rows"].items():
        lines.append(f"| {m} | {r['onednn_ms']} | {r['gemv_ms']} | {r['onednn / gemv']} | "
                     f"{', '.join(map(str, r['per_round']))} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args_in = sys.argv[1:] if argv is None else list(argv)
    as_engine_process("benchmarks.dense_gemv", args_in)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,3,4,5,8,16,32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(args_in)
    torch.set_num_threads(args.threads)
    data = {"threads": args.threads, "rounds": args.rounds, "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
            "command": "python -m benchmarks.dense_gemv " + " ".join(args_in), "machine": machine_info(),
            "rows": run([int(m) for m in args.rows.split(",")], args.rounds)}
    name = f"dense_gemv_t{args.threads}"
    print(write_result(name, data))
    (RESULTS / f"{name}.md").write_text(markdown(data))
    return data


if __name__ == "__main__":
    main()
