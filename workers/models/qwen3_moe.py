"""Qwen3-MoE: the Qwen3 decoder with a sparse mixture-of-experts block in place of the MLP.

A layer is sparse unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`; dense
layers keep the Llama-family MLP at `intermediate_size`. The router is HF's (fp32 softmax, top-k,
renormalised when `norm_topk_prob`, cast back). The experts run on the (token, choice) rows grouped by
expert (workers/models/moe_experts.py: the CPU's grouped GEMMs, eager or graph-safe loops). On an NPU
with torch_npu's MoE ops (workers/models/moe_kernels.py, `use_moe_kernel`) routing, grouping, the
grouped GEMMs and the combine are those ops instead, in every phase: nothing is read back to the host.

Tensor parallel as vLLM without expert parallelism: every rank holds every expert, cut along the
expert intermediate dimension (gate/up rows, down columns); the router is replicated; the block's
partial output is all-reduced once.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from workers.forward_batch import ForwardBatch
from workers.models import moe_fused
from workers.models.llama import MLP, LlamaForCausalLM
from workers.models.loader import _target
from workers.models.moe_experts import GroupedLinear, MoeExperts, group_rows, num_experts, route_grouped
from workers.parallel import TPGroup, linear, prepack

# checkpoint keys of the experts: per expert (as saved, as on the Hub) or fused (transformers 5.x in memory)
_PER_EXPERT = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight")
_FUSED = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up|down)_proj(?:\.weight)?")


def is_sparse_layer(cfg, index: int) -> bool:
    """HF's rule (Qwen3MoeDecoderLayer)."""
    return (index not in (cfg.mlp_only_layers or []) and num_experts(cfg) > 0
            and (index + 1) % cfg.decoder_sparse_step == 0)


class Router(nn.Module):
    """logits = x @ W.T; fp32 softmax, top-k, renormalised if asked, cast back (replicated on every rank)."""

    def __init__(self, cfg):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts(cfg), cfg.hidden_size), requires_grad=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)   # prepacked on the CPU: a decode step's on cpu_gemv.c, a graph's kernel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.gate = Router(cfg)
        self.experts = MoeExperts(cfg, tp)
        self.kernel = None   # the NPU's MoE ops (moe_kernels.NpuMoeKernel), set by use_moe_kernel; None: torch

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        grouped = self.kernel is None and self.experts.gate_up_proj.grouped(x)
        if self.kernel is not None:
            rows = self.kernel.route(x, self.gate, self.experts.num_experts)
        elif grouped and moe_fused.applies(x):   # the softmax, top-k and sort in C
            rows = route_grouped(self.gate.logits(x), self.gate.top_k, self.gate.norm_topk_prob, self._valid(x, batch))
        else:
            weights, ids = self.gate(x)
            rows = group_rows(weights, ids, self.experts.num_experts, batch.graph_safe or self._graph_lora(batch),
                              grouped)
        return self.tp.all_reduce(self.experts(x, rows, batch.lora))

    def _valid(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """A captured CPU decode's count of real rows where the fused block runs them: its padded rows then route
        to no expert instead of streaming up to top_k experts no real token uses."""
        if batch.valid_tokens is None:   # every eager step: all its rows are real
            return None
        fused = (moe_fused.fits(x, self.experts.gate_up_proj.weight, x.shape[0] * self.gate.top_k)
                 and self.experts.fuses(batch.lora))
        return batch.valid_tokens if fused else None

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
        """Every expert projection and router packed for oneDNN (CPU); returns how many."""
        return sum(m.prepack() if isinstance(m, GroupedLinear) else prepack(m)
                   for m in self.modules() if isinstance(m, (GroupedLinear, Router)))

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
