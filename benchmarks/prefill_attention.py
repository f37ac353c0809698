"""A mixed step's prompt attention on the CPU: one SDPA call per prompt chunk (torch's) against every row of the step
through the decode kernel in one call, each row a query over its own context in the cache (workers/kv_cache.py's
attend_as_rows, workers/cpu_attention.c).

    .venv/bin/python -m benchmarks.prefill_attention [--threads 1] [--lengths 16,32,...] [--repeats 9]

Per prompt length n: 512 / n prompts of n tokens (a step of ~512 prompt tokens; one prompt from 512 on), Qwen3's
attention shape (16 query heads, 2 KV heads of 128: Qwen3-30B-A3B's and the MoE bench's), block size 16, bf16 and
fp32; the two ways alternate, medians over the repeats. Writes results/prefill_attention_t<threads>.json; the
crossover per dtype is kv_cache.ROW_ATTENTION_MAX_CONTEXT.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import machine_info, write_result

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 2, 128, 16


def case(n: int, dtype: torch.dtype):
    """The step's q, the cache with every prompt token's K/V written, the fresh K/V rows, the row tables."""
    from workers.kv_cache import row_tables

    seqs, blocks = max(1, 512 // n), -(-n // BLOCK)
    k_cache = torch.randn(KV_HEADS, seqs * blocks + 1, BLOCK, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(seqs * n, HEADS, HEAD_DIM).to(dtype)
    k, v = torch.randn(seqs * n, KV_HEADS, HEAD_DIM).to(dtype), torch.randn(seqs * n, KV_HEADS, HEAD_DIM).to(dtype)
    tables = [[1 + s * blocks + b for b in range(blocks)] for s in range(seqs)]
    return (seqs, q, k, v, k_cache, v_cache, *row_tables([n] * seqs, [n] * seqs, tables))


def run(threads: int, lengths: list[int], repeats: int) -> dict:
    from workers import cpu_attention
    from workers.kv_cache import _causal

    torch.set_num_threads(threads)
    out = {"benchmark": "prefill_attention", "machine": machine_info(), "threads": threads, "repeats": repeats,
           "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK}, "rows": []}
    for dtype in (torch.bfloat16, torch.float32):
        for n in lengths:
            seqs, q, k, v, k_cache, v_cache, tables, lens, rows = case(n, dtype)

            def sdpa():
                result = torch.empty_like(q)
                for s in range(seqs):
                    r = slice(s * n, (s + 1) * n)
                    result[r] = _causal(q[r], k[r], v[r], HEAD_DIM ** -0.5)
                return result

            def kernel():
                return cpu_attention.decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, rows)

            times = {"sdpa": [], "kernel": []}
            sdpa(), kernel()
            for i in range(repeats):
                for name, fn in (("sdpa", sdpa), ("kernel", kernel))[::1 if i % 2 else -1]:
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            out["rows"].append({"dtype": str(dtype).removeprefix("torch."), "prompt_len": n, "prompts": seqs,
                                "sdpa_ms": ms["sdpa"], "kernel_ms": ms["kernel"],
                                "kernel_over_sdpa": ms["kernel"] / ms["sdpa"]})
            print(out["rows"][-1], flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", default="16,32,64,128,256,512,1024,2048")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    data = run(args.threads, [int(x) for x in args.lengths.split(",")], args.repeats)
    write_result(f"prefill_attention_t{args.threads}", data)
    return data


if __name__ == "__main__":
    main()
