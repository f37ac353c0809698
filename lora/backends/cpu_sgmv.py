"""The CPU segmented-LoRA kernel (cpu_sgmv.c), called by ctypes; built by lora/native.py.

Without it (no C compiler, or LORASERVE_CPU_KERNEL=0) `available()` is False and the torch ops
do the work: same results, slower with many adapters per batch.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lora import native
from lora.backends.torch_batched import add_lora_rows
from lora.batch import token_runs

SOURCE = Path(__file__).with_name("cpu_sgmv.c")
_SYMBOLS = {torch.bfloat16: "sgmv_add_bf16", torch.float32: "sgmv_add_f32"}


@functools.cache   # on every layer's call: the lookup must cost nothing
def _load() -> ctypes.CDLL | None:
    return native.load(SOURCE, {name: [ctypes.c_void_p, ctypes.c_int64] for name in _SYMBOLS.values()})


def available() -> bool:
    return _load() is not None


@dataclass(frozen=True)
class Groups:
    """The adapters of a batch as the kernel reads them (the tensors own the memory `ptrs` point into)."""
    num_groups: int
    slot: torch.Tensor      # [G] int64
    rank: torch.Tensor      # [G] int64
    start: torch.Tensor     # [G + 1] int64, into rows
    rows: torch.Tensor      # token rows, grouped by adapter
    bounds: tuple[int, int, int]   # max row + 1, max slot + 1, max rank (0s when empty)

    @functools.cached_property
    def ptrs(self) -> tuple[int, int, int, int]:
        return self.slot.data_ptr(), self.rank.data_ptr(), self.start.data_ptr(), self.rows.data_ptr()


# An adapter with this many tokens in the batch (a prompt, say) goes to torch's GEMMs: blocked and
# multi-threaded, they beat the kernel there (1024 tokens of one adapter: 2.8 against 8.7 ms a
# layer); with fewer, the kernel wins (32 decode tokens of one adapter: ~60 against ~130 us a call).
TORCH_MIN_TOKENS = 64


@dataclass(frozen=True)
class Plan:
    """How a step's LoRA is split: adapters with few tokens to the kernel, the others to torch."""
    kernel: Groups | None
    torch: tuple[tuple[int, slice | torch.Tensor], ...]   # (slot, its rows: one run, or an index)


@functools.lru_cache(maxsize=64)
def plan_groups(seg_lens: tuple[int, ...], seg_slots: tuple[int, ...], slot_ranks: tuple[int, ...],
                max_rank: int) -> Plan:
    few, many = [], []
    for slot, spans in token_runs(seg_lens, seg_slots).items():
        rank = min(slot_ranks[slot] if slot < len(slot_ranks) else max_rank, max_rank)
        if rank <= 0:      # an empty slot adds exactly zero
            continue
        count = sum(hi - lo for lo, hi in spans)
        if count < TORCH_MIN_TOKENS:
            few.append((slot, rank, tuple(t for lo, hi in spans for t in range(lo, hi))))
        elif len(spans) == 1:
            many.append((slot, slice(*spans[0])))
        else:
            many.append((slot, torch.tensor([t for lo, hi in spans for t in range(lo, hi)], dtype=torch.int64)))
    return Plan(groups_for(tuple(few)) if few else None, tuple(many))


@functools.lru_cache(maxsize=64)
def groups_for(runs: tuple[tuple[int, int, tuple[int, ...]], ...]) -> Groups:
    """runs: (slot, rank, token rows) per adapter present."""
    as_i64 = functools.partial(torch.tensor, dtype=torch.int64)
    start = [0]
    for _, _, rows in runs:
        start.append(start[-1] + len(rows))
    rows = [t for _, _, ts in runs for t in ts]
    if any(t < 0 for t in rows) or any(slot < 0 or rank < 0 for slot, rank, _ in runs):
        raise ValueError("LoRA groups: token rows, slots and ranks must be >= 0")
    bounds = (max(rows, default=-1) + 1, max((s for s, _, _ in runs), default=-1) + 1,
              max((r for _, r, _ in runs), default=0))
    return Groups(len(runs), as_i64([s for s, _, _ in runs]), as_i64([r for _, r, _ in runs]), as_i64(start),
                  as_i64(rows), bounds)


