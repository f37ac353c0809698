"""The memory-bandwidth limit: this machine's read bandwidth and the bytes one decode step must move.

    .venv/bin/python -m benchmarks.bandwidth       (about half a minute)

A decode step has to read every base weight once (the decoder layers and the
tied LM head; the embedding lookup touches only the batch's rows), the LoRA
slots of the adapters in the batch, and each sequence's K and V so far. At a
read bandwidth of BW bytes/s the best possible decode rate for a batch of B
is B * BW / bytes_per_step tokens/s; `throughput.py` reports the fraction of
that bound it reaches, and the byte-bound LoRA retention W / (W + delta).
`run` also sweeps base decode over batch sizes, to show where on this machine the
step stops being bound by bytes and starts being bound by the GEMMs' arithmetic.
"""
from __future__ import annotations

import time

from benchmarks.checkpoint import ModelShape

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Bytes/s of a large contiguous read (tensor.sum over fp32), best and median of `repeats`.

    The bounds use the median: under other load a lone sample has read ~2x the sustained rate.
    """
    import torch

    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()  # fault the pages in before timing
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        samples.append(num_bytes / (time.perf_counter() - start))
    samples.sort()
    return {"best_bytes_per_s": samples[-1], "median_bytes_per_s": samples[len(samples) // 2],
            "samples_bytes_per_s": samples, "tensor_bytes": num_bytes, "repeats": repeats,
            "threads": torch.get_num_threads()}


def base_weight_bytes(shape: ModelShape, dtype: str) -> int:
    return sum(shape.base_params().values()) * DTYPE_BYTES[dtype]


def adapter_slot_bytes(shape: ModelShape, max_rank: int, dtype: str) -> int:
    """Bytes of one adapter's slot (A and B of all seven projections at max_rank), read per step."""
    return shape.lora_params(max_rank) * DTYPE_BYTES[dtype]


def kv_bytes(shape: ModelShape, context_tokens: float, dtype: str) -> float:
    """K and V read for `context_tokens` tokens summed over the batch's sequences."""
    per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * DTYPE_BYTES[dtype]
    return context_tokens * per_token


def step_bytes(shape: ModelShape, dtype: str, batch: float, mean_context: float, adapters: float,
               max_rank: int) -> dict:
    """Bytes one decode step moves, by part: weights, kv, lora (adapters in the batch)."""
    return {"weights": base_weight_bytes(shape, dtype), "kv": kv_bytes(shape, batch * mean_context, dtype),
            "lora": adapters * adapter_slot_bytes(shape, max_rank, dtype)}


def bound_tok_s(parts: dict, batch: float, bandwidth: float) -> float:
    return batch * bandwidth / sum(parts.values())


def decode_sweep(sizes, dtype: str, batches=(1, 8, 32), log=print) -> dict:
    """Base-only decode tokens/s at each batch size, against the bound at that batch."""
    from dataclasses import replace

    from benchmarks.checkpoint import build_checkpoint
    from benchmarks.common import make_engine, make_prompts, run_requests

    bw = read_bandwidth(sizes.bandwidth_bytes, repeats=5)["median_bytes_per_s"]
    engine = make_engine(build_checkpoint(dtype, sizes.shape), dtype, replace(sizes, batch=max(batches)),
                         enable_lora=False)
    out = {}
    for batch in batches:
        prompts = make_prompts(replace(sizes, num_requests=batch))
        run_requests(engine, prompts, [None] * batch, 2)    # warm-up at this shape
        timing = run_requests(engine, prompts, [None] * batch, sizes.max_tokens)
        parts = step_bytes(sizes.shape, dtype, batch, sizes.prompt_len + sizes.max_tokens / 2, 0, sizes.rank)
        bound = bound_tok_s(parts, batch, bw)
        out[str(batch)] = {"decode_tok_s": timing.decode_tok_s, "bound_tok_s": bound,
                           "fraction_of_bound": timing.decode_tok_s / bound,
                           "decode_step_ms": timing.decode_s / timing.decode_steps * 1e3,
                           "gflop_per_s": 2 * sum(sizes.shape.base_params().values()) * timing.decode_tok_s / 1e9}
        log(f"[bandwidth {dtype}] base decode batch {batch:>3}: {timing.decode_tok_s:7.1f} tok/s = "
            f"{out[str(batch)]['fraction_of_bound']:.0%} of the {bound:.0f} tok/s bound")
    engine.close()
    return {"read_bandwidth_bytes_per_s": bw, "batches": out}


def gemm_ceiling(shape: ModelShape, dtype: str, batch: int, repeats: int = 5) -> dict:
    """Decode tokens/s if a step were nothing but its base GEMMs (the model's own shapes, hot weights).

    With the bandwidth bound this is the roofline: past the batch where the two cross, a
    decode step cannot get nearer the bandwidth bound than ceiling / bound.
    """
    import torch
    import torch.nn.functional as F

    from benchmarks.checkpoint import DTYPES

    dims = shape.module_dims()
    q, kv, h, i = dims["q_proj"][1], dims["k_proj"][1], shape.hidden_size, shape.intermediate_size
    layer = [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]          # qkv, o, gate_up, down
    # One weight per layer and module, as in the model: they stream from memory, not from cache.
    shapes = [(o, k) for _ in range(shape.num_hidden_layers) for k, o in layer] + [(shape.vocab_size, h)]
    weights = [torch.empty(o, k, dtype=DTYPES[dtype]).uniform_(-0.02, 0.02) for o, k in shapes]
    inputs = [torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights]
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for x, w in zip(inputs, weights):
            F.linear(x, w)
        best = min(best, time.perf_counter() - start)
    flops = 2 * batch * sum(w.numel() for w in weights)
    return {"batch": batch, "gemm_step_ms": best * 1e3, "ceiling_tok_s": batch / best, "gflop_per_s": flops / best / 1e9}


def run(sizes=None, dtype: str = "bfloat16", log=print) -> dict:
    from benchmarks.common import FULL, machine_info, set_threads, sizes_dict

    sizes = sizes or FULL
    set_threads(sizes.threads)
    bw = read_bandwidth(sizes.bandwidth_bytes)
    sweep = decode_sweep(sizes, dtype, batches=sorted({1, min(8, sizes.batch), sizes.batch}), log=log)
    for batch, row in sweep["batches"].items():
        ceiling = gemm_ceiling(sizes.shape, dtype, int(batch))
        row["gemm_ceiling_tok_s"] = ceiling["ceiling_tok_s"]
        row["gemm_ceiling_gflop_per_s"] = ceiling["gflop_per_s"]
        row["ceiling_fraction_of_bound"] = min(1.0, ceiling["ceiling_tok_s"] / row["bound_tok_s"])
    return {"benchmark": "bandwidth", "dtype": dtype, "sizes": sizes_dict(sizes), "machine": machine_info(),
            "read_bandwidth": bw, "step_bytes_batch": step_bytes(sizes.shape, dtype, sizes.batch,
                                                                 sizes.prompt_len + sizes.max_tokens / 2, 1,
                                                                 sizes.rank),
            "decode_sweep": sweep}


def main(argv=None) -> dict:
    from benchmarks.common import bench_main
    return bench_main("bandwidth", __doc__, run, argv)


if __name__ == "__main__":
    main()
