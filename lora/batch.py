"""Per-step LoRA metadata handed explicitly to every LoRA layer's forward.

Two views of the same assignment of tokens to slots:
- segments (runs of consecutive tokens with one slot), host lists for the
  control-flow path and int64 tensors for the Ascend sgmv kernels;
- one slot per token as a fixed-size tensor for the graph-safe path (graph
  replay: shapes never change, nothing is read back to the host).
Slot -1 is the base model: its tokens get exactly zero delta.
The LoRA scaling is folded into B when an adapter is loaded into a slot (per
layer and module, so rank_pattern / alpha_pattern stay exact): no scalings here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRABatchInfo:
    token_slots: torch.Tensor          # [T] int64, slot per token, -1 = base
    seg_lens: torch.Tensor             # [S] int64
    seg_slots: torch.Tensor            # [S] int64
    seg_lens_host: tuple[int, ...]
    seg_slots_host: tuple[int, ...]
    slot_ranks_host: tuple[int, ...]   # [num_slots] effective rank, 0 = empty slot
    max_rank: int
    use_graph: bool = False
    # Per-step results a backend derives from the host lists once instead of once per layer.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def has_lora(self) -> bool:
        return any(s >= 0 for s in self.seg_slots_host)


def token_runs(seg_lens: tuple[int, ...], seg_slots: tuple[int, ...]) -> dict[int, list[tuple[int, int]]]:
    """slot -> its runs of token rows [lo, hi), base (-1) and empty segments left out."""
    spans: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for length, slot in zip(seg_lens, seg_slots):
        if slot >= 0 and length > 0:
            spans.setdefault(slot, []).append((start, start + length))
        start += length
    return spans


def segments(token_slots: list[int]) -> tuple[list[int], list[int]]:
    """Runs of equal consecutive slots: ([lens], [slots])."""
    lens: list[int] = []
    slots: list[int] = []
    for s in token_slots:
        if slots and slots[-1] == s:
            lens[-1] += 1
        else:
            lens.append(1)
            slots.append(s)
    return lens, slots


def make_batch_info(token_slots: list[int], slot_ranks: list[int], max_rank: int,
                    device: torch.device | str = "cpu", use_graph: bool = False) -> LoRABatchInfo:
    """Build the batch info from host data (the step plan); one host→device copy per tensor."""
    lens, slots = segments(token_slots)
    return LoRABatchInfo(
        token_slots=torch.tensor(token_slots, dtype=torch.int64, device=device),
        seg_lens=torch.tensor(lens, dtype=torch.int64, device=device),
        seg_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        seg_lens_host=tuple(lens), seg_slots_host=tuple(slots),
        slot_ranks_host=tuple(slot_ranks), max_rank=max_rank, use_graph=use_graph)