class _Args(ctypes.Structure):
    """sgmv_args of cpu_sgmv.c, field for field."""
    _fields_ = [("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64), ("in_dim", ctypes.c_int64),
                ("a", ctypes.c_void_p), ("a_slot_stride", ctypes.c_int64), ("stack", ctypes.c_int64),
                ("R", ctypes.c_int64), ("b", ctypes.POINTER(ctypes.c_void_p)),
                ("out_dims", ctypes.POINTER(ctypes.c_int64)), ("y_offsets", ctypes.POINTER(ctypes.c_int64)),
                ("y", ctypes.c_void_p), ("y_stride", ctypes.c_int64),
                ("group_slot", ctypes.c_void_p), ("group_rank", ctypes.c_void_p), ("group_start", ctypes.c_void_p),
                ("rows", ctypes.c_void_p)]


@dataclass
class _Layer:
    """One LoRA layer's call, checked once: its buffers never move, so only x, y and the groups
    change from call to call (written into `args` in place: a layer's forward is not re-entrant)."""
    fn: object
    dtype: torch.dtype
    num_slots: int
    max_rank: int
    in_dim: int
    out_end: int
    args: _Args
    keep: tuple       # the buffers (so their ids stay theirs) and the ctypes arrays args points into


# Keyed by the buffers' ids, held alive by the entry: looked up on every call of every layer,
# where hashing shapes and addresses cost more than the kernel's smallest calls.
_LAYERS: dict[tuple, _Layer | None] = {}


def _layer(a: torch.Tensor, b: Sequence[torch.Tensor], offsets: tuple[int, ...], max_rank: int) -> _Layer | None:
    """None when these buffers are not a layout the kernel reads (the torch ops take them)."""
    key = (id(a), id(b), offsets, max_rank)
    layer = _LAYERS.get(key, _LAYERS)
    if layer is _LAYERS:
        if len(_LAYERS) >= 4096:
            _LAYERS.clear()
        layer = _LAYERS[key] = _build_layer(a, tuple(b), offsets, max_rank, keep=(a, b))
    return layer


def _build_layer(a: torch.Tensor, b: tuple[torch.Tensor, ...], offsets: tuple[int, ...], max_rank: int,
                 keep: tuple) -> _Layer | None:
    stack, R = len(b), max_rank
    if not (a.device.type == "cpu" and a.dtype in _SYMBOLS and a.dim() == 3 and a.is_contiguous()
            and all(b_s.device.type == "cpu" and b_s.dtype == a.dtype and b_s.is_contiguous() and b_s.dim() == 3
                    for b_s in b)):
        return None
    out_dims = [b_s.shape[1] for b_s in b]
    # Everything the C code indexes is checked here or per call: it trusts its arguments.
    if a.shape[1] != stack * R or any(b_s.shape[0] != a.shape[0] or b_s.shape[2] != R for b_s in b):
        raise ValueError(f"LoRA buffers a {tuple(a.shape)} / b {[tuple(b_s.shape) for b_s in b]} for R={R}")
    if list(offsets[1:]) != [offsets[s] + out_dims[s] for s in range(stack)]:
        raise ValueError(f"offsets {list(offsets)} do not fit out dims {out_dims}")
    arrays = ((ctypes.c_void_p * stack)(*[b_s.data_ptr() for b_s in b]), (ctypes.c_int64 * stack)(*out_dims),
              (ctypes.c_int64 * stack)(*offsets[:-1]))
    args = _Args(0, 0, a.shape[2], a.data_ptr(), a.stride(0), stack, R, *arrays)
    return _Layer(getattr(_load(), _SYMBOLS[a.dtype]), a.dtype, a.shape[0], R, a.shape[2], offsets[-1], args,
                  (*keep, *arrays))


def _usable(a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int], max_rank: int, x: torch.Tensor,
            y: torch.Tensor) -> _Layer | None:
    layer = _layer(a, b, tuple(offsets), max_rank)
    if (layer is None or x.dtype != layer.dtype or y.dtype != layer.dtype or x.dim() != 2 or y.dim() != 2
            or x.shape[1] != layer.in_dim or x.stride(1) != 1 or y.stride(1) != 1 or x.device.type != "cpu"
            or y.device.type != "cpu"):
        return None
    if layer.out_end > y.shape[1]:
        raise ValueError(f"offsets {list(offsets)} do not fit y {tuple(y.shape)}")
    return layer


def _run(layer: _Layer, x: torch.Tensor, y: torch.Tensor, groups: Groups) -> None:
    rows_end, slots_end, rank = groups.bounds
    if rows_end > x.shape[0] or rows_end > y.shape[0] or slots_end > layer.num_slots or rank > layer.max_rank:
        raise ValueError("LoRA groups index past the batch, the slots or the rank")
    args = layer.args
    args.x, args.x_stride, args.y, args.y_stride = x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0)
    args.group_slot, args.group_rank, args.group_start, args.rows = groups.ptrs
    if layer.fn(ctypes.addressof(args), groups.num_groups) != 0:
        raise MemoryError("CPU LoRA kernel: out of memory for its scratch buffers")


def sgmv_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
             offsets: Sequence[int], groups: Groups, max_rank: int) -> bool:
    """y[t, offsets[s]:offsets[s+1]] += x[t] @ a[l, s*R:(s+1)*R].T @ b[s][l].T for each group's rows t, slot l.

    False (nothing done) when the operands are not a layout the kernel reads.
    """
    assert available(), "call available() first"
    layer = _usable(a, b, offsets, max_rank, x, y)
    if layer is None:
        return False
    _run(layer, x, y, groups)
    return True


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
             info) -> bool:
    """The backend's entry: True when this layer's LoRA is done (kernel and, for adapters with many
    tokens, torch GEMMs), False when the kernel does not take these operands (use the torch ops)."""
    if not available():
        return False
    plan = info.memo.get("cpu_sgmv")
    if plan is None:   # once per step, not per layer
        plan = info.memo["cpu_sgmv"] = plan_groups(info.seg_lens_host, info.seg_slots_host,
                                                   info.slot_ranks_host, info.max_rank)
    layer = _usable(a, b, offsets, info.max_rank, x, y)
    if layer is None:
        return False
    for slot, rows in plan.torch:
        add_lora_rows(y, x, a[slot], [b_s[slot] for b_s in b], offsets, rows, info.max_rank)
    if plan.kernel is not None:
        _run(layer, x, y, plan.kernel)
    return True
