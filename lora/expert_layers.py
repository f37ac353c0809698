"""LoRA on the experts of a mixture-of-experts block (Qwen3-MoE), through the ordinary LoRA ops.

The block computes its experts on (token, choice) rows. Row n belongs to token t = rows.token[n] and
expert e = rows.expert[n]; with m the expert slot of the token's adapter (the slot pool's
expert_slot_of[slot]; -1 for the base and for adapters without expert weights), its LoRA pair is
block m*E + e of the expert buffers (lora/slots.py), the one combined (slot, expert) index per row
that vllm-ascend gives its bgmv kernels. So the rows get a LoRA batch info over combined indices, built
by the runner's backend like any other (eager: the step's rows grouped by index; graph: the index per
row computed on the device), and each projection's LoRA is a plain stacked layer op bound once by the
backend:

    gate_up[n] += x[n] @ A13[m*E + e].T @ B13[m*E + e].T    (gate and up slices, A replicated)
    down[n]    += act[n] @ A2[m*E + e].T @ B2[m*E + e].T     (A cut on the input columns, B replicated)

before the block's one all-reduce, as for the row-parallel linears. Each delta is added right after its projection,
on the block's own rows (on the CPU sorted by expert for the grouped GEMM, workers/models/cpu_moe.py; the rows'
order does not matter to the ops, which read each row's combined index). Duck-typed against
workers/models/moe_experts.py's MoeExperts (`gather`, `gate_up`, `act`, `down`, `combine`).
"""
from __future__ import annotations

import torch
from torch import nn

from lora.backends.base import LayerLoRA, LoRABackend
from lora.batch import LoRABatchInfo
from lora.modules import EXPERT_GROUPS


class MoeExpertsLoRA(nn.Module):
    """The experts with each row's adapter delta added to its gate/up and down outputs."""

    def __init__(self, base: nn.Module, gate_up: LayerLoRA | None, down: LayerLoRA | None, backend: LoRABackend,
                 pool, fused=None):
        super().__init__()
        self.base, self.gate_up_op, self.down_op = base, gate_up, down
        self.fused = fused   # the buffers as the base's fused block reads them (CPU backend), or None
        self.backend, self.expert_ranks = backend, pool.expert_ranks   # by expert slot, updated in place by loads
        self.expert_slot_of, self.expert_slot_of_device = pool.expert_slot_of, pool.expert_slot_of_device

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)

    def row_info(self, rows, lora: LoRABatchInfo | None) -> LoRABatchInfo | None:
        """The rows' LoRA batch info over combined (slot, expert) indices; None when no row has an adapter
        or no adapter of the step targets the experts (lora.groups)."""
        if not self._computes(lora):
            return None
        E = self.base.num_experts
        if lora.use_graph:   # on the device, fixed shapes: an index per row, -1 for base rows
            token_slots = lora.token_slots[rows.token]
            slots = self.expert_slot_of_device[token_slots.clamp(min=0).long()]
            slots = torch.where(token_slots >= 0, slots, -1)
            # in the index dtype the backend gave the token slots (the Ascend contract's)
            combined = torch.where(slots >= 0, slots * E + rows.expert, -1).to(token_slots.dtype)
            return self.backend.graph_info(combined)
        slots = self.token_expert_slots(lora)[rows.token.cpu()]
        combined = torch.where(slots >= 0, slots * E + rows.expert.cpu(), -1)
        ranks = self.expert_ranks.repeat_interleave(E)   # per combined index
        info = self.backend.row_batch_info(combined, ranks, lora.phase)
        return info if info.has_lora else None

    def token_expert_slots(self, lora: LoRABatchInfo) -> torch.Tensor:
        """An eager step's expert slot per token (host int64; -1: the base or an adapter without expert weights)."""
        expert_slot_of = torch.tensor([*self.expert_slot_of, -1])   # token slot -1 (the base) reads the last: -1
        return expert_slot_of[torch.tensor(lora.token_slots_host, dtype=torch.int64)]

    @staticmethod
    def _computes(lora: LoRABatchInfo | None) -> bool:
        return lora is not None and any(lora.computes(group) for group in EXPERT_GROUPS)

    def fuses(self, lora: LoRABatchInfo | None) -> bool:
        """Whether the step runs the base's fused block (without expert LoRA, or with it inside)."""
        return self.fused is not None or not self._computes(lora)

    def forward(self, x: torch.Tensor, rows, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        if self.fused is not None and self._computes(lora):
            # the static slot buffer in a captured decode; the step's slots on the host eagerly
            token_slots = (lora.token_slots if lora.use_graph
                           else torch.tensor(lora.token_slots_host, dtype=torch.int64))
            gate_up = self.gate_up_op is not None and lora.computes("experts_gate_up")
            down = self.down_op is not None and lora.computes("experts_down")
            y = self.base.forward_lora(x, rows, self.fused, token_slots, self.expert_slot_of_device, self.expert_ranks,
                                       gate_up, down)
            if y is not None:   # the block ran in one call, the LoRA inside it
                return y
        info = self.row_info(rows, lora)
        if info is None:
            return self.base(x, rows)
        xs = self.base.gather(x, rows)
        h = self.base.gate_up(xs, rows)
        if self.gate_up_op is not None and lora.computes("experts_gate_up"):
            self.gate_up_op(h, xs, info)
        act = self.base.act(h)
        y = self.base.down(act, rows)
        if self.down_op is not None and lora.computes("experts_down"):
            self.down_op(y, act, info)
        return self.base.combine(y, rows, x.shape[0])


def wrap_experts(model: nn.Module, backend: LoRABackend, pool) -> int:
    """Wrap every MoE block's experts that have expert LoRA buffers in `pool` (lora.slots.SlotPool: its
    buffers, expert ranks and slot -> expert slot map); returns how many were wrapped."""
    wrapped = 0
    for index, layer in enumerate(model.layers):
        gate_up, down = pool.buffers.get((index, "experts_gate_up")), pool.buffers.get((index, "experts_down"))
        if gate_up is None and down is None:
            continue
        base = layer.mlp.experts
        ops, operands = [], []
        for name, pair in (("experts_gate_up", gate_up), ("experts_down", down)):
            if pair is None:
                ops.append(None)
                operands.append(None)
                continue
            a, b = pair
            offsets = [0]
            for b_s in b:
                offsets.append(offsets[-1] + b_s.shape[1])
            a_shared = pool.a_shared.get((index, name))
            ops.append(backend.bind(f"{index}.{name}", a, b, tuple(offsets), a_shared=a_shared))
            operands.append((a, b, tuple(offsets), a_shared))
        # the CPU backend's LoRA kernel also runs inside the base's fused MoE block (the same code, the same bits)
        fused = base.expert_lora(*operands) if backend.name == "cpu" and hasattr(base, "expert_lora") else None
        layer.mlp.experts = MoeExpertsLoRA(base, *ops, backend, pool, fused)
        wrapped += 1
    return wrapped
