"""The fused CPU W8A8 linear (cpu_w8a8.c) as a torch op; built by lora/native.py, called by ctypes.

    loraserve::w8a8_linear(x, weight, weight_scale, bias, out_features) -> y

x [..., K] bf16 / fp32, weight as `pack` lays it out, weight_scale fp32 [N], bias [N] or None; y [..., N] in
x's dtype. Registered through torch.library with a fake implementation, so the decode graph's tape
(workers/tape_graph.py) records it as one op and FakeTensor mode sees its shape. Eager calls skip the
dispatcher (`run`): the op's Python dispatch costs about as much as a small layer's quantization.
Needs AMX int8 (Sapphire Rapids and later) and Linux's permission for its tile state; without either
`available()` is False and the W8A8 layers keep oneDNN's GEMM (workers/quant/kernels.py).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from lora import native

SOURCE = Path(__file__).with_name("cpu_w8a8.c")
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SYMBOLS = {"w8a8_init": [], "w8a8_linear": [_P, _I64, _I, _I64, _I64, _P, _I64, _P, _P, _I, _P]}
DTYPES = (torch.bfloat16, torch.float32)
OUT_OF_MEMORY = 1   # the kernel's nonzero returns (3: no AMX, which available() rules out)


_load, available = native.library(SOURCE, _SYMBOLS, ready=lambda lib: lib.w8a8_init() == 0)


def pack(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and its scales [N] -> (AMX B tiles: N padded to 32, K to 64, [N/16][K/64][16][16][4], on huge
    pages (native.huge_page_copy); fp32 scales [N])."""
    n, k = weight.shape
    np_, kp = -(-n // 32) * 32, -(-k // 64) * 64
    w = torch.nn.functional.pad(weight.to(torch.int8), (0, kp - k, 0, np_ - n))
    # w[nb * 16 + j, kc * 64 + r * 4 + i] -> tiles[nb, kc, r, j, i]
    tiles = w.reshape(np_ // 16, 16, kp // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()
    return native.huge_page_copy(tiles.flatten()), scale.float().flatten().contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, n: int):
    k = x.shape[-1]
    ok = (x.dtype in DTYPES and x.device.type == "cpu" and x.stride(-1) == 1 and weight.dtype == torch.int8
          and weight.is_contiguous() and weight.numel() == -(-n // 32) * 32 * -(-k // 64) * 64
          and weight_scale.dtype == torch.float32 and weight_scale.is_contiguous() and weight_scale.numel() == n
          and (bias is None or (bias.dtype in DTYPES and bias.is_contiguous() and bias.numel() == n)))
    if not ok:
        operands = [None if t is None else (tuple(t.shape), t.dtype) for t in (x, weight, weight_scale, bias)]
        raise ValueError(f"the CPU W8A8 kernel does not take x, weight, weight_scale, bias {operands} for {n} outputs"
                         f" (it needs bf16 / fp32 x with unit column stride and pack()'s weight)")


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           out_features: int) -> torch.Tensor:
    """The op: every operand checked."""
    _check(x, weight, weight_scale, bias, out_features)
    return run(x, weight, weight_scale, bias, out_features, x.shape[-1])


def run(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
        out_features: int, in_features: int) -> torch.Tensor:
    """A layer's eager call on pack()'s weight and scales for [in_features] -> [out_features], whose layout
    needs no check (the op's full check costs ~2 us a call, and a step makes 4 per layer): x and bias only."""
    if not (x.dtype in DTYPES and x.stride(-1) == 1 and x.device.type == "cpu" and x.shape[-1] == in_features
            and (bias is None or (bias.dtype in DTYPES and bias.numel() == out_features and bias.is_contiguous()))):
        _check(x, weight, weight_scale, bias, out_features)   # raises, naming the operands
        raise ValueError(f"the CPU W8A8 kernel of this layer takes {in_features} inputs, not {x.shape[-1]}")
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU W8A8 kernel is not available (no AMX int8, or see lora/native.py's warning)")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)   # a view for the layers' inputs (rows of unit column stride)
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    bias_ptr, bias_bf16 = (None, False) if bias is None else (bias.data_ptr(), bias.dtype == torch.bfloat16)
    status = lib.w8a8_linear(x2.data_ptr(), x2.stride(0), x.dtype == torch.bfloat16, x2.shape[0], k,
                             weight.data_ptr(), out_features, weight_scale.data_ptr(), bias_ptr, bias_bf16, y.data_ptr())
    if status == OUT_OF_MEMORY:
        raise MemoryError("CPU W8A8 kernel: out of memory for its quantized activations")
    if status != 0:
        raise RuntimeError(f"CPU W8A8 kernel failed ({status})")
    return y


def _fake(x, weight, weight_scale, bias, out_features):
    _check(x, weight, weight_scale, bias, out_features)
    return x.new_empty(*x.shape[:-1], out_features)


_LIB = torch.library.Library("loraserve", "FRAGMENT")   # beside the LoRA, attention and layer ops
_LIB.define("w8a8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, int out_features) -> Tensor")
_LIB.impl("w8a8_linear", linear, "CPU")
torch.library.register_fake("loraserve::w8a8_linear", _fake, lib=_LIB)
