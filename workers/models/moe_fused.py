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
    loraserve::moe_combine(y, token, weight, tokens) -> out [T, H]
        MoeExperts.combine (index_add_ of the weighted rows, rows ascending), for the paths that keep the
        projections apart (prefill on the AMX kernel, a captured decode's expert LoRA between them).
    experts_lora(..., ExpertLoRA, token_slot, ranks): moe_experts with each row's expert LoRA added right after its
        gate_up and down by the CPU LoRA kernel's code (lora/sgmv.h): an eager decode step with expert adapters in
        one call, the separate calls' bits (a direct call, not an op: eager only).

Why (benchmarks/results/moe_fused.md): each small op between a layer's expert-weight streams runs on cold caches; a decode
layer was ~9 such calls. Where it applies: the CPU, bf16 / fp32, the grouped kernel on (cpu_moe.applies), and
for moe_experts the decode shapes the vector kernel runs (up to cpu_moe.KERNEL_ROWS_PER_EXPERT rows per expert on
average; more go to the AMX / grouped_mm projections). LORASERVE_MOE_FUSED=0 turns it off (A/B measurement).
Fixed shapes, nothing read back: a CPU decode graph replays moe_route and moe_experts as their kernel calls
(workers/cpu_graph.py; both are `native.recordable`), a tape (workers/tape_graph.py) each as one op.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from lora import native
from lora.backends import cpu_sgmv
from workers.models import cpu_moe

SOURCE = Path(__file__).with_name("cpu_moe_fused.c")
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_P, _I = ctypes.c_void_p, ctypes.c_int64
OUT_OF_MEMORY, OUT_OF_RANGE = 1, 2   # the kernels' nonzero returns (moe_gemm.h)
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
                ("down", cpu_sgmv._Args)]


def applies(x: torch.Tensor) -> bool:
    """Whether these kernels take x (and the grouped kernel runs the experts: the same weights and switch)."""
    return ENABLED and x.dtype in _SUFFIX and cpu_moe.applies(x, x) and available()


def _status(status: int, op: str) -> None:
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"{op}: out of memory for its scratch")
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
    its separate calls. Eager steps only (a captured decode keeps the separate, graph-safe calls).

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
        self.args = _ExpertLoRAArgs(0, 0, self.num_expert_slots)
        self.a = {}
        for name, prepared in self.prepared.items():
            setattr(self.args, name, prepared.args)
            self.a[name] = prepared.args.a

    def bind(self, token_slot: torch.Tensor, ranks: torch.Tensor, gate_up: bool, down: bool) -> _ExpertLoRAArgs:
        """The arguments for one call: each token's expert slot (-1: none), each expert slot's rank, and which
        projections take their LoRA this step (the tensors must live through the call)."""
        if not (token_slot.dtype == ranks.dtype == torch.int64 and token_slot.dim() == 1 and token_slot.is_contiguous()
                and ranks.shape == (self.num_expert_slots,) and ranks.is_contiguous()):
            raise ValueError(f"expert LoRA: token slots {tuple(token_slot.shape)} {token_slot.dtype}, ranks "
                             f"{tuple(ranks.shape)} {ranks.dtype} (int64, one rank per each of the "
                             f"{self.num_expert_slots} expert slots)")
        if token_slot.numel() and int(token_slot.max()) >= self.num_expert_slots:
            raise ValueError(f"expert LoRA: a token's expert slot {int(token_slot.max())} is past the "
                             f"{self.num_expert_slots} expert slots")
        self.args.token_slot, self.args.rank = token_slot.data_ptr(), ranks.data_ptr()
        self.args.gate_up.a = self.a["gate_up"] if gate_up and "gate_up" in self.a else 0
        self.args.down.a = self.a["down"] if down and "down" in self.a else 0
        return self.args


def expert_lora(gate_up: tuple | None, down: tuple | None, num_experts: int) -> ExpertLoRA | None:
    """ExpertLoRA of these buffers, None where the kernels are not built (this one and the LoRA kernel's) or do not
    take the buffers."""
    if not (available() and cpu_sgmv.available()):
        return None
    try:
        return ExpertLoRA(gate_up, down, num_experts)
    except ValueError:
        return None


def experts_lora(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor, token: torch.Tensor,
                 weight: torch.Tensor, lora: ExpertLoRA, token_slot: torch.Tensor, ranks: torch.Tensor,
                 gate_up: bool = True, down: bool = True) -> torch.Tensor:
    """`experts` with each row's expert LoRA added after its projections (ExpertLoRA.bind's arguments)."""
    if token_slot.shape != (x.shape[0],) or x.dtype != lora.dtype:
        raise ValueError(f"expert LoRA: {tuple(token_slot.shape)} token slots for x {tuple(x.shape)} {x.dtype} "
                         f"(one per token; the buffers are {lora.dtype})")
    return _experts_impl(x, w13, w2, offsets, token, weight, lora.bind(token_slot, ranks, gate_up, down))


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


@torch.library.register_fake("loraserve::moe_combine", lib=_LIB)
def _combine_fake(y, token, weight, tokens):
    return y.new_empty(tokens, y.shape[1])
