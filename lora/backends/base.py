"""The LoRA backend interface: one object per model runner, chosen once by name (lora.backends.get_backend).

A backend owns what differs by device: the batch info it builds each step (only the fields its
ops read), the batch info of a captured graph (over the graph runner's static slot buffer), and
each wrapped layer's ops per phase, bound once at wrap time to the layer's fixed slot buffers.
Whether its kernels take a layer (dtype, alignment, rank) is decided there, once: a layer they
do not take gets the torch maths of lora/ops.py, counted in `fallbacks` and logged once per reason.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from lora import ops
from lora.batch import LoRABatchInfo, plan_rows, plan_step, segments

log = logging.getLogger(__name__)

LayerOp = Callable[[torch.Tensor, torch.Tensor, LoRABatchInfo], None]   # (y, x or ids, info)


class LayerLoRA:
    """One layer's LoRA op for each phase (prefill / decode / graph), bound to its buffers."""

    __slots__ = ("by_phase",)

    def __init__(self, prefill: LayerOp, decode: LayerOp, graph: LayerOp):
        self.by_phase = {"prefill": prefill, "decode": decode, "graph": graph}

    def __call__(self, y: torch.Tensor, x: torch.Tensor, info: LoRABatchInfo) -> None:
        if x.shape[0]:   # nothing to add (and the NPU kernels' host checks refuse T = 0)
            self.by_phase[info.phase](y, x, info)


def torch_ops(a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int]) -> LayerLoRA:
    """The torch maths: segments in the eager phases, masked (graph-safe) in the graph phase."""
    def segments_op(y, x, info):
        ops.add_lora_segments(y, x, a, b, offsets, info)

    def masked_op(y, x, info):
        ops.add_lora_masked(y, x, a, b, offsets, info)

    return LayerLoRA(segments_op, segments_op, masked_op)


class LoRABackend:
    """The portable backend (torch_native); the others override what their kernels change."""

    name = "torch_native"
    plan_split: int | None = None   # the cpu backend splits its plan between kernel and GEMMs

    def __init__(self, device: torch.device | str, dtype: torch.dtype, max_rank: int):
        self.device, self.dtype, self.max_rank = torch.device(device), dtype, max_rank
        self.fallbacks: Counter[str] = Counter()   # reason -> layers bound to the torch maths instead

    # ---- per step ---------------------------------------------------------------------------
    def batch_info(self, token_slots: list[int], slot_ranks: Sequence[int], phase: str,
                   groups: frozenset[str] | None = None) -> LoRABatchInfo:
        """The eager phases (prefill / decode): the step's tokens grouped by adapter; only `groups` run
        (None: every group)."""
        lens, slots = segments(token_slots)
        plan = plan_step(tuple(lens), tuple(slots), tuple(slot_ranks), self.max_rank, self.device, self.plan_split)
        return LoRABatchInfo(phase=phase, plan=plan, max_rank=self.max_rank, token_slots_host=tuple(token_slots),
                             groups=groups)

    def row_batch_info(self, index: torch.Tensor, ranks: torch.Tensor, phase: str) -> LoRABatchInfo:
        """An eager phase's batch info for rows with one index each, as host int64 tensors (index -1: none; ranks
        per index): the MoE expert rows of lora/expert_layers.py, planned with tensor ops."""
        plan = plan_rows(index, ranks, self.max_rank, self.device, self.plan_split)
        return LoRABatchInfo(phase=phase, plan=plan, max_rank=self.max_rank, any_lora=bool(plan.groups))

    def graph_info(self, token_slots: torch.Tensor, groups: frozenset[str] | None = None) -> LoRABatchInfo:
        """A captured decode: only the static slot-per-token buffer, read on the device; the graph holds
        the ops of `groups` only (None: every group)."""
        return LoRABatchInfo(token_slots=token_slots, max_rank=self.max_rank, use_graph=True, groups=groups)

    # ---- per layer, at wrap time ------------------------------------------------------------
    def bind(self, layer: str, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
             a_shared: torch.Tensor | None = None) -> LayerLoRA:
        """The layer's ops on its slot buffers. a_shared (int64 [slots], host, updated in place by the slot pool):
        nonzero where every slice of the slot holds slice 0's A, which a kernel may then read once; the buffers
        hold every slice's copy, so ignoring it is exact."""
        return torch_ops(a, b, offsets)

    def bind_embedding(self, layer: str, a: torch.Tensor, b: torch.Tensor) -> LayerLoRA:
        """Embeddings are a gather on every device: the torch maths."""
        def segments_op(y, ids, info):
            ops.add_embedding_segments(y, ids, a, b, info)

        def masked_op(y, ids, info):
            ops.add_embedding_masked(y, ids, a, b, info)

        return LayerLoRA(segments_op, segments_op, masked_op)

    def fallback(self, layer: str, reason: str) -> None:
        """Count a layer that the kernels do not take; the first of each reason is logged."""
        if not self.fallbacks[reason]:
            log.warning("LoRA backend %s: %s (layer %s): such layers run the torch ops", self.name, reason, layer)
        self.fallbacks[reason] += 1

    def stats(self) -> dict:
        return {"lora_backend": self.name, "lora_fallbacks": dict(self.fallbacks)}
