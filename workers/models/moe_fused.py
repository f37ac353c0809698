"""A MoE block's routing and its decode-sized expert work in one call each on the CPU: cpu_moe_fused.c as torch ops.

    loraserve::moe_route(logits, top_k, normalize, valid=None) -> (weight, token, expert, offsets)
        HF's router after its linear (fp32 softmax, top-k, renormalised if asked, cast back; equal probabilities
        to the lower expert id) and the (token, choice) rows sorted by expert, stable, with offsets [E + 1] their
        cumulative counts: group_rows' grouped form (workers/models/moe_experts.py) in one pass. `valid` (int64
        [1], a captured decode's count of real rows) leaves the padded tokens without rows: offsets[E] is then
        valid * top_k, and moe_experts gives those tokens zeros (a padded row would stream up to top_k experts
        that no real token uses).
    loraserve::moe_experts(x, w13, w2, offsets, token, weight) -> out [T, H]
        every active expert's gathered rows through gate_up, SiLU-and-mul and down (cpu_moe.c's vector block),
        then each token's rows weighted and summed: MoeExperts.forward in one call, its bits (cpu_moe_fused.c);
        the rows are offsets[E].
    loraserve::moe_experts_lora(x, w13, w2, offsets, token, weight, token_slots, slot_map, ranks, lora, gate_up,
                                down) -> out [T, H]
        moe_experts with each row's expert LoRA added right after its gate_up and down by the CPU LoRA kernel's
        code (lora/sgmv.h): a decode step with expert adapters in one call, the separate calls' bits. Each token's
        LoRA slot goes through slot_map (the slot pool's slot -> expert slot) at the call, so a captured decode
        replays it on its static slot buffer.
    loraserve::moe_combine(y, token, weight, tokens) -> out [T, H]
        MoeExperts.combine (index_add_ of the weighted rows, rows ascending), for the paths that keep the
        projections apart (prefill on the AMX kernel).

Why (benchmarks/results/moe_fused.md): each small op between a layer's expert-weight streams runs on cold caches; a decode
layer was ~9 such calls. Where it applies: the CPU, bf16 / fp32, the grouped kernel on (cpu_moe.applies), and
for moe_experts the decode shapes the vector kernel runs (up to cpu_moe.KERNEL_ROWS_PER_EXPERT rows per expert on
average; more go to the AMX / grouped_mm projections). LORASERVE_MOE_FUSED=0 turns it off (A/B measurement).
Fixed shapes, nothing read back: a CPU decode graph replays moe_route, moe_experts and moe_experts_lora as their
kernel calls (workers/cpu_graph.py; they are `native.recordable`), a tape (workers/tape_graph.py) each as one op.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import weakref
from pathlib import Path

import torch

from lora import native
from lora.backends import cpu_sgmv
from workers.models import cpu_moe

SOURCE = Path(__file__).with_name("cpu_moe_fused.c")
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_P, _I = ctypes.c_void_p, ctypes.c_int64
OUT_OF_MEMORY, OUT_OF_RANGE, BAD_SLOT = 1, 2, 3   # the kernels' nonzero returns (moe_gemm.h, cpu_moe_fused.c)
ENABLED = os.environ.get("LORASERVE_MOE_FUSED", "1") != "0"

_load, available = native.library(
    SOURCE, {f"{op}_{suffix}": types for op, types in (("moe_route", [_P]), ("moe_experts", [_P]),
                                                       ("moe_combine", [_P, _P, _P, _I, _I, _I, _P]))
             for suffix in _SUFFIX.values()})


class _RouteArgs(ctypes.Structure):
    """route_args of cpu_moe_fused.c, field for field."""
    _fields_ = [("logits", _P), ("tokens", _I), ("num_experts", _I), ("top_k", _I), ("normalize", _I),
                ("weight", _P), ("token", _P), ("expert", _P), ("offsets", _P), ("valid", _P)]


class _ExpertsArgs(ctypes.Structure):
    """experts_args of cpu_moe_fused.c, field for field."""
    _fields_ = [("x", _P), ("x_stride", _I), ("tokens", _I), ("hidden", _I), ("inter", _I), ("num_experts", _I),
                ("w13", _P), ("w2", _P), ("offsets", _P), ("token", _P), ("weight", _P), ("num_rows", _I),
                ("rows_out", _P), ("out", _P), ("lora", _P)]


class _ExpertLoRAArgs(ctypes.Structure):
    """experts_lora of cpu_moe_fused.c, field for field."""
    _fields_ = [("token_slot", _P), ("rank", _P), ("num_expert_slots", _I), ("gate_up", cpu_sgmv._Args),
                ("down", cpu_sgmv._Args), ("slot_map", _P), ("num_slots", _I)]


def applies(x: torch.Tensor) -> bool:
    """Whether these kernels take x (and the grouped kernel runs the experts: the same weights and switch)."""
    return ENABLED and x.dtype in _SUFFIX and cpu_moe.applies(x, x) and available()


def _status(status: int, op: str) -> None:
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"{op}: out of memory for its scratch")
    if status == BAD_SLOT:
        raise ValueError(f"{op}: a token's LoRA slot is past the slot map, or its expert slot past the expert slots")
    if status != 0:
        raise ValueError(f"{op}: offsets must rise from 0 to the row count and each row's token be one of x's")


# ---- routing --------------------------------------------------------------------------------------------------
def _route_check(logits: torch.Tensor, top_k: int, valid: torch.Tensor | None) -> None:
    if logits.dim() != 2 or not logits.is_contiguous() or logits.dtype not in _SUFFIX \
            or not 1 <= top_k <= logits.shape[1] or not (valid is None or (valid.dtype == torch.int64
                                                                           and valid.numel() == 1)):
        raise ValueError(f"moe_route: logits {tuple(logits.shape)} {logits.dtype}, top_k {top_k}, valid "
                         f"{None if valid is None else (tuple(valid.shape), valid.dtype)} (it needs contiguous bf16 / "
                         "fp32 logits [tokens, experts], 1 <= top_k <= experts, an int64 count of real tokens or "
                         "none)")


def _route_impl(logits, top_k: int, normalize: bool, valid: torch.Tensor | None = None):
    _route_check(logits, top_k, valid)
    T, E = logits.shape
    weight = torch.empty(T * top_k, dtype=logits.dtype)
    token, expert = torch.empty(T * top_k, dtype=torch.int64), torch.empty(T * top_k, dtype=torch.int64)
    offsets = torch.empty(E + 1, dtype=torch.int64)
    args = _RouteArgs(logits.data_ptr(), T, E, top_k, int(normalize), weight.data_ptr(), token.data_ptr(),
                      expert.data_ptr(), offsets.data_ptr(), None if valid is None else valid.data_ptr())
    native.call(getattr(_load(), f"moe_route_{_SUFFIX[logits.dtype]}"), args, lambda s: _status(s, "moe_route"))
    return weight, token, expert, offsets


def route(logits: torch.Tensor, top_k: int, normalize: bool, valid: torch.Tensor | None = None):
    """(weight, token, expert, offsets) of the rows sorted by expert (see the module docstring)."""
    if native.eager():
        return _route_impl(logits, top_k, normalize, valid)
    return torch.ops.loraserve.moe_route(logits, top_k, normalize, valid)


# ---- the experts, whole -----------------------------------------------------------------------------------------
def _experts_check(x, w13, w2, offsets, token, weight) -> None:
    E = w13.shape[0] if w13.dim() == 3 else -1
    ok = (x.dim() == 2 and x.stride(1) == 1 and w13.dim() == 3 and w2.dim() == 3 and w13.is_contiguous()
          and w2.is_contiguous() and x.dtype == w13.dtype == w2.dtype == weight.dtype and x.dtype in _SUFFIX
          and w13.shape[2] == x.shape[1] and w13.shape[1] % 2 == 0
          and w2.shape == (E, x.shape[1], w13.shape[1] // 2) and offsets.shape == (E + 1,)
          and offsets.dtype == token.dtype == torch.int64 and token.dim() == 1 and weight.shape == token.shape
          and offsets.is_contiguous() and token.is_contiguous() and weight.is_contiguous())
    if not ok:
        raise ValueError(f"moe_experts: x {tuple(x.shape)} {x.dtype}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
                         f"{w2.dtype}, offsets {tuple(offsets.shape)}, rows {tuple(token.shape)} (it needs w13 [E, 2I, "
                         "H] and w2 [E, H, I] contiguous in x's dtype, int64 offsets [E + 1] and tokens, a weight "
                         "per row)")


def _experts_impl(x, w13, w2, offsets, token, weight, lora: _ExpertLoRAArgs | None = None):
    _experts_check(x, w13, w2, offsets, token, weight)
    T, H = x.shape
    out = torch.empty(T, H, dtype=x.dtype)
    rows_out = torch.empty(token.shape[0], H, dtype=x.dtype)
    args = _ExpertsArgs(x.data_ptr(), x.stride(0), T, H, w13.shape[1] // 2, w13.shape[0], w13.data_ptr(),
                        w2.data_ptr(), offsets.data_ptr(), token.data_ptr(), weight.data_ptr(), token.shape[0],
                        rows_out.data_ptr(), out.data_ptr(), ctypes.addressof(lora) if lora is not None else 0)
    args.keep = lora   # the LoRA operands' struct lives as long as a recorded call
    native.call(getattr(_load(), f"moe_experts_{_SUFFIX[x.dtype]}"), args, lambda s: _status(s, "moe_experts"))
    return out


def fits(x: torch.Tensor, w13: torch.Tensor, rows: int) -> bool:
    """Whether moe_experts runs this step: decode-sized (the vector kernel's rows per expert), in the kernel's reach."""
    return rows <= cpu_moe.KERNEL_ROWS_PER_EXPERT * w13.shape[0] and applies(x) and w13.dtype == x.dtype


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor, token: torch.Tensor,
            weight: torch.Tensor) -> torch.Tensor:
    """The block's (partial) output [T, H] for its sorted rows (see the module docstring)."""
    if native.eager():
        return _experts_impl(x, w13, w2, offsets, token, weight)
    return torch.ops.loraserve.moe_experts(x, w13, w2, offsets, token, weight)


# ---- the experts with their LoRA ---------------------------------------------------------------------------------
class ExpertLoRA:
    """One MoE layer's expert LoRA buffers (the slot pool's: lora/slots.py, never moved) as moe_experts reads them:
    each projection's LoRA computed by the CPU LoRA kernel's code (lora/sgmv.h) inside the block, the same bits as
    its separate calls. Known to the op `moe_experts_lora` by its id (an op's schema takes no struct).

    gate_up, down: (a, b slices, offsets, a_shared) of the projection's expert buffers, None where it has none."""

    def __init__(self, gate_up: tuple | None, down: tuple | None, num_experts: int):
        self.prepared = {name: cpu_sgmv.Prepared(*pair) for name, pair in (("gate_up", gate_up), ("down", down))
                         if pair is not None}   # outlive the copies of their operands below
        ranks = {p.args.R for p in self.prepared.values()}
        slots = {pair[0].shape[0] for pair in (gate_up, down) if pair is not None}
        if len(ranks) != 1 or len(slots) != 1 or next(iter(slots)) % num_experts:
            raise ValueError(f"expert LoRA buffers of ranks {ranks} and slots {slots} for {num_experts} experts")
        self.dtype = next(iter(self.prepared.values())).dtype
        self.num_expert_slots = next(iter(slots)) // num_experts
        self.id = next(_ids)
        _EXPERT_LORAS[self.id] = self

    def bind(self, token_slots: torch.Tensor, slot_map: torch.Tensor, ranks: torch.Tensor, gate_up: bool,
             down: bool) -> _ExpertLoRAArgs:
        """A fresh argument struct for one call (a recorded call keeps its own): each token's LoRA slot (-1: none),
        each LoRA slot's expert slot (-1: none), each expert slot's rank, and which projections take their LoRA.
        Their values are checked by the kernel, at the call."""
        vectors = (token_slots, slot_map, ranks)
        if not all(t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous() for t in vectors) \
                or ranks.shape != (self.num_expert_slots,):
            raise ValueError(f"expert LoRA: token slots {tuple(token_slots.shape)} {token_slots.dtype}, slot map "
                             f"{tuple(slot_map.shape)} {slot_map.dtype}, ranks {tuple(ranks.shape)} {ranks.dtype} "
                             f"(int64, one rank per each of the {self.num_expert_slots} expert slots)")
        operands = {name: prepared.args for name, prepared in self.prepared.items()
                    if (gate_up if name == "gate_up" else down)}
        return _ExpertLoRAArgs(token_slots.data_ptr(), ranks.data_ptr(), self.num_expert_slots,
                               operands.get("gate_up", cpu_sgmv._Args()), operands.get("down", cpu_sgmv._Args()),
                               slot_map.data_ptr(), slot_map.shape[0])


_ids = itertools.count()
_EXPERT_LORAS: weakref.WeakValueDictionary[int, ExpertLoRA] = weakref.WeakValueDictionary()


def expert_lora(gate_up: tuple | None, down: tuple | None, num_experts: int) -> ExpertLoRA | None:
    """ExpertLoRA of these buffers, None where the kernels are not built (this one and the LoRA kernel's) or do not
    take the buffers."""
    if not (available() and cpu_sgmv.available()):
        return None
    try:
        return ExpertLoRA(gate_up, down, num_experts)
    except ValueError:
        return None


def _experts_lora_impl(x, w13, w2, offsets, token, weight, token_slots, slot_map, ranks, lora: int, gate_up: bool,
                       down: bool):
    expert_lora = _EXPERT_LORAS[lora]
    if token_slots.shape != (x.shape[0],) or x.dtype != expert_lora.dtype:
        raise ValueError(f"expert LoRA: {tuple(token_slots.shape)} token slots for x {tuple(x.shape)} {x.dtype} "
                         f"(one per token; the buffers are {expert_lora.dtype})")
    return _experts_impl(x, w13, w2, offsets, token, weight, expert_lora.bind(token_slots, slot_map, ranks, gate_up,
                                                                              down))


def experts_lora(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor, token: torch.Tensor,
                 weight: torch.Tensor, lora: ExpertLoRA, token_slots: torch.Tensor, slot_map: torch.Tensor,
                 ranks: torch.Tensor, gate_up: bool = True, down: bool = True) -> torch.Tensor:
    """`experts` with each row's expert LoRA added after its projections (ExpertLoRA.bind's arguments); a CPU decode
    graph replays it as its kernel call, reading the slots as they are at each replay."""
    if native.eager():
        return _experts_lora_impl(x, w13, w2, offsets, token, weight, token_slots, slot_map, ranks, lora.id, gate_up,
                                  down)
    return torch.ops.loraserve.moe_experts_lora(x, w13, w2, offsets, token, weight, token_slots, slot_map, ranks,
                                                lora.id, gate_up, down)


# ---- the combine alone ------------------------------------------------------------------------------------------
def _combine_impl(y, token, weight, tokens: int):
    if not (y.dim() == 2 and y.is_contiguous() and y.dtype == weight.dtype and y.dtype in _SUFFIX
            and token.shape == weight.shape == (y.shape[0],) and token.dtype == torch.int64
            and token.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"moe_combine: y {tuple(y.shape)} {y.dtype}, token {tuple(token.shape)} {token.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}")
    out = torch.empty(tokens, y.shape[1], dtype=y.dtype)
    status = getattr(_load(), f"moe_combine_{_SUFFIX[y.dtype]}")(y.data_ptr(), token.data_ptr(), weight.data_ptr(),
                                                                y.shape[0], tokens, y.shape[1], out.data_ptr())
    _status(status, "moe_combine")
    return out


def combine(y: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, tokens: int) -> torch.Tensor:
    """out [tokens, H]: out[t] = the sum of weight[n] * y[n] over t's rows n, in their order."""
    if native.eager():
        return _combine_impl(y, token, weight, tokens)
    return torch.ops.loraserve.moe_combine(y, token, weight, tokens)


_LIB = torch.library.Library("loraserve", "FRAGMENT")
_LIB.define("moe_route(Tensor logits, int top_k, bool normalize, Tensor? valid=None) -> (Tensor, Tensor, Tensor, "
            "Tensor)")
_LIB.define("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor offsets, Tensor token, Tensor weight) -> Tensor")
_LIB.define("moe_combine(Tensor y, Tensor token, Tensor weight, int tokens) -> Tensor")
_LIB.impl("moe_route", native.recordable(_route_impl), "CPU")
_LIB.impl("moe_experts", native.recordable(_experts_impl), "CPU")
_LIB.define("moe_experts_lora(Tensor x, Tensor w13, Tensor w2, Tensor offsets, Tensor token, Tensor weight, "
            "Tensor token_slots, Tensor slot_map, Tensor ranks, int lora, bool gate_up, bool down) -> Tensor")
_LIB.impl("moe_experts_lora", native.recordable(_experts_lora_impl), "CPU")
_LIB.impl("moe_combine", _combine_impl, "CPU")


@torch.library.register_fake("loraserve::moe_route", lib=_LIB)
def _route_fake(logits, top_k, normalize, valid=None):
    _route_check(logits, top_k, valid)
    n = logits.shape[0] * top_k
    return (logits.new_empty(n), logits.new_empty(n, dtype=torch.int64), logits.new_empty(n, dtype=torch.int64),
            logits.new_empty(logits.shape[1] + 1, dtype=torch.int64))


@torch.library.register_fake("loraserve::moe_experts", lib=_LIB)
def _experts_fake(x, w13, w2, offsets, token, weight):
    _experts_check(x, w13, w2, offsets, token, weight)
    return x.new_empty(x.shape)


@torch.library.register_fake("loraserve::moe_experts_lora", lib=_LIB)
def _experts_lora_fake(x, w13, w2, offsets, token, weight, token_slots, slot_map, ranks, lora, gate_up, down):
    _experts_check(x, w13, w2, offsets, token, weight)
    return x.new_empty(x.shape)


@torch.library.register_fake("loraserve::moe_combine", lib=_LIB)
def _combine_fake(y, token, weight, tokens):
    return y.new_empty(tokens, y.shape[1])
