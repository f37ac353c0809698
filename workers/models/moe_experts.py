"""The experts of a sparse MoE block: their weights and the GEMMs over the (token, choice) rows routed to them.

Apart from workers/models/qwen3_moe.py because this is how experts run, not what the architecture is: the
same rows, weights and grouped GEMMs serve any top-k MoE block, and the NPU's kernels
(workers/models/moe_kernels.py) and expert LoRA (lora/expert_layers.py) build on them.

Experts run on the (token, choice) rows grouped by expert. On the CPU (bf16 / fp32) one grouped GEMM per
projection (workers/models/cpu_moe.py) runs every routed expert over its rows, sorted by expert with the
cumulative counts computed on the device: eager steps and a captured decode run the same calls, nothing
read back; the routing and, at decode sizes without expert LoRA, the whole block (gather to weighted sum) are
one C call each (workers/models/moe_fused.py). Otherwise (no C compiler, LORASERVE_MOE_KERNEL=0, other dtypes or devices) one GEMM per active
expert and projection (eager), or, in a captured decode where nothing may read back to the host, a fixed
loop over every expert keeping each row's own (graph-safe). Tensor parallel: every rank holds every expert,
cut along the expert intermediate dimension (gate/up rows, down columns).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lora import native
from workers.models import cpu_moe, moe_fused
from workers.models.llama import MLP
from workers.parallel import PACK_BATCH_HINT, TPGroup, _divide, _narrow, linear


def num_experts(cfg) -> int:
    return getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)


@dataclass(frozen=True)
class ExpertRows:
    """The block's (token, choice) rows and where each expert's are.

    Eager: rows sorted by expert (stable: by token within one), `expert_runs` lists (expert, start, end)
    of the active experts (read back once per layer).
    Grouped (CPU kernel): rows sorted by expert on the device, `offsets` [E + 1] their cumulative counts
    (device side), `expert_runs` None: one cpu_moe.grouped_gemm per projection, eager or graph-safe.
    Graph-safe: rows in (token, choice) order, `expert_runs` is None and each expert's rows are
    found by mask on the device.
    NPU kernels: rows sorted by expert on the device; `dispatch` holds what the routing op returned
    (the gathered rows, the per-expert counts the grouped GEMMs read), `expert_runs` is None."""
    token: torch.Tensor            # [N] the token each row belongs to
    expert: torch.Tensor           # [N]
    weight: torch.Tensor           # [N] routing weight, the model's dtype
    expert_runs: tuple[tuple[int, int, int], ...] | None
    dispatch: object | None = None   # workers.models.moe_kernels.Dispatch
    offsets: torch.Tensor | None = None   # grouped: [E + 1] int64 cumulative rows per expert


class GroupedLinear(nn.Module):
    """Per-expert linear on grouped rows: y[n] = x[n] @ W[expert[n]].T; W [E, out, in], this rank's cut.

    column (gate_up): the gate and up rows of this rank, stacked; row (down): this rank's input columns."""

    def __init__(self, experts: int, in_features: int, out_features: int, tp: TPGroup, parallel: str):
        super().__init__()
        self.tp, self.parallel = tp, parallel
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features), requires_grad=False)
        self.packed: nn.ParameterList | None = None   # per expert, oneDNN's layout (CPU): `prepack`
        self._experts: list[torch.Tensor] = []          # each expert's weight, as a list: the loops index it
        self.loaded: set = set()   # (expert, slice) pieces read from a per-expert checkpoint, or "fused"

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard) -> None:
        """shard: (expert, 0 gate | 1 up | 0 down) for a per-expert 2-D key, None for a fused [E, ...] key."""
        if self.parallel == "row":
            n = self.in_features
            start = self.tp.rank * n
            if shard is None:
                param.data.copy_(tensor_slice[:, :, start:start + n])
            else:
                param.data[shard[0]].copy_(_narrow(tensor_slice, 1, start, n))
        else:
            n = self.out_features // 2
            start = self.tp.rank * n
            if shard is None:   # fused gate_up [E, 2I, H]: gate rows first, then up rows
                full = n * self.tp.size
                param.data[:, :n].copy_(tensor_slice[:, start:start + n])
                param.data[:, n:].copy_(tensor_slice[:, full + start:full + start + n])
            else:
                expert, which = shard
                param.data[expert, which * n:(which + 1) * n].copy_(_narrow(tensor_slice, 0, start, n))
        self.loaded.add("fused" if shard is None else shard)

    @property
    def num_experts(self) -> int:
        return len(self.packed) if self.packed is not None else self.weight.shape[0]

    def prepack(self, batch_hint: int = PACK_BATCH_HINT) -> bool:
        """Each expert's weight reordered once into oneDNN's blocked layout (CPU), as prepack_linears does for the
        dense linears: unpacked, a bf16 GEMM of a few rows re-lays the weight out each call (~3x slower here).
        The [E, out, in] weight is dropped. Not where the grouped kernel runs the experts: it reads [E, out, in],
        which is moved to huge pages instead (lora.native.huge_page_copy)."""
        if cpu_moe.applies(self.weight, self.weight):
            self.weight = nn.Parameter(native.huge_page_copy(self.weight.detach()), requires_grad=False)
            return False
        if self.weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        self.packed = nn.ParameterList(
            nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch_hint), requires_grad=False)
            for w in self.weight.detach())
        del self.weight
        return True

    def expert_weights(self) -> list[torch.Tensor]:
        if not self._experts:   # after loading (and packing): the parameters never move again
            self._experts = list(self.packed) if self.packed is not None else list(self.weight.unbind(0))
        return self._experts

    @property
    def out_sizes(self) -> list[int]:
        """This rank's output features per stacked slice (gate, up), as ColumnParallelLinear's."""
        return [self.out_features // 2] * 2 if self.parallel == "column" else [self.out_features]

    def shard_range(self, shard: int) -> tuple[int, int]:
        """(start, size) of this rank's rows within full per-expert slice `shard` (column cut)."""
        n = self.out_sizes[shard]
        return self.tp.rank * n, n

    def missing(self) -> list:
        """Per-expert pieces a per-expert checkpoint did not have (nothing when a fused key was read)."""
        if "fused" in self.loaded:
            return []
        slices = 1 if self.parallel == "row" else 2
        return [(e, s) for e in range(self.weight.shape[0]) for s in range(slices) if (e, s) not in self.loaded]

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether the CPU grouped kernel runs these experts for x (their weight kept unpacked for it)."""
        return self.packed is None and cpu_moe.applies(x, self.weight)

    def forward(self, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        if rows.dispatch is not None:            # the NPU's grouped matmul over the device-side counts
            return rows.dispatch.grouped_matmul(x, self.weight)
        if rows.offsets is not None:             # the CPU's grouped kernel, every expert in one call
            return cpu_moe.grouped_gemm(x, self.weight, rows.offsets)
        weights = self.expert_weights()
        if rows.expert_runs is not None:
            y = x.new_empty(x.shape[0], self.out_features)
            for e, lo, hi in rows.expert_runs:   # one GEMM per active expert
                y[lo:hi] = linear(x[lo:hi], weights[e])
            return y
        y = x.new_zeros(x.shape[0], self.out_features)
        for e, w in enumerate(weights):          # fixed shapes: every expert, each row keeps its own
            y = torch.where((rows.expert == e).unsqueeze(1), linear(x, w), y)
        return y


class MoeExperts(nn.Module):
    """Every expert's gate/up/down, cut along the expert intermediate dim; `forward` returns the partial sum."""

    def __init__(self, cfg, tp: TPGroup):
        super().__init__()
        self.num_experts = num_experts(cfg)
        self.intermediate = _divide(cfg.moe_intermediate_size, tp.size, "moe_intermediate_size")
        self.gate_up_proj = GroupedLinear(self.num_experts, cfg.hidden_size, 2 * self.intermediate, tp, "column")
        self.down_proj = GroupedLinear(self.num_experts, self.intermediate, cfg.hidden_size, tp, "row")

    # the pipeline's steps, so that the LoRA wrapper (lora/expert_layers.py) can add its deltas between them
    def gate_up(self, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        return self.gate_up_proj(x, rows)

    act = staticmethod(MLP.act)   # silu(gate) * up

    def down(self, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        return self.down_proj(x, rows)

    @staticmethod
    def gather(x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        """x's row of each (token, choice) row (the NPU routing op has gathered them already)."""
        return rows.dispatch.expanded_x if rows.dispatch is not None else x[rows.token]

    @staticmethod
    def combine(y: torch.Tensor, rows: ExpertRows, num_tokens: int) -> torch.Tensor:
        if rows.dispatch is not None:
            return rows.dispatch.finalize(y)
        if rows.offsets is not None and moe_fused.applies(y):   # index_add_'s sum in one C pass
            return moe_fused.combine(y.contiguous(), rows.token, rows.weight, num_tokens)
        out = y.new_zeros(num_tokens, y.shape[1])
        return out.index_add_(0, rows.token, y * rows.weight.unsqueeze(1))

    def forward(self, x: torch.Tensor, rows: ExpertRows, lora=None) -> torch.Tensor:
        # offsets: the rows were grouped for the grouped kernel (its weights unpacked); at decode sizes the whole
        # block is one call
        if rows.offsets is not None and moe_fused.fits(x, self.gate_up_proj.weight, rows.token.shape[0]):
            return moe_fused.experts(x, self.gate_up_proj.weight, self.down_proj.weight, rows.offsets, rows.token,
                                     rows.weight)
        xs = self.gather(x, rows)
        return self.combine(self.down(self.act(self.gate_up(xs, rows)), rows), rows, x.shape[0])

    def expert_lora(self, gate_up: tuple | None, down: tuple | None) -> moe_fused.ExpertLoRA | None:
        """The expert LoRA buffers as the fused block reads them (moe_fused.expert_lora), or None."""
        return moe_fused.expert_lora(gate_up, down, self.num_experts)

    def forward_lora(self, x: torch.Tensor, rows: ExpertRows, lora: moe_fused.ExpertLoRA, token_slots: torch.Tensor,
                     slot_map: torch.Tensor, ranks: torch.Tensor, gate_up: bool, down: bool) -> torch.Tensor | None:
        """forward's fused block with each row's expert LoRA inside (moe_fused.experts_lora); None where the block
        does not run this step (the caller adds the LoRA between the separate projections)."""
        if rows.offsets is None or not moe_fused.fits(x, self.gate_up_proj.weight, rows.token.shape[0]):
            return None
        return moe_fused.experts_lora(x, self.gate_up_proj.weight, self.down_proj.weight, rows.offsets, rows.token,
                                      rows.weight, lora, token_slots, slot_map, ranks, gate_up, down)

    @staticmethod
    def fuses(lora) -> bool:
        """Whether a step with this LoRA info runs the whole block in one call where it fits (the LoRA wrapper's
        answer depends on its adapters): its rows may then end at offsets[E]."""
        return True


def route_grouped(logits: torch.Tensor, top_k: int, normalize: bool, valid: torch.Tensor | None = None) -> ExpertRows:
    """group_rows' grouped form straight from the router's logits (HF's softmax, top-k and renormalisation), in
    one C call (workers/models/moe_fused.py); `valid`: the count of real rows, the others get no rows."""
    weight, token, expert, offsets = moe_fused.route(logits, top_k, normalize, valid)
    return ExpertRows(token, expert, weight, None, offsets=offsets)


def group_rows(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, graph_safe: bool,
               grouped: bool = False) -> ExpertRows:
    """The (token, choice) rows of a step: sorted by expert with device-side counts for the grouped GEMM
    (`grouped`), else grouped by expert eagerly, as they are when graph-safe."""
    T, k = ids.shape
    token = torch.arange(T, device=ids.device).repeat_interleave(k)
    expert, weight = ids.reshape(-1), weights.reshape(-1)
    if grouped:
        order = torch.argsort(expert, stable=True)   # as the eager grouping's: by token within an expert
        expert = expert[order]
        return ExpertRows(token[order], expert, weight[order], None,
                          offsets=cpu_moe.expert_offsets(expert, num_experts))
    if graph_safe:
        return ExpertRows(token, expert, weight, None)
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts).tolist()   # the one read back of the layer
    runs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            runs.append((e, start, start + n))
            start += n
    return ExpertRows(token[order], expert[order], weight[order], tuple(runs))
