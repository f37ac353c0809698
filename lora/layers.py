"""LoRA wrappers that replace the tensor-parallel layers of the model.

Duck-typed against the base layers (lora/ imports nothing from workers/):
column-parallel layers expose `out_offsets` and `forward(x)`; row-parallel
ones `partial(x)` and `reduce(y)`, so the delta joins the partial sum before
the layer's single all-reduce; the LM head exposes `partial` and `gather`.
Buffers come from the SlotPool and never move, so captured graphs stay valid.
"""
from __future__ import annotations

import torch
from torch import nn

from lora.batch import LoRABatchInfo

# (attribute path under each decoder layer, slot-pool group, wrapper kind)
LAYER_TARGETS = (("self_attn.qkv_proj", "qkv_proj", "column"), ("self_attn.o_proj", "o_proj", "row"),
                 ("mlp.gate_up_proj", "gate_up_proj", "column"), ("mlp.down_proj", "down_proj", "row"))


def _active(lora: LoRABatchInfo | None) -> bool:
    # Host-side check only: the graph-safe path always runs (shapes must not depend on data).
    return lora is not None and (lora.use_graph or lora.has_lora)


class _LoRALayer(nn.Module):
    def __init__(self, base: nn.Module, a: torch.Tensor, b: tuple[torch.Tensor, ...], backend):
        super().__init__()
        self.base, self.backend = base, backend
        self.lora_a, self.lora_b = a, b

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)


class ColumnParallelLoRA(_LoRALayer):
    """y_local = base(x) + x @ A.T @ B_local.T, per stacked slice (A replicated, B sharded)."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: tuple[torch.Tensor, ...], backend):
        super().__init__(base, a, b, backend)
        self.offsets = tuple(base.out_offsets)   # fixed per layer: computed once, not every step

    def forward(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        y = self.base(x)
        if _active(lora):
            self.backend.add_lora(y, x, self.lora_a, self.lora_b, self.offsets, lora)
        return y


class RowParallelLoRA(_LoRALayer):
    """y = all_reduce(x_local @ W_local.T + x_local @ A_local.T @ B.T) (A sharded, B replicated)."""

    def forward(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        y = self.base.partial(x)
        if _active(lora):
            self.backend.add_lora(y, x, self.lora_a, self.lora_b, (0, y.shape[-1]), lora)
        return self.base.reduce(y)


class EmbeddingLoRA(_LoRALayer):
    """y = embed(ids) + A.T[ids] @ B.T; A and B replicated, added after the embedding's reduction."""

    def forward(self, ids: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        y = self.base(ids)
        if _active(lora):
            self.backend.add_embedding_lora(y, ids, self.lora_a, self.lora_b[0], lora)
        return y


class LMHeadLoRA(_LoRALayer):
    """logits_local = h @ W_local.T + h @ A.T @ B_local.T, then gathered over the vocab shards."""

    def forward(self, h: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor:
        y = self.base.partial(h)
        if _active(lora):
            self.backend.add_lora(y, h, self.lora_a, self.lora_b, (0, y.shape[-1]), lora)
        return self.base.gather(y)


def wrap_model(model: nn.Module, buffers: dict, backend) -> None:
    """Replace each targeted layer of `model` by its LoRA wrapper over the slot-pool buffers."""
    kinds = {"column": ColumnParallelLoRA, "row": RowParallelLoRA}
    for index, layer in enumerate(model.layers):
        for path, group, kind in LAYER_TARGETS:
            if (index, group) in buffers:
                parent_path, attr = path.split(".")
                parent = layer.get_submodule(parent_path)
                a, b = buffers[(index, group)]
                setattr(parent, attr, kinds[kind](getattr(parent, attr), a, b, backend))
    if (-1, "embed_tokens") in buffers:
        model.embed_tokens = EmbeddingLoRA(model.embed_tokens, *buffers[(-1, "embed_tokens")], backend)
    if (-1, "lm_head") in buffers:
        model.lm_head = LMHeadLoRA(model.lm_head, *buffers[(-1, "lm_head")], backend)
