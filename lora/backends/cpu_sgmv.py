"""The cpu LoRA backend: the C kernel cpu_sgmv.c (built by lora/native.py, called by ctypes, also as torch ops)
for the LoRA of every linear layer.

    loraserve::sgmv_add(y, x, a, b, offsets, groups, num_groups)
        the step's planned groups (info.plan.kernel, lora.batch.KernelGroups): the eager phases;
    loraserve::bgmv_add(y, x, a, b, offsets, token_slots)
        one slot per token, grouped inside the kernel: the graph phase.
Both do y[t, offsets[s]:offsets[s+1]] += x[t] @ a[l, s*R:(s+1)*R].T @ b[s][l].T in the slot
pool's layout (lora/ops.py). Registered through torch.library with fake
implementations, so FakeTensor mode and torch.compile see ops that mutate y and read nothing
back. Without the kernel (no C compiler, or LORASERVE_CPU_KERNEL=0) `available()` is False and
lora.backends.get_backend runs torch_native: same results, slower with many adapters per step.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch

from lora import native, ops
from lora.backends.base import LayerLoRA, LoRABackend, torch_ops
from lora.batch import LoRABatchInfo

SOURCE = Path(__file__).with_name("cpu_sgmv.c")
_SYMBOLS = {torch.bfloat16: ("sgmv_add_bf16", "bgmv_add_bf16"), torch.float32: ("sgmv_add_f32", "bgmv_add_f32")}
OUT_OF_MEMORY, OUT_OF_RANGE = 1, 2   # the kernel's nonzero returns


_ARGTYPES = {"sgmv": [ctypes.c_void_p, ctypes.c_int64], "bgmv": [ctypes.c_void_p]}
_load, available = native.library(SOURCE, {name: _ARGTYPES[name[:4]] for names in _SYMBOLS.values() for name in names})


def supports(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel has code for these dtypes; any other layout than the slot pool's (dense
    buffers, unit column strides: what the LoRA layers pass) is refused by the ops themselves."""
    return x.dtype in _SYMBOLS and y.dtype == x.dtype and a.dtype == x.dtype and a.device.type == "cpu"


