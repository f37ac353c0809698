"""A decode step's dense bf16 linears at up to 32 rows through cpu_gemv.c, on oneDNN's own packed weight.

    loraserve::packed_gemv(x, weight, bias, in_padded, act=0) -> y
        y = x @ W.T (+ bias), W the packed weight's matrix; act=SILU_AND_MUL: silu(gate) * up of that [gate | up]

prepack_linears (workers/parallel.py) reorders every linear weight once into oneDNN's blocked layout, which its AMX
kernels need for prefill; `adopt` then checks, value for value in its first, a middle and its last 1024 outputs,
that the packed buffer holds the weight where cpu_gemv.c reads it (blocks of 32 outputs, each the input's bf16 pairs
in order: the layout oneDNN picks for bf16 with batch hint 32 on this CPU) and marks the parameter. A weight in any
other layout (another oneDNN version or CPU) is not marked and stays on oneDNN alone: the check is the contract,
not oneDNN's format name.
One copy of every weight serves both: parallel.linear sends up to `max_rows()` rows here, more to oneDNN.

The kernel's two paths (results/dense_gemv_t1.md, _t2.md: the bench checkpoint's step shapes, a step's GEMMs,
oneDNN's time / this kernel's): one to four rows on AVX512-BF16 dot instructions, 1.20-1.28x at one row, 1.11-1.22x
at 2-4 (past four the dot products, not the bytes, bound it: 0.85x at 8); 5 to 32 rows on AMX tiles where Linux
lends them, 1.02-1.13x at 1 thread, 1.09-1.14x at 2. Without AMX `max_rows()` is 4.

Registered through torch.library with a fake, so the decode graph's tape (workers/tape_graph.py) records it as one
op; an eager call (no dispatch mode, not tracing) calls the kernel directly. LORASERVE_DENSE_GEMV=0 at start (or
ENABLED = False, benchmarks/dense_gemv.py's A/B) keeps every row count on oneDNN.
"""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lora import native

SOURCE = Path(__file__).with_name("cpu_gemv.c")
BLOCK = 32        # outputs of one block of the layout
ENABLED = os.environ.get("LORASERVE_DENSE_GEMV", "1") != "0"
OUT_OF_MEMORY = 1   # the kernel's nonzero returns (lora/status.h), the others a refused shape
_CHECK_ROWS = 1024   # output rows of each chunk adopt compares (no full-size temporary)
SILU_AND_MUL = 1     # gemv_args.act: the MLP's gate_up projection and its activation in one pass (cpu_gemv.c)
MOST_ROWS = 32       # cpu_gemv.c's: the rows of one call at most (the AMX path's; the activation's scratch)


