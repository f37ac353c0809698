"""The StepPlan: what every worker executes in one step (small, picklable, host data only)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepPlan:
    is_prefill: bool
    input_ids: list[int]            # prefill: all tokens packed; decode: last token of each seq
    positions: list[int]
    seq_lens: list[int]             # prefill: tokens of each seq; decode: context length incl. the new token
    block_tables: list[list[int]]
    lora_slots: list[int]           # per seq, -1 = base model
    # (slot, adapter, source, load id) to load first; the load id names the controller's read of the
    # files, so a rank's own copy keyed by it is re-read whenever the controller's was
    lora_loads: list[tuple[int, str, str, int]] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)   # index of the token each seq samples now

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)