class _Args(ctypes.Structure):
    """sgmv_args of lora/sgmv.h, field for field (b, out_dims and y_offsets point into one int64 array)."""
    _fields_ = [("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64), ("in_dim", ctypes.c_int64),
                ("a", ctypes.c_void_p), ("a_slot_stride", ctypes.c_int64), ("stack", ctypes.c_int64),
                ("R", ctypes.c_int64), ("b", ctypes.c_void_p), ("out_dims", ctypes.c_void_p),
                ("y_offsets", ctypes.c_void_p), ("y", ctypes.c_void_p), ("y_stride", ctypes.c_int64),
                ("group_slot", ctypes.c_void_p), ("group_rank", ctypes.c_void_p), ("group_start", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("num_rows", ctypes.c_int64), ("num_slots", ctypes.c_int64),
                ("num_indices", ctypes.c_int64), ("a_shared", ctypes.c_void_p)]


class _BgmvCall(ctypes.Structure):
    """bgmv_call of cpu_sgmv.c: the arguments and the token slots."""
    _fields_ = [("args", _Args), ("token_slots", ctypes.c_void_p)]


def _failed(status: int) -> None:
    if status == OUT_OF_MEMORY:
        raise MemoryError("CPU LoRA kernel: out of memory for its scratch buffers")
    raise ValueError("LoRA groups index past the batch, the slots or the rank")


def _check(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int]):
    """Everything the kernel indexes by and reads as it does (the fake implementations check it too)."""
    dtype, stack = x.dtype, len(b)
    ok = (dtype in _SYMBOLS and y.dtype == dtype and a.dtype == dtype and a.device.type == "cpu" and stack > 0
          and a.dim() == 3 and x.dim() == 2 and y.dim() == 2 and len(offsets) == stack + 1 and x.stride(1) == 1
          and y.stride(1) == 1 and a.is_contiguous())
    if ok:
        L, rows, in_dim = a.shape
        R = b[0].shape[-1]
        ok = rows == stack * R and x.shape[1] == in_dim and y.shape[0] == x.shape[0] and 0 <= offsets[0]
        for s, b_s in enumerate(b):
            ok = (ok and b_s.dtype == dtype and b_s.dim() == 3 and b_s.shape[0] == L and b_s.shape[2] == R
                  and offsets[s + 1] == offsets[s] + b_s.shape[1] and b_s.is_contiguous())
        ok = ok and offsets[-1] <= y.shape[1]
    if not ok:
        raise ValueError("the CPU LoRA kernel does not take these operands: y, x, a, b "
                         f"{[(tuple(t.shape), t.dtype) for t in (y, x, a, *b)]}, offsets {list(offsets)} (it needs "
                         "bf16 / fp32 throughout, dense a and b, unit column strides and fitting shapes)")


def _call(index: int, y, x, a, b, offsets, index_tensor: torch.Tensor, pointers: tuple[int, ...], num_indices: int,
          extra) -> None:
    """Run entry `index` (0: sgmv, 1: bgmv) of the kernel for y's dtype; `extra` is its last argument.

    pointers: group_slot, group_rank, group_start and rows, into `index_tensor`."""
    _check(y, x, a, b, offsets)
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU LoRA kernel is not available (see lora/native.py's warning)")
    if index_tensor.dtype != torch.int64 or not index_tensor.is_contiguous() or index_tensor.device.type != "cpu":
        raise ValueError("LoRA groups / token slots must be a contiguous int64 CPU tensor")
    stack = len(b)
    slices = (ctypes.c_int64 * (3 * stack))(*[b_s.data_ptr() for b_s in b], *[b_s.shape[1] for b_s in b],
                                            *offsets[:-1])
    base = ctypes.addressof(slices)
    args = _Args(x.data_ptr(), x.stride(0), a.shape[2], a.data_ptr(), a.stride(0), stack, b[0].shape[2], base,
                 base + 8 * stack, base + 16 * stack, y.data_ptr(), y.stride(0), *pointers, x.shape[0], a.shape[0],
                 num_indices, 0)
    fn = getattr(lib, _SYMBOLS[x.dtype][index])
    if index == 1:   # bgmv: one struct, recorded by a CPU decode graph's capture (lora/native.py)
        call = _BgmvCall(args, extra)
        call.slices = slices   # what b, out_dims and y_offsets point into, alive as long as the record
        native.call(fn, call, _failed)
        return
    status = fn(ctypes.addressof(args), extra)
    if status:
        _failed(status)


def _sgmv_add(y, x, a, b, offsets, groups, num_groups: int) -> None:
    G, n = num_groups, groups.numel()
    if groups.dim() != 1 or not 0 <= 3 * G + 1 <= n:
        raise ValueError(f"LoRA groups: {n} entries cannot hold {G} groups' slot, rank and start")
    ptr = groups.data_ptr()
    _call(0, y, x, a, b, offsets, groups, (ptr, ptr + 8 * G, ptr + 16 * G, ptr + 8 * (3 * G + 1)), n - 3 * G - 1, G)


def _bgmv_add(y, x, a, b, offsets, token_slots) -> None:
    if token_slots.shape != (x.shape[0],):
        raise ValueError(f"token slots {tuple(token_slots.shape)} for x {tuple(x.shape)}: one per row")
    _call(1, y, x, a, b, offsets, token_slots, (0, 0, 0, 0), 0, token_slots.data_ptr())


_LIB = torch.library.Library("loraserve", "FRAGMENT")   # workers/cpu_attention.py adds its op too
_LIB.define("sgmv_add(Tensor(a!) y, Tensor x, Tensor a, Tensor[] b, int[] offsets, Tensor groups, int num_groups) -> ()")
_LIB.define("bgmv_add(Tensor(a!) y, Tensor x, Tensor a, Tensor[] b, int[] offsets, Tensor token_slots) -> ()")
_LIB.impl("sgmv_add", _sgmv_add, "CPU")
_LIB.impl("bgmv_add", native.recordable(_bgmv_add), "CPU")
torch.library.register_fake("loraserve::sgmv_add", lambda y, x, a, b, offsets, groups, n: _check(y, x, a, b, offsets),
                            lib=_LIB)
torch.library.register_fake("loraserve::bgmv_add", lambda y, x, a, b, offsets, slots: _check(y, x, a, b, offsets),
                            lib=_LIB)


class Prepared:
    """One LoRA layer's sgmv call with its fixed operands filled in once: the slot pool's buffers never move,
    so a step sets only x, y and its groups. Eager CPU steps call the kernel through this, not the registered
    op: dispatch, operand checks and argument building cost ~50 us a layer, ~3% of a decode step (traced and
    graph phases keep the op). Built by the cpu backend when a layer is wrapped; None where it cannot run.

    a_shared: int64 [slots] (the slot pool's, updated in place at each load), nonzero where every slice of the
    slot holds slice 0's A: the kernel reads those rows once (cpu_sgmv.c)."""

    def __init__(self, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
                 a_shared: torch.Tensor | None = None):
        lib = _load()
        probe = torch.empty(0, a.shape[2], dtype=a.dtype)
        _check(torch.empty(0, offsets[-1], dtype=a.dtype), probe, a, b, offsets)   # the fixed operands, once
        if a_shared is not None and not (a_shared.dtype == torch.int64 and a_shared.shape == (a.shape[0],)
                                         and a_shared.is_contiguous() and a_shared.device.type == "cpu"):
            raise ValueError(f"a_shared must be a contiguous int64 CPU tensor of the {a.shape[0]} slots")
        self._a_shared = a_shared   # outlives the pointer below
        self.dtype, self.in_dim, self.width, stack = a.dtype, a.shape[2], offsets[-1], len(b)
        self._a, self._b = a, tuple(b)   # the buffers must outlive the pointers below
        self._slices = (ctypes.c_int64 * (3 * stack))(*[b_s.data_ptr() for b_s in b], *[b_s.shape[1] for b_s in b],
                                                      *offsets[:-1])
        base = ctypes.addressof(self._slices)
        self._args = _Args(0, 0, a.shape[2], a.data_ptr(), a.stride(0), stack, b[0].shape[2], base, base + 8 * stack,
                           base + 16 * stack, 0, 0, 0, 0, 0, 0, 0, a.shape[0], 0,
                           a_shared.data_ptr() if a_shared is not None else 0)
        self._address = ctypes.addressof(self._args)
        self._fn = getattr(lib, _SYMBOLS[a.dtype][0])

    @property
    def args(self) -> _Args:
        """The fixed operands (x, y and the groups unset), for a kernel that embeds this layer's LoRA
        (workers/models/moe_fused.py); this object must outlive their copy."""
        return self._args

    def run(self, y: torch.Tensor, x: torch.Tensor, groups) -> None:
        """y += the kernel groups' deltas (lora.batch.KernelGroups)."""
        T = x.shape[0]
        if not (x.dtype == y.dtype == self.dtype and x.dim() == y.dim() == 2 and x.stride(1) == 1
                and y.stride(1) == 1 and x.shape[1] == self.in_dim and y.shape[0] == T and y.shape[1] >= self.width
                and x.device.type == y.device.type == "cpu"):
            raise ValueError(f"the CPU LoRA kernel does not take x {tuple(x.shape)} {x.dtype} / y {tuple(y.shape)} "
                             f"{y.dtype} for this layer ({self.dtype}, in {self.in_dim}, out {self.width})")
        G, ptr, n = groups.num_groups, groups.packed.data_ptr(), groups.packed.numel()
        args = self._args
        args.x, args.x_stride, args.y, args.y_stride = x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0)
        args.group_slot, args.group_rank, args.group_start = ptr, ptr + 8 * G, ptr + 16 * G
        args.rows, args.num_rows, args.num_indices = ptr + 8 * (3 * G + 1), T, n - 3 * G - 1
        status = self._fn(self._address, G)
        if status == OUT_OF_MEMORY:
            raise MemoryError("CPU LoRA kernel: out of memory for its scratch buffers")
        if status != 0:
            raise ValueError("LoRA groups index past the batch, the slots or the rank")


def prepare(a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
            a_shared: torch.Tensor | None = None) -> Prepared | None:
    if not (available() and supports(torch.empty(0, dtype=a.dtype), torch.empty(0, dtype=a.dtype), a, b)):
        return None
    try:
        return Prepared(a, b, offsets, a_shared)
    except ValueError:   # a layout the kernel does not read: the layer keeps the general path
        return None


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
             info: LoRABatchInfo, prepared: Prepared | None = None) -> None:
    """The eager phases: the plan's adapters with few tokens in one kernel call (the layer's `prepared`
    call when it has one), the others (info.plan.gemm) by torch's GEMMs. Operands the kernel does not
    read are refused (the cpu backend binds such layers to the torch ops)."""
    for group in info.plan.gemm:
        ops.add_lora_rows(y, x, a[group.slot], [b_s[group.slot] for b_s in b], offsets, group.rows)
    kernel = info.plan.kernel
    if kernel is None:
        return
    if prepared is not None:
        prepared.run(y, x, kernel)
    else:
        torch.ops.loraserve.sgmv_add(y, x, a, b, offsets, kernel.packed, kernel.num_groups)


