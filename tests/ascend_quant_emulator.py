"""A strict CPU emulator of torch_npu's two W8A8_DYNAMIC ops, as workers/quant/kernels.py calls them.

Contract (torch_npu API reference for npu_dynamic_quant / npu_quant_matmul, Atlas A2/A3; REFERENCE.md):
- npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None) -> (y, scale):
  x fp16/bf16 with dim > 1 (fp32 raises); dst_type None or int8 here; scale fp32 of x.shape[:-1] =
  rowmax|x| / 127; y int8 = round(x / scale), same shape as x.
- npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
  x1 int8 [m, k], x2 int8 [k, n] (ND); scale 1-D of 1 or n, fp32 (or bf16 for a bf16 output);
  pertoken_scale fp32 1-D [m]; with a pertoken_scale the output is fp16 or bf16 (int8 / None raise)
  and offset is None; bias 1-D [n]: int32 / fp32 or the output's dtype. Result
  (x1 @ x2) * scale * pertoken_scale (+ bias), rounded once to output_dtype.
Violations raise RuntimeError (the ops' host checks), so a caller that breaks the contract fails here.
"""
from __future__ import annotations

from collections import Counter

import torch

HALF = (torch.float16, torch.bfloat16)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(what)


class TorchNpuQuantEmulator:
    def __init__(self):
        self.calls: Counter[str] = Counter()

    def npu_dynamic_quant(self, x, *, smooth_scales=None, group_index=None, dst_type=None):
        self.calls["npu_dynamic_quant"] += 1
        check(x.dtype in HALF, f"npu_dynamic_quant: x must be float16 or bfloat16, got {x.dtype}")
        check(x.dim() > 1, "npu_dynamic_quant: x must have more than one dimension")
        check(smooth_scales is None and group_index is None, "emulated without smooth_scales / group_index")
        check(dst_type in (None, torch.int8), f"emulated for int8 output only, got {dst_type}")
        xf = x.float()
        scale = xf.abs().amax(-1) / 127.0
        y = torch.where(scale.unsqueeze(-1) > 0, torch.round(xf / scale.unsqueeze(-1)), torch.zeros_like(xf))
        return y.to(torch.int8), scale

    def npu_quant_matmul(self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
        self.calls["npu_quant_matmul"] += 1
        check(x1.dtype == torch.int8 and x2.dtype == torch.int8, f"x1/x2 must be int8, got {x1.dtype}/{x2.dtype}")
        check(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0],
              f"x1 [m, k] @ x2 [k, n] expected, got {tuple(x1.shape)} @ {tuple(x2.shape)}")
        n = x2.shape[1]
        check(pertoken_scale is not None, "emulated with a per-token scale only (W8A8_DYNAMIC)")
        check(output_dtype in HALF, f"with pertoken_scale the output must be float16 or bfloat16, got {output_dtype}")
        check(offset is None, "offset is not allowed with pertoken_scale")
        allowed_scale = (torch.float32, torch.bfloat16) if output_dtype == torch.bfloat16 else (torch.float32,)
        check(scale.dim() == 1 and scale.numel() in (1, n) and scale.dtype in allowed_scale,
              f"scale must be 1-D of 1 or {n} in {allowed_scale}, got {tuple(scale.shape)} {scale.dtype}")
        check(pertoken_scale.dtype == torch.float32 and pertoken_scale.dim() == 1
              and pertoken_scale.numel() == x1.shape[0],
              f"pertoken_scale must be fp32 [{x1.shape[0]}], got {tuple(pertoken_scale.shape)} {pertoken_scale.dtype}")
        if bias is not None:
            check(bias.dim() == 1 and bias.numel() == n and bias.dtype in (torch.int32, torch.float32, output_dtype),
                  f"bias must be 1-D [{n}] int32/fp32/{output_dtype}, got {tuple(bias.shape)} {bias.dtype}")
        acc = (x1.double() @ x2.double()).float()
        y = acc * scale.float() * pertoken_scale.unsqueeze(-1)
        if bias is not None:
            y = y + bias.float()
        return y.to(output_dtype)
