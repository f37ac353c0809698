"""W8A8_DYNAMIC matmuls: per-token symmetric int8 activations x per-channel symmetric int8 weights.

    scale_t = max_k |x[t, k]| / 127          (fp32, per token, computed at run time)
    xq[t]   = round(x[t] / scale_t)          (int8)
    y[t, n] = (sum_k xq[t, k] * W[n, k]) * scale_t * weight_scale[n]   (+ bias), in x's dtype

One kernel object per model runner, chosen once by platform (`w8a8_kernel`); each layer packs its
weight once (`pack`) and calls it. Every op has fixed shapes and never reads the host, so decode
graphs capture it.
- cpu, AMX int8 (Sapphire Rapids and later): one C call per linear (workers/quant/cpu_w8a8.c) that
  quantizes x, runs the int8 GEMM on AMX tiles and rescales into x's dtype, 1.4-2.4x faster than the
  oneDNN path below at M = 1, 8 and 32 on the bench model's shapes (results/w8a8_fused.md), about
  half the time of the bf16 linear: the bytes' ratio. LORASERVE_W8A8_KERNEL=onednn keeps the path below
  (the benchmarks' A/B switch).
- cpu otherwise: oneDNN's int8 GEMM (`torch.ops.onednn.qlinear_pointwise` on a prepacked weight), measured
  against `torch._int_mm` (2-3x slower at M = 1, 8 and 32 on the bench model's shapes) by
  benchmarks/int8_gemm.py (RESULTS.md: W8A8). Its activation scale is per tensor, so it is given 1.0
  and returns acc * weight_scale in fp32; the per-token scale is applied after, which keeps a
  token's result independent of the other tokens in its batch. The weight-only
  `torch._weight_int8pack_mm` (bf16 x, no activation quantization) is 1.1-1.6x faster at M = 1 on
  three of the four shapes, 2-8x slower from M = 8: not used, since switching arithmetic by batch
  size would make a request's tokens depend on how many others share its step.
- npu: `npu_dynamic_quant` + `npu_quant_matmul` (pertoken_scale), as vllm-ascend's W8A8_DYNAMIC
  linear; weight transposed to [in, out] once. fp16 / bf16 only; 310P has no per-token scale.
"""
from __future__ import annotations

import os

import torch

from workers.quant import cpu_w8a8

TINY = torch.finfo(torch.float32).tiny   # an all-zero token quantizes to zeros, not 0/0


def dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq int8 [T, K], scale fp32 [T, 1]): per-token symmetric quantization, computed in fp32.

    Few passes over x (|x|, max, divide, round, cast; max |x| of a bf16 x is exact in bf16): each is a
    parallel region, which a shared CPU makes costly. |x / scale| <= 127 by construction: no clamp."""
    scale = x.abs().amax(-1, keepdim=True).float().div_(127.0).clamp_min_(TINY)
    return torch.div(x, scale).round_().to(torch.int8), scale


class CpuW8A8:
    name = "cpu:onednn"

    def pack(self, weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int8 weight [out, in] and fp32 scale [out] -> what __call__ reads."""
        packed = torch.ops.onednn.qlinear_prepack(weight.contiguous(), None)
        return packed, scale.float().contiguous(), torch.zeros(scale.numel(), dtype=torch.long)

    def __call__(self, x: torch.Tensor, packed: tuple, bias: torch.Tensor | None) -> torch.Tensor:
        weight, scale, zeros = packed
        xq, x_scale = dynamic_quant(x)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, weight, scale, zeros, None, 1.0, 0, torch.float32,
                                                "none", [], "")
        y = y.mul_(x_scale)
        if bias is not None:
            y = y.add_(bias)
        return y.to(x.dtype)


class FusedCpuW8A8:
    name = "cpu:amx_fused"

    def pack(self, weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        return (*cpu_w8a8.pack(weight, scale), *weight.shape)

    def __call__(self, x: torch.Tensor, packed: tuple, bias: torch.Tensor | None) -> torch.Tensor:
        weight, scale, out_features, in_features = packed
        if torch._C._len_torch_dispatch_stack():   # a capture's tape or FakeTensor mode: the registered op
            return torch.ops.loraserve.w8a8_linear(x, weight, scale, bias, out_features)
        return cpu_w8a8.run(x, weight, scale, bias, out_features, in_features)


class NpuW8A8:
    name = "npu:npu_quant_matmul"

    def __init__(self, ops):
        self.ops = ops   # torch_npu (the tests pass their strict CPU emulator of its two ops)

    def pack(self, weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x2 is [in, out]; an fp32 scale is accepted for fp16 and bf16 outputs alike
        return weight.t().contiguous(), scale.float().contiguous()

    def __call__(self, x: torch.Tensor, packed: tuple, bias: torch.Tensor | None) -> torch.Tensor:
        weight, scale = packed
        xq, x_scale = self.ops.npu_dynamic_quant(x)
        return self.ops.npu_quant_matmul(xq, weight, scale, pertoken_scale=x_scale, bias=bias, output_dtype=x.dtype)


def w8a8_kernel(platform: str, dtype: torch.dtype, ops=None, device_name: str | None = None):
    """The W8A8 kernel for this platform and model dtype; ValueError naming what is not supported."""
    if platform == "cpu":
        choice = os.environ.get("LORASERVE_W8A8_KERNEL", "fused")
        if choice not in ("fused", "onednn"):
            raise ValueError(f"LORASERVE_W8A8_KERNEL must be 'fused' or 'onednn', not {choice!r}")
        fused = choice == "fused" and dtype in cpu_w8a8.DTYPES and cpu_w8a8.available()
        return FusedCpuW8A8() if fused else CpuW8A8()
    if platform == "npu":
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"W8A8 on npu needs dtype float16 or bfloat16 (npu_dynamic_quant), not {dtype}")
        if ops is None:
            import torch_npu as ops   # only on the npu platform (REFERENCE: torch_npu breaks a CPU import)
        if device_name is None:
            device_name = torch.npu.get_device_name(torch.npu.current_device())
        if "310P" in device_name:
            raise ValueError("W8A8_DYNAMIC on a 310P is not supported: its npu_quant_matmul has no per-token scale")
        return NpuW8A8(ops)
    raise ValueError(f"W8A8 checkpoints are served on cpu and npu; device {platform!r} is not implemented")