def add_lora_by_token(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                      offsets: Sequence[int], info: LoRABatchInfo) -> None:
    """The graph phase: one kernel call reading info.token_slots (graph-safe: an op with a fake)."""
    torch.ops.loraserve.bgmv_add(y, x, a, b, offsets, info.token_slots)


# ---- the backend ------------------------------------------------------------------------------------------
# Eager phases: the step's adapters with few tokens in one kernel call per layer (each reads its
# adapter's weights once, where torch runs a small GEMM per adapter and slice at ~10 us of dispatch
# each), adapters with many tokens by torch's GEMMs; the graph phase: the kernel's per-token entry,
# a registered op with a fake (traceable, reads only the static slot buffer).

# An adapter with this many tokens in the step (a prompt, say) goes to torch's GEMMs on CPU:
# blocked and multi-threaded, they beat the C kernel there (1024 tokens of one adapter: 2.8
# against 8.7 ms a layer); with fewer, the kernel wins (32 decode tokens: ~60 against ~130 us).
GEMM_MIN_TOKENS = 64


class CpuBackend(LoRABackend):
    name = "cpu"
    plan_split = GEMM_MIN_TOKENS

    def bind(self, layer: str, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
             a_shared: torch.Tensor | None = None) -> LayerLoRA:
        if not supports(torch.empty(0, dtype=self.dtype), torch.empty(0, dtype=self.dtype), a, b):
            self.fallback(layer, f"the C kernel has no {self.dtype} code")
            return torch_ops(a, b, offsets)
        prepared = prepare(a, b, offsets, a_shared)
        if prepared is None:
            self.fallback(layer, "the C kernel does not read this buffer layout")
            return torch_ops(a, b, offsets)

        def eager(y, x, info):
            add_lora(y, x, a, b, offsets, info, prepared)

        def graph(y, x, info):
            add_lora_by_token(y, x, a, b, offsets, info)

        return LayerLoRA(eager, eager, graph)