class _Args(ctypes.Structure):
    """gemv_args of cpu_gemv.c, field for field."""
    _fields_ = [("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("in_dim", ctypes.c_int64), ("w", ctypes.c_void_p), ("in_padded", ctypes.c_int64),
                ("out_dim", ctypes.c_int64), ("bias", ctypes.c_void_p), ("bias_bf16", ctypes.c_int64),
                ("y", ctypes.c_void_p), ("y_stride", ctypes.c_int64), ("act", ctypes.c_int64)]


_load, available = native.library(SOURCE, {"gemv_bf16": [ctypes.c_void_p], "gemv_init": [], "gemv_max_rows": []},
                                  ready=lambda lib: lib.gemv_init() == 0)


@native.constant_result
@functools.cache
def max_rows() -> int:
    """The most rows a call takes on a path faster than oneDNN's: 32 with AMX, else 4 (0 without the kernel)."""
    lib = _load()
    return lib.gemv_max_rows() if lib is not None else 0


@dataclass(frozen=True)
class Layout:
    """Where the kernel reads an adopted weight: its buffer (alive as long as the parameter) and padded input."""
    address: int
    in_padded: int


def _raw(packed: torch.Tensor) -> torch.Tensor:
    """The packed tensor's bytes as int16, without a copy (oneDNN's tensors have no strided view of their own)."""
    count = torch.ops.mkldnn._nbytes(packed) // 2
    return torch.frombuffer((ctypes.c_int16 * count).from_address(torch.ops.mkldnn.data_ptr(packed)),
                            dtype=torch.int16, count=count)


def layout_of(packed: torch.Tensor, dense: torch.Tensor) -> Layout | None:
    """The Layout if `packed` (oneDNN's reorder of `dense`) holds dense's values where cpu_gemv.c reads them (in
    the chunks compared), else None."""
    out_dim, in_dim = dense.shape
    if not (packed.is_mkldnn and packed.dtype == dense.dtype == torch.bfloat16 and in_dim % 2 == 0):
        return None
    out_padded = -(-out_dim // BLOCK) * BLOCK
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if nbytes % (2 * out_padded) or (nbytes // (2 * out_padded)) % 2 or nbytes // (2 * out_padded) < in_dim:
        return None
    in_padded = nbytes // (2 * out_padded)
    raw = _raw(packed).view(out_padded // BLOCK, in_padded // 2, BLOCK, 2)
    values = dense.contiguous().view(torch.int16)
    # the first, a middle and the last chunk of whole blocks (_CHECK_ROWS is a multiple of BLOCK), padding
    # included: oneDNN lays every block out by one formula, and comparing all of them cost ~1.4 s a GB at load
    starts = sorted({0, (out_dim // 2) // _CHECK_ROWS * _CHECK_ROWS, (out_dim - 1) // _CHECK_ROWS * _CHECK_ROWS})
    for o in starts:
        part = values[o:o + _CHECK_ROWS]
        n = -(-part.shape[0] // BLOCK) * BLOCK
        want = torch.nn.functional.pad(part, (0, in_padded - in_dim, 0, n - part.shape[0]))
        want = want.view(n // BLOCK, BLOCK, in_padded // 2, 2).transpose(1, 2)
        if not torch.equal(raw[o // BLOCK:(o + n) // BLOCK], want):
            return None
    return Layout(torch.ops.mkldnn.data_ptr(packed), in_padded)


def adopt(packed: torch.nn.Parameter, dense: torch.Tensor) -> bool:
    """Mark `packed` (prepack_linears' parameter, oneDNN's reorder of `dense`) for `linear`'s few-row calls where
    the kernel runs here and reads its layout. Returns whether it did."""
    if not (ENABLED and available()):
        return False
    layout = layout_of(packed, dense)
    if layout is not None:
        packed.gemv = layout
    return layout is not None


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, in_padded: int, act: int = 0) -> None:
    out_dim, in_dim = weight.shape
    ok = (x.dtype == torch.bfloat16 and x.is_cpu and x.shape[-1] == in_dim and x.stride(-1) == 1
          and weight.dtype == torch.bfloat16 and in_dim % 2 == 0 and in_padded >= in_dim
          and (bias is None or (bias.dtype in (torch.bfloat16, torch.float32) and bias.numel() == out_dim
                                and bias.is_contiguous()))
          and act in (0, SILU_AND_MUL) and (not act or (takes_silu(weight) and x.numel() <= MOST_ROWS * in_dim)))
    if not ok:
        operands = [None if t is None else (tuple(t.shape), t.dtype) for t in (x, weight, bias)]
        raise ValueError(f"packed_gemv: x, weight, bias {operands}, in_padded {in_padded}, act {act} (it needs bf16 "
                         "x with unit column stride over the weight's even input, a bf16 / fp32 bias [out] or none; "
                         "SiLU-and-mul: outputs of whole 64-blocks, 32 rows at most)")


def _run(x: torch.Tensor, address: int, out_dim: int, in_padded: int, bias: torch.Tensor | None,
         act: int = 0) -> torch.Tensor:
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU GEMV kernel is not available (see lora/native.py's warning)")
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty(*x.shape[:-1], out_dim // 2 if act else out_dim, dtype=x.dtype)
    args = _Args(x2.data_ptr(), x2.stride(0), x2.shape[0], x2.shape[1], address, in_padded, out_dim,
                 None if bias is None else bias.data_ptr(), bias is not None and bias.dtype == torch.bfloat16,
                 y.data_ptr(), y.shape[-1], act)
    native.call(lib.gemv_bf16, args, lambda status: _failed(status, x.shape, in_padded))
    return y


def _failed(status: int, shape, in_padded: int) -> None:
    if status == OUT_OF_MEMORY:
        raise MemoryError("CPU GEMV kernel: out of memory for its rows' tiles")
    raise ValueError(f"packed_gemv: the kernel refused x {tuple(shape)} over a weight of {in_padded} inputs")


def _op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, in_padded: int, act: int = 0) -> torch.Tensor:
    _check(x, weight, bias, in_padded, act)
    if not weight.is_mkldnn:
        raise ValueError("packed_gemv: the weight must be oneDNN's packed tensor (prepack_linears)")
    return _run(x, torch.ops.mkldnn.data_ptr(weight), weight.shape[0], in_padded, bias, act)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: int = 0) -> torch.Tensor:
    """x @ weight.T (+ bias) for an adopted weight (`weight.gemv`), or with act=SILU_AND_MUL silu(gate) * up of it
    (`takes_silu`); the caller sends at most max_rows() rows."""
    layout = weight.gemv
    if not native.eager():   # a capture's tape, FakeTensor mode, a torch.compile trace: the registered op
        return torch.ops.loraserve.packed_gemv(x, weight, bias, layout.in_padded, act)
    if not (x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.shape[-1] == weight.shape[1]):
        _check(x, weight, bias, layout.in_padded, act)   # raises, naming the operands
    return _run(x, layout.address, weight.shape[0], layout.in_padded, bias, act)


def takes_silu(weight: torch.Tensor) -> bool:
    """Whether `linear(..., act=SILU_AND_MUL)` takes this adopted weight: [gate | up], halves of whole blocks."""
    return weight.shape[0] % (2 * BLOCK) == 0


def _fake(x, weight, bias, in_padded, act=0):
    _check(x, weight, bias, in_padded, act)
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2 if act else weight.shape[0])


_LIB = torch.library.Library("loraserve", "FRAGMENT")   # beside the LoRA, attention, MoE and W8A8 ops
_LIB.define("packed_gemv(Tensor x, Tensor weight, Tensor? bias, int in_padded, int act=0) -> Tensor")
for _key in ("CPU", "MkldnnCPU"):   # the dispatcher keys a call by its weight, oneDNN's tensor
    _LIB.impl("packed_gemv", native.recordable(_op), _key)
torch.library.register_fake("loraserve::packed_gemv", _fake, lib=_LIB)
