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

import torch

from benchmarks.dense_gemm_kernel import COPIES, cli, compare, markdown, step_shapes


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
    return compare(rows, rounds, shapes, "gemv", {
        "onednn": lambda name, x, i: torch.ops.mkldnn._linear_pointwise(x, packed[name][i % COPIES], None, "none",
                                                                         [], ""),
        "gemv": lambda name, x, i: cpu_gemv.linear(x, packed[name][i % COPIES], None)})


def main(argv=None) -> dict:
    return cli("dense_gemv", __doc__, run, "1,2,3,4,5,8,16,32", argv, lambda data: markdown(
        data, "A step's dense bf16 GEMMs at up to 32 rows: oneDNN vs cpu_gemv.c on the same packed weight", "gemv",
        "cpu_gemv"))


if __name__ == "__main__":
    main()
