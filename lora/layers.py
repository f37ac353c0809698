"""LoRA wrappers that replace the tensor-parallel layers of the model.

Duck-typed against the base layers (lora/ imports nothing from workers/):
column-parallel layers expose `out_offsets` and `forward(x)`; row-parallel
ones `partial(x)` and `reduce(y)`, so the delta joins the partial sum before
the layer's single all-reduce; the LM head exposes `partial` and `gather`.
Buffers come from the SlotPool and never move, so captured graphs stay valid.
Which module gets which wrapper is lora/modules.py's table; each layer's op is its
backend's (lora/backends/), bound once here.
"""
from __future__ import annotations

import torch
from torch import nn

from lora.backends.base import LayerLoRA, LoRABackend
from lora.batch import LoRABatchInfo
from lora.modules import EXPERT_GROUPS, PACKED_MODULES


class _LoRALayer(nn.Module):
    def __init__(self, base: nn.Module, a: torch.Tensor, b: tuple[torch.Tensor, ...], op: LayerLoRA, group: str):
        super().__init__()
        self.base, self.op, self.group = base, op, group
        self.lora_a, self.lora_b = a, b

    def runs(self, lora: LoRABatchInfo | None) -> bool:
        # Host-side only (the graph-safe path never asks the data): a module no adapter of the step
        # targets adds zeros, so it is skipped; in a captured graph that op is simply not recorded.
        return lora is not None and lora.computes(self.group)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)


class ColumnParallelLoRA(_LoRALayer):
    """y_local = base(x) + x @ A.T @ B_local.T, per stacked slice (A replicated, B sharded)."""

    def forward(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        y = self.base(x)
        if self.runs(lora):
            self.op(y, x, lora)
        return y


class RowParallelLoRA(_LoRALayer):
    """y = all_reduce(x_local @ W_local.T + x_local @ A_local.T @ B.T) (A sharded, B replicated)."""

    def forward(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        y = self.base.partial(x)
        if self.runs(lora):
            self.op(y, x, lora)
        return self.base.reduce(y)


class EmbeddingLoRA(_LoRALayer):
    """y = embed(ids) + A.T[ids] @ B.T; A and B replicated, added after the embedding's reduction."""

    def forward(self, ids: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        y = self.base(ids)
        if self.runs(lora):
            self.op(y, ids, lora)
        return y


class LMHeadLoRA(_LoRALayer):
    """logits_local = h @ W_local.T + h @ A.T @ B_local.T, then gathered over the vocab shards."""

    def forward(self, h: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        y = self.base.partial(h)
        if self.runs(lora):
            self.op(y, h, lora)
        return self.base.gather(y)


def _offsets(base: nn.Module, parallel: str, b: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    """Where each stacked slice's delta goes in the layer's (local) output: fixed per layer."""
    if parallel == "column":
        return tuple(base.out_offsets)
    return (0, b[0].shape[1])   # row: the partial sum's width; lm_head: this rank's padded vocab shard


def wrap_model(model: nn.Module, buffers: dict, backend: LoRABackend) -> None:
    """Replace each targeted module of `model` by its LoRA wrapper over the slot-pool buffers, its op
    bound by `backend` (which decides there, once per layer, whether its kernels take it)."""
    kinds = {"column": ColumnParallelLoRA, "row": RowParallelLoRA, "embedding": EmbeddingLoRA,
             "lm_head": LMHeadLoRA}
    for group in PACKED_MODULES:
        if group.name in EXPERT_GROUPS:   # inside a MoE block: lora/expert_layers.py
            continue
        for index in ([-1] if group.path is None else range(len(model.layers))):
            if (index, group.name) not in buffers:
                continue
            owner = model if group.path is None else model.layers[index]
            parent_path, _, attr = (group.path or group.name).rpartition(".")
            parent = owner.get_submodule(parent_path)
            a, b = buffers[(index, group.name)]
            base, name = getattr(parent, attr), f"{index}.{group.name}"
            op = (backend.bind_embedding(name, a, b[0]) if group.parallel == "embedding"
                  else backend.bind(name, a, b, _offsets(base, group.parallel, b)))
            setattr(parent, attr, kinds[group.parallel](base, a, b, op, group.name))
