"""Every routed expert of a MoE layer over its rows in one call on the CPU: cpu_moe.c's grouped GEMM as a torch op,
its vector kernel for a few rows per expert (decode), its AMX kernel (bf16) or torch's own grouped GEMM
(torch._grouped_mm, oneDNN underneath) for many.

    loraserve::moe_grouped_gemm(x, w, offsets) -> y     y[n] = x[n] @ w[e].T for offsets[e] <= n < offsets[e+1]

x holds the (token, choice) rows sorted by expert, w is [E, out, in], offsets [E + 1] int64 the cumulative row
counts (npu_grouped_matmul's group_list with a leading 0), computed on the device: nothing is read back to the
host, so eager steps and a captured decode (workers/tape_graph.py records the op as one) run the same call. An
eager call (no dispatch mode, not tracing) calls the kernel directly, as workers/cpu_ops.py does. `applies` says
whether the kernel takes the operands (CPU, bf16 / fp32, a C compiler, LORASERVE_MOE_KERNEL not 0); where it
does not, moe_experts.py keeps one oneDNN GEMM per active expert (same maths).

Which for which (results/moe_grouped.md, Qwen3-30B-A3B's expert shape, bf16, 1 thread): the vector kernel reads
each active expert's weight once with all its rows and wins up to ~2 rows per expert (1.1-2x over oneDNN per
expert); past that its dot products are compute-bound. There bf16 with dims multiples of 32 runs on AMX tiles
(w read as stored, x's rows re-laid out once: 1.5-1.8x torch._grouped_mm from 4 rows per expert); other
shapes and fp32 take torch._grouped_mm, which needs 16-byte row strides; shapes without them stay on the vector
kernel (any shape, same maths). The choice follows the shapes only (rows per expert on average), so a captured
decode records the same op its eager step runs.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from lora import native

SOURCE = Path(__file__).with_name("cpu_moe.c")
_SYMBOLS = {torch.bfloat16: "moe_gemm_bf16", torch.float32: "moe_gemm_f32"}
_AMX = "moe_gemm_bf16_amx"   # many rows per expert, bf16
OUT_OF_MEMORY, OUT_OF_RANGE = 1, 2   # the kernel's nonzero returns
# Off switch for A/B measurement (benchmarks/moe.py --kernel-ab flips it between runs in one process)
ENABLED = os.environ.get("LORASERVE_MOE_KERNEL", "1") != "0"
KERNEL_ROWS_PER_EXPERT = 2   # on average, up to which the kernel runs (torch._grouped_mm past it)


class _Args(ctypes.Structure):
    """moe_args of cpu_moe.c, field for field."""
    _fields_ = [("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64), ("in_dim", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("out_dim", ctypes.c_int64), ("num_experts", ctypes.c_int64),
                ("offsets", ctypes.c_void_p), ("y", ctypes.c_void_p), ("y_stride", ctypes.c_int64),
                ("num_rows", ctypes.c_int64)]


_load, available = native.library(SOURCE, {name: [ctypes.c_void_p] for name in (*_SYMBOLS.values(), _AMX)}
                                  | {"moe_amx_init": []})


@native.constant_result
@functools.cache
def amx_available() -> bool:
    """Whether the many-rows bf16 kernel on AMX tiles runs here (built with AMX bf16, and Linux lends the tiles)."""
    lib = _load()
    return lib is not None and lib.moe_amx_init() == 0


def _amx(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the AMX kernel takes these operands (many rows per expert, bf16, dims multiples of 32)."""
    return (x.shape[0] > KERNEL_ROWS_PER_EXPERT * w.shape[0] and x.dtype == torch.bfloat16
            and x.shape[1] % 32 == 0 and w.shape[1] % 32 == 0 and amx_available())


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel takes these operands (dtype and device; shapes are checked by the op)."""
    return ENABLED and x.is_cpu and w.is_cpu and x.dtype in _SYMBOLS and w.dtype == x.dtype and available()


def _check(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    ok = (x.dim() == 2 and w.dim() == 3 and x.dtype == w.dtype and x.dtype in _SYMBOLS and x.stride(1) == 1
          and w.is_contiguous() and x.shape[1] == w.shape[2] and offsets.dtype == torch.int64
          and offsets.shape == (w.shape[0] + 1,) and offsets.is_contiguous())
    if not ok:
        raise ValueError(f"moe_grouped_gemm: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, offsets "
                         f"{tuple(offsets.shape)} {offsets.dtype} (it needs bf16 / fp32 x and a contiguous w "
                         "[E, out, in] alike, unit column strides, int64 offsets [E + 1])")


def _impl(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    _check(x, w, offsets)
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU MoE kernel is not available (see lora/native.py's warning)")
    y = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype)
    args = _Args(x.data_ptr(), x.stride(0), x.shape[1], w.data_ptr(), w.shape[1], w.shape[0], offsets.data_ptr(),
                 y.data_ptr(), y.stride(0), x.shape[0])
    status = getattr(lib, _AMX if _amx(x, w) else _SYMBOLS[x.dtype])(ctypes.addressof(args))
    if status == OUT_OF_MEMORY:
        raise MemoryError("CPU MoE kernel: out of memory for its expert list")
    if status != 0:
        raise ValueError(f"moe_grouped_gemm: offsets must rise from 0 to the {x.shape[0]} rows")
    return y


_LIB = torch.library.Library("loraserve", "FRAGMENT")
_LIB.define("moe_grouped_gemm(Tensor x, Tensor w, Tensor offsets) -> Tensor")
_LIB.impl("moe_grouped_gemm", _impl, "CPU")


@torch.library.register_fake("loraserve::moe_grouped_gemm", lib=_LIB)
def _fake(x, w, offsets):
    _check(x, w, offsets)
    return x.new_empty(x.shape[0], w.shape[1])


def _aligned(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes x and w.transpose(1, 2) and writes y: 16-byte row strides (w contiguous)."""
    size = x.element_size()
    return x.stride(1) == 1 and w.is_contiguous() and all(n * size % 16 == 0 for n in (x.stride(0), *w.shape[1:]))


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y[n] = x[n] @ w[e].T for the rows n of expert e (offsets: see the module docstring)."""
    if x.shape[0] > KERNEL_ROWS_PER_EXPERT * w.shape[0] and not _amx(x, w) and _aligned(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:].to(torch.int32))
    if native.eager():
        return _impl(x, w, offsets)
    return torch.ops.loraserve.moe_grouped_gemm(x, w, offsets)


def expert_offsets(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E + 1] int64 cumulative row counts of rows sorted by expert, on the device (fixed shape, no host read)."""
    bounds = torch.arange(num_experts + 1, device=sorted_experts.device, dtype=sorted_experts.dtype)
    return torch.searchsorted(sorted_experts, bounds)
