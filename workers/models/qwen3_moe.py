"""Qwen3-MoE: the Qwen3 decoder with a sparse mixture-of-experts block in place of the MLP.

A layer is sparse unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`; dense
layers keep the Llama-family MLP at `intermediate_size`. The router is HF's (fp32 softmax, top-k,
renormalised when `norm_topk_prob`, cast back). Experts run on the (token, choice) rows grouped by
expert. On the CPU (bf16 / fp32) one grouped GEMM per projection (workers/models/cpu_moe.py) runs every
routed expert over its rows, sorted by expert with the cumulative counts computed on the device: eager
steps and a captured decode run the same calls, nothing read back. Otherwise (no C compiler,
LORASERVE_MOE_KERNEL=0, other dtypes or devices) one GEMM per active expert and projection (eager), or,
in a captured decode where nothing may read back to the host, a fixed loop over every expert keeping
each row's own (graph-safe). On an NPU
with torch_npu's MoE ops (workers/models/moe_kernels.py, `use_moe_kernel`) routing, grouping, the
grouped GEMMs and the combine are those ops instead, in every phase: nothing is read back to the host.

Tensor parallel as vLLM without expert parallelism: every rank holds every expert, cut along the
expert intermediate dimension (gate/up rows, down columns); the router is replicated; the block's
partial output is all-reduced once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lora import native
from workers.forward_batch import ForwardBatch
from workers.models import cpu_moe
from workers.models.llama import MLP, LlamaForCausalLM
from workers.models.loader import _target
from workers.parallel import PACK_BATCH_HINT, TPGroup, _divide, _narrow, linear

# checkpoint keys of the experts: per expert (as saved, as on the Hub) or fused (transformers 5.x in memory)
_PER_EXPERT = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight")
_FUSED = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up|down)_proj(?:\.weight)?")


def num_experts(cfg) -> int:
    return getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)


def is_sparse_layer(cfg, index: int) -> bool:
    """HF's rule (Qwen3MoeDecoderLayer)."""
    return (index not in (cfg.mlp_only_layers or []) and num_experts(cfg) > 0
            and (index + 1) % cfg.decoder_sparse_step == 0)


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


class Router(nn.Module):
    """logits = x @ W.T; fp32 softmax, top-k, renormalised if asked, cast back (replicated on every rank)."""

    def __init__(self, cfg):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts(cfg), cfg.hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


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
        out = y.new_zeros(num_tokens, y.shape[1])
        return out.index_add_(0, rows.token, y * rows.weight.unsqueeze(1))

    def forward(self, x: torch.Tensor, rows: ExpertRows, lora=None) -> torch.Tensor:
        xs = self.gather(x, rows)
        return self.combine(self.down(self.act(self.gate_up(xs, rows)), rows), rows, x.shape[0])


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


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.gate = Router(cfg)
        self.experts = MoeExperts(cfg, tp)
        self.kernel = None   # the NPU's MoE ops (moe_kernels.NpuMoeKernel), set by use_moe_kernel; None: torch

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.kernel is not None:
            rows = self.kernel.route(x, self.gate, self.experts.num_experts)
        else:
            weights, ids = self.gate(x)
            rows = group_rows(weights, ids, self.experts.num_experts, batch.graph_safe or self._graph_lora(batch),
                              self.experts.gate_up_proj.grouped(x))
        return self.tp.all_reduce(self.experts(x, rows, batch.lora))

    @staticmethod
    def _graph_lora(batch: ForwardBatch) -> bool:
        return batch.lora is not None and batch.lora.use_graph


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_types = ("qwen3_moe",)

    def make_mlp(self, cfg, index: int, tp: TPGroup) -> nn.Module:
        return SparseMoeBlock(cfg, tp) if is_sparse_layer(cfg, index) else MLP(cfg, tp)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """Checkpoint key -> (our parameter, shard): experts in either layout, else the Llama-family rule."""
        name = name.removeprefix("model.")
        match = _PER_EXPERT.fullmatch(name)
        if match:
            proj = match["proj"]
            target = f"{match['prefix']}.{'down' if proj == 'down' else 'gate_up'}_proj.weight"
            return target, (int(match["expert"]), 1 if proj == "up" else 0)
        match = _FUSED.fullmatch(name)
        if match:
            return f"{match['prefix']}.{match['proj']}_proj.weight", None
        return _target(name, self.packed_modules_mapping)

    def prepack_experts(self) -> int:
        """Every expert projection packed for oneDNN (CPU); returns how many."""
        return sum(m.prepack() for m in self.modules() if isinstance(m, GroupedLinear))

    def use_moe_kernel(self, kernel) -> int:
        """Every sparse block routes and runs its experts through `kernel` (the NPU's MoE ops); returns how many."""
        blocks = [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
        for block in blocks:
            block.kernel = kernel
        return len(blocks)

    def check_loaded(self, path) -> None:
        for name, module in self.named_modules():
            if isinstance(module, GroupedLinear) and module.missing():
                raise ValueError(f"checkpoint {str(path)!r} is missing experts of {name}: "
                                 f"(expert, slice) {module.missing()[:8]}")
