"""Could the dense bf16 linears leave oneDNN for our MoE kernel? A decode step's GEMMs, oneDNN-packed against
workers/models/cpu_moe.c with one expert (its vector kernel up to 2 rows, its AMX kernel past that) on a plain
weight on transparent huge pages.

    .venv/bin/python -m benchmarks.dense_gemm_kernel [--threads 1] [--rows 1,2,8,32,128,512] [--rounds 3]

The bench checkpoint's linear shapes (benchmarks.common FULL: qkv, o, gate_up, down x 8 layers, the LM head once),
8 distinct copies of each weight taken in turn so that a call reads its weight from memory as a step does, rounds
alternating which side runs first; ms for a step's GEMMs at each row count (a decode batch, a prefill chunk). The
process runs as the engine process does (glibc's malloc on huge pages: it re-executes itself with
workers/engine_process.py's MALLOC_TUNABLES). Writes results/dense_gemm_kernel_t<threads>.json / .md. Issue 39:
the kernel would need the weight in its plain layout, so one path serves every row count: the win at a batch of
one has to outweigh the loss at prefill sizes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import median

import torch

from benchmarks.common import FULL, RESULTS, as_engine_process, machine_info, write_result

COPIES = 8


def step_shapes() -> dict[str, tuple[int, int, int]]:
    """name -> (out, in, calls a step)."""
    s = FULL.shape
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    layers = s.num_hidden_layers
    return {"qkv": (q + 2 * kv, s.hidden_size, layers), "o": (s.hidden_size, q, layers),
            "gate_up": (2 * s.intermediate_size, s.hidden_size, layers),
            "down": (s.hidden_size, s.intermediate_size, layers), "lm_head": (s.vocab_size, s.hidden_size, 1)}


def timed(fn, reps: int = 16) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times) * 1e3


def run(rows: list[int], rounds: int) -> dict:
    from lora.native import huge_page_copy
    from workers.models import cpu_moe
    from workers.parallel import linear

    shapes = step_shapes()
    weights = {n: [torch.randn(o, i, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
               for n, (o, i, _) in shapes.items()}
    packed = {n: [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] for n, ws in weights.items()}
    plain = {n: [huge_page_copy(w.unsqueeze(0).contiguous()) for w in ws] for n, ws in weights.items()}
    return compare(rows, rounds, shapes, "kernel", {
        "onednn": lambda name, x, i: linear(x, packed[name][i % COPIES]),
        "kernel": lambda name, x, i: cpu_moe._impl(x, plain[name][i % COPIES],
                                                   torch.tensor([0, x.shape[0]], dtype=torch.int64))})


def compare(rows: list[int], rounds: int, shapes: dict, side: str, calls: dict) -> dict:
    """ms of a step's GEMMs at each row count, oneDNN (calls["onednn"]) against `side`, rounds alternating which
    runs first: calls[s](weight name, x, i) runs the i-th call of that weight (the caller takes copy i % COPIES)."""
    out = {}
    for m in rows:
        sides = {"onednn": [], side: []}
        for r in range(rounds):
            for s in (("onednn", side) if r % 2 == 0 else (side, "onednn")):
                total = 0.0
                for name, (_, k, count) in shapes.items():
                    x, turn = torch.randn(m, k, dtype=torch.bfloat16), iter(range(10**9))
                    total += timed(lambda: calls[s](name, x, next(turn))) * count   # noqa: B023
                sides[s].append(total)
        ratios = [o / k for o, k in zip(sides["onednn"], sides[side])]
        out[m] = {"onednn_ms": round(median(sides["onednn"]), 2), f"{side}_ms": round(median(sides[side]), 2),
                  f"onednn / {side}": round(median(ratios), 3), "per_round": [round(r, 3) for r in ratios]}
        print(m, out[m], flush=True)
    return out


def markdown(data: dict, title: str, side: str, label: str) -> str:
    """The table of `run`'s rows: oneDNN against `side` (its key in the rows, `label` its column name)."""
    lines = [f"# {title} ({data['threads']} threads)", "",
             f"`{data['command']}`; medians of {data['rounds']} alternating rounds (GLIBC_TUNABLES="
             f"'{data['glibc_tunables']}'). > 1: {label} is faster.", "",
             f"| rows | oneDNN ms | {label} ms | oneDNN / {label} | per round |", "|---|---|---|---|---|"]
    for m, r in data["rows"].items():
        lines.append(f"| {m} | {r['onednn_ms']} | {r[f'{side}_ms']} | {r[f'onednn / {side}']} | "
                     f"{', '.join(map(str, r['per_round']))} |")
    return "\n".join(lines) + "\n"


def cli(module: str, doc: str, run_rows, default_rows: str, argv, table) -> dict:
    """A dense GEMM benchmark's command line: threads, rows, rounds; writes results/<module>_t<threads>.json / .md."""
    args_in = sys.argv[1:] if argv is None else list(argv)
    as_engine_process(f"benchmarks.{module}", args_in)
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default=default_rows)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(args_in)
    torch.set_num_threads(args.threads)
    data = {"threads": args.threads, "rounds": args.rounds, "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
            "command": f"python -m benchmarks.{module} " + " ".join(args_in), "machine": machine_info(),
            "rows": run_rows([int(m) for m in args.rows.split(",")], args.rounds)}
    name = f"{module}_t{args.threads}"
    print(write_result(name, data))
    (RESULTS / f"{name}.md").write_text(table(data))
    return data


def main(argv=None) -> dict:
    return cli("dense_gemm_kernel", __doc__, run, "1,2,8,32,128,512", argv, lambda data: markdown(
        data, "A step's dense bf16 GEMMs: oneDNN-packed vs cpu_moe.c as one expert", "kernel", "kernel"))


if __name__ == "__main__":
    main()
