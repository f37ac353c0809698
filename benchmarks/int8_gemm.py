"""Which int8 GEMM the CPU W8A8 kernel uses: per-layer matmul time on the bench model's shapes.

    .venv/bin/python -m benchmarks.int8_gemm [--rounds 7] [--threads N]

Variants (each the whole linear: activation quantization included where it has one):
  fused_w8a8       the fused C kernel: quantization, AMX int8 GEMM and rescale in one call (workers/quant/cpu_w8a8.c)
  onednn_w8a8      per-token int8 x by torch ops, oneDNN qlinear_pointwise on a prepacked int8 weight, the
                   rescale by torch ops (workers/quant/kernels.py CpuW8A8: the engine's path before the fused one)
  int_mm_w8a8      per-token int8 x, torch._int_mm (int32 out; M padded to 17: its CPU path wants M > 16)
  weight_only_bf16 torch._weight_int8pack_mm: bf16 x times int8 weight (no activation quantization)
  bf16_packed      the float engine's bf16 linear (oneDNN, weight prepacked)
  fp32_packed      the float engine's fp32 linear (MKL, weight prepacked)
Rounds alternate the variants; the median per (shape, M) is reported, with the within-round ratios
onednn / fused and bf16 / fused (medians over rounds). Only the three w8a8 variants compute
W8A8_DYNAMIC's arithmetic; the weight-only one is listed for the issue's question. Inputs are bf16, as
the engine's activations (fp32 x for the fp32 variant).
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.checkpoint import QWEN3_0_6B_8L
from benchmarks.common import machine_info, median, write_result
from workers.quant import cpu_w8a8
from workers.quant.kernels import CpuW8A8, FusedCpuW8A8, dynamic_quant
from workers.quant.writer import quantize_weight

BATCHES = (1, 8, 32)


def shapes() -> dict[str, tuple[int, int]]:
    dims = QWEN3_0_6B_8L.module_dims()
    return {"qkv": (dims["q_proj"][0], dims["q_proj"][1] + 2 * dims["k_proj"][1]), "o": dims["o_proj"],
            "gate_up": (dims["gate_proj"][0], 2 * dims["gate_proj"][1]), "down": dims["down_proj"]}


def variants(in_dim: int, out_dim: int):
    w = torch.randn(out_dim, in_dim) * 0.02
    q, scale = quantize_weight(w)
    cpu, fused = CpuW8A8(), FusedCpuW8A8()
    packed = cpu.pack(q, scale.flatten())
    fused_packed = fused.pack(q, scale.flatten()) if cpu_w8a8.available() else None
    qt, s = q.t().contiguous(), scale.flatten()
    w_bf16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 32) if torch.ops.mkldnn._is_mkldnn_bf16_supported() \
        else w.bfloat16()
    w_fp32 = torch.ops.mkl._mkl_reorder_linear_weight(w, 32)

    def int_mm(x):
        xq, xs = dynamic_quant(x)
        m = x.shape[0]
        xq = xq if m > 16 else torch.nn.functional.pad(xq, (0, 0, 0, 17 - m))
        return (torch._int_mm(xq, qt)[:m].float() * xs * s).to(x.dtype)

    def bf16(x):
        xb = x.bfloat16()
        return torch.ops.mkldnn._linear_pointwise(xb, w_bf16, None, "none", [], "") if w_bf16.is_mkldnn \
            else torch.nn.functional.linear(xb, w_bf16)

    fns = {"fused_w8a8": lambda x: fused(x, fused_packed, None),
           "onednn_w8a8": lambda x: cpu(x, packed, None),
            "int_mm_w8a8": int_mm,
            "weight_only_bf16": lambda x: torch._weight_int8pack_mm(x.bfloat16(), q, s.bfloat16()),
            "bf16_packed": bf16,
            "fp32_packed": lambda x: torch.ops.mkl._mkl_linear(x.float(), w_fp32, w, None, x.shape[0])}
    if fused_packed is None:   # no AMX int8 here: the engine runs oneDNN's path
        del fns["fused_w8a8"]
    return fns


def time_us(fn, x, reps: int) -> float:
    fn(x)
    start = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - start) / reps * 1e6


def run(rounds: int) -> dict:
    torch.manual_seed(0)
    results = {}
    with torch.inference_mode():
        for name, (in_dim, out_dim) in shapes().items():
            fns = variants(in_dim, out_dim)
            for m in BATCHES:
                x = torch.randn(m, in_dim).bfloat16()
                samples = {v: [] for v in fns}
                for r in range(rounds):
                    order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
                    for v in order:
                        samples[v].append(time_us(fns[v], x, reps=20))
                row = {v: round(median(t), 1) for v, t in samples.items()}
                if "fused_w8a8" in samples:
                    for other in ("onednn_w8a8", "bf16_packed"):
                        row[f"{other} / fused"] = round(median([o / f for o, f in zip(samples[other],
                                                                                        samples["fused_w8a8"])]), 3)
                results[f"{name}[{in_dim}x{out_dim}] M={m}"] = row
                print(f"{name:8s} M={m:3d} " + "  ".join(f"{v}={t}" for v, t in row.items()), flush=True)
    exact = [v for v in ("fused_w8a8", "onednn_w8a8", "int_mm_w8a8") if v in fns]
    wins = {v: sum(min(exact, key=row.get) == v for row in results.values()) for v in exact}
    return {"machine": machine_info(), "rounds": rounds, "input_dtype": "bfloat16", "us_per_call": results,
            "fastest_w8a8_wins": wins}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(write_result("int8_gemm", run(args.rounds)))
