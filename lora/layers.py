"""LoRA wrappers that replace the tensor-parallel layers of the model.

Duck-typed against the base layers (lora/ imports nothing from workers/):
column-parallel layers expose `out_offsets` and `forward(x)`; row-parallel
ones `partial(x)` and `reduce(y)`, so the delta joins the partial sum before
the layer's single all-reduce; the LM head exposes `partial` and `gather`.
Buffers come from the SlotPool and never move, so captured graphs stay valid.
Which module gets which wrapper is lora/modules.py's table; each layer's op is its
backend's (lora/backends/), bound once here. `lora_shard` cuts an adapter's weights for
this rank the way these layers cut the base's.
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


def lora_shard(model):
    """SlotPool's `shard(module, weights)` for this rank, cut like the base layers (DESIGN: LoRA under TP).

    Column-parallel (q/k/v, gate/up, lm_head): A replicated, B's output rows of this
    rank (k/v by the same kv-head ranges as the base, so replicated kv heads get the
    same B rows). Row-parallel (o, down): A's input columns of this rank, B replicated.
    embed_tokens: both replicated, the delta is added after the embedding's all-reduce.
    The LM head's shard has padding rows (past the vocabulary, or up to a multiple of 16),
    zero like the base's, so even one rank needs this. Which module is cut how is
    lora/modules.py's table; every layer that has a module has the first one's shapes.
    MoE experts are cut the same way on their last two dims (a [E, r, in], b [E, out, r]).
    """
    lm_head = model.lm_head
    column, row = {}, {}
    for group in PACKED_MODULES:
        layers = layers_with(model, group.path)
        if not layers:
            continue
        first = model.layers[layers[0]].get_submodule(group.path)
        if group.parallel in ("column", "expert_column"):
            column.update({m: (first, s) for s, m in enumerate(group.modules)})
        elif group.parallel in ("row", "expert_row"):
            row.update({m: first for m in group.modules})

    def shard(module: str, weights) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = weights.lora_a, weights.lora_b
        if module in column:
            layer, index = column[module]
            start, size = layer.shard_range(index)
            return a, b[..., start:start + size, :]
        if module in row:
            n = row[module].in_features
            start = row[module].tp.rank * n
            return a[..., start:start + n], b
        if module == "lm_head":
            local = b.new_zeros(lm_head.shard_size, b.shape[1])
            rows = b[lm_head.vocab_start:lm_head.vocab_start + lm_head.shard_size]
            local[:rows.shape[0]] = rows
            return a, local
        return a, b

    return shard


def layers_with(model, path: str | None) -> list[int]:
    """The decoder layers that have the module at `path` (MoE: experts in sparse layers, MLPs in dense ones)."""
    if path is None:
        return []
    found = []
    for i, layer in enumerate(model.layers):
        try:
            layer.get_submodule(path)
        except AttributeError:
            continue
        found.append(i)
    return found
