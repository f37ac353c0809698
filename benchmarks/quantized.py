"""W8A8_DYNAMIC vs 16/32-bit: weight memory, decode tok/s at batch 1 / 8 / 32, base and 8 adapters.

    .venv/bin/python -m benchmarks.quantized [--sizes '{"rounds": 3}']

The bench checkpoint (benchmarks/checkpoint.py, bf16) and its W8A8_DYNAMIC copy written by
`loraserve quantize` (workers/quant/writer.py). Five engines, one per variant, live together:
bf16 and fp32 (the float checkpoint; fp32 is what the CPU targets without bf16 instructions run),
w8a8 with bf16 or fp32 activations on the engine's CPU kernel (the fused one where the CPU has AMX
int8: workers/quant/cpu_w8a8.c), and w8a8_bf16_onednn, bf16 activations on the oneDNN path the fused
kernel replaced (LORASERVE_W8A8_KERNEL=onednn while that engine is built): before vs after in one run
(their greedy tokens must be identical: the same arithmetic). Each round runs every (batch, workload)
on every variant, the variant order rotated per round; ratios are taken within a round, medians over
rounds.
Greedy agreement of W8A8 with the float model (same prompts, base and adapters) is recorded too.
"""
from __future__ import annotations

import gc
import os
from dataclasses import replace
from pathlib import Path

from benchmarks.checkpoint import _publish, build_adapters, build_checkpoint, cache_root
from benchmarks.common import (FULL, Sizes, machine_info, make_engine, make_prompts, median,
                               run_requests, sizes_dict)

BATCHES = (1, 8, 32)
WORKLOADS = ("base", "eight")
VARIANTS = {"bf16": ("float", "bfloat16"), "fp32": ("float", "float32"),
            "w8a8_bf16": ("w8a8", "bfloat16"), "w8a8_fp32": ("w8a8", "float32"),
            "w8a8_bf16_onednn": ("w8a8", "bfloat16")}


def build_engine(variant: str, model_dir: Path, act_dtype: str, sizes: Sizes):
    """The variant's engine; the W8A8 kernel is chosen as the model is built (workers/quant/kernels.py)."""
    if not variant.endswith("_onednn"):
        return make_engine(model_dir, act_dtype, sizes)
    os.environ["LORASERVE_W8A8_KERNEL"] = "onednn"
    try:
        return make_engine(model_dir, act_dtype, sizes)
    finally:
        del os.environ["LORASERVE_W8A8_KERNEL"]


def quantized_checkpoint(float_dir: Path) -> Path:
    from workers.quant.writer import quantize_checkpoint
    return _publish(lambda tmp: quantize_checkpoint(float_dir, tmp), cache_root() / f"{float_dir.name}-w8a8_dynamic")


def weight_bytes(engine) -> dict:
    params = engine.executor.resident_bytes()["params"]
    linear = sum(n for k, n in params.items() if k.startswith("layers.") and "_proj." in k)
    return {"all": sum(params.values()), "decoder_linears": linear}


def run(sizes: Sizes) -> dict:
    float_dir = build_checkpoint("bfloat16", sizes.shape)
    dirs = {"float": float_dir, "w8a8": quantized_checkpoint(float_dir)}
    adapters = build_adapters(8, sizes.shape, sizes.rank)
    engines = {}
    for variant, (kind, act_dtype) in VARIANTS.items():
        engines[variant] = build_engine(variant, dirs[kind], act_dtype, replace(sizes, batch=max(BATCHES)))
        for i, path in enumerate(adapters):
            engines[variant].load_adapter(f"lora-{i}", str(path))
    memory = {v: weight_bytes(e) for v, e in engines.items()}
    prompts = make_prompts(replace(sizes, num_requests=max(BATCHES)))
    tok_s = {(v, b, w): [] for v in VARIANTS for b in BATCHES for w in WORKLOADS}
    tokens = {}
    for r in range(sizes.rounds):
        order = list(VARIANTS)[r % len(VARIANTS):] + list(VARIANTS)[:r % len(VARIANTS)]
        for b in BATCHES:
            for w in WORKLOADS:
                names = [None] * b if w == "base" else [f"lora-{i % 8}" for i in range(b)]
                for v in order:
                    gc.collect()
                    timing = run_requests(engines[v], prompts[:b], names, sizes.max_tokens)
                    tok_s[(v, b, w)].append(timing.decode_tok_s)
                print(f"round {r} batch {b} {w}: " + "  ".join(f"{v}={tok_s[(v, b, w)][-1]:.1f}" for v in VARIANTS),
                      flush=True)
    for v in VARIANTS:   # greedy agreement, on the batch-32 requests (base and adapters)
        outs = []
        for w in WORKLOADS:
            names = [None] * 32 if w == "base" else [f"lora-{i % 8}" for i in range(32)]
            outs += [o.token_ids for o in engines[v].generate(prompts[:32], _greedy(sizes), adapters=names)]
        tokens[v] = outs
    for e in engines.values():
        e.close()

    def ratio(a, b, batch, w):
        return median([x / y for x, y in zip(tok_s[(a, batch, w)], tok_s[(b, batch, w)])])

    table = {f"batch {b}, {w}": {"tok_s": {v: round(median(tok_s[(v, b, w)]), 1) for v in VARIANTS},
                                  "w8a8_bf16 / bf16": round(ratio("w8a8_bf16", "bf16", b, w), 3),
                                  "w8a8_fp32 / fp32": round(ratio("w8a8_fp32", "fp32", b, w), 3),
                                  "w8a8_bf16 / fp32": round(ratio("w8a8_bf16", "fp32", b, w), 3),
                                  "w8a8_bf16 / w8a8_bf16_onednn": round(ratio("w8a8_bf16", "w8a8_bf16_onednn", b,
                                                                              w), 3),
                                  "w8a8_bf16_onednn / bf16": round(ratio("w8a8_bf16_onednn", "bf16", b, w), 3)}
             for b in BATCHES for w in WORKLOADS}
    agreement = {f"{q} vs {f}": _agreement(tokens[q], tokens[f]) for q, f in (("w8a8_bf16", "bf16"),
                                                                              ("w8a8_fp32", "fp32"),
                                                                              ("w8a8_bf16", "w8a8_bf16_onednn"))}
    return {"machine": machine_info(), "sizes": sizes_dict(sizes), "checkpoints": {k: str(p) for k, p in dirs.items()},
            "weight_bytes": memory,
            "weight_memory_w8a8_over_bf16": {k: round(memory["w8a8_bf16"][k] / memory["bf16"][k], 3)
                                             for k in ("all", "decoder_linears")},
            "decode": table, "greedy_agreement": agreement,
            "samples": {f"{v} b{b} {w}": t for (v, b, w), t in tok_s.items()}}


def _greedy(sizes: Sizes):
    from workers import SamplingParams
    return SamplingParams(max_tokens=sizes.max_tokens, temperature=0.0, ignore_eos=True)


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    first = sum(x[0] == y[0] for x, y in zip(a, b))
    prefix = sum(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b))
    return {"sequences_identical": f"{same}/{len(a)}", "first_token_identical": f"{first}/{len(a)}",
            "mean_common_prefix_tokens": round(prefix / len(a), 1), "tokens_per_sequence": len(a[0])}


if __name__ == "__main__":
    import argparse

    from benchmarks.common import sizes_from_json, write_result
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="JSON overrides of benchmarks.common.Sizes")
    args = parser.parse_args()
    print(write_result("quantized", run(sizes_from_json(args.sizes, replace(FULL, rounds=3)))))
