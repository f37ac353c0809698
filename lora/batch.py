"""Per-step LoRA metadata handed explicitly to every LoRA layer's forward.

Two views of the same assignment of tokens to slots:
- one slot per token (`token_slots`) as a fixed-size tensor: all the graph phase reads
  (graph replay: shapes never change, nothing is read back to the host);
- segments (runs of consecutive tokens with one slot) and the step's `plan` (the tokens
  grouped by adapter), built on the host once per step for the eager phases.
Slot -1 is the base model: its tokens get exactly zero delta.
`groups` names the LoRA groups (lora/modules.py) the step computes: a module that no adapter of the step
targets would only add zeros, so its layer skips its op (on the host: a captured graph just lacks it).
The LoRA scaling is folded into B when an adapter is loaded into a slot (per
layer and module, so rank_pattern / alpha_pattern stay exact): no scalings here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lora.transfer import to_device

PHASES = ("prefill", "decode", "graph")   # what a backend's layer ops are chosen by


@dataclass(frozen=True)
class AdapterRows:
    """One adapter of the step: its slot, its rank and its token rows (one run: a slice)."""
    slot: int
    rank: int
    rows: slice | torch.Tensor


@dataclass(frozen=True)
class KernelGroups:
    """Adapters as the CPU kernel (lora/backends/cpu_sgmv.c) reads them: one int64 CPU tensor
    [slot x G | rank x G | start x (G + 1) | rows], group g is slot[g] at rank[g] over
    rows[start[g]:start[g + 1]] (one tensor: one pointer and one check a call)."""
    packed: torch.Tensor
    num_groups: int

    @classmethod
    def of(cls, slots: list[int], ranks: list[int], rows: list[list[int]]) -> KernelGroups:
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + len(r))
        packed = torch.tensor([*slots, *ranks, *starts, *(t for r in rows for t in r)], dtype=torch.int64)
        return cls(packed, len(slots))

    @property
    def slot(self) -> torch.Tensor:
        return self.packed[:self.num_groups]

    @property
    def rank(self) -> torch.Tensor:
        return self.packed[self.num_groups:2 * self.num_groups]

    @property
    def start(self) -> torch.Tensor:
        return self.packed[2 * self.num_groups:3 * self.num_groups + 1]

    @property
    def rows(self) -> torch.Tensor:
        return self.packed[3 * self.num_groups + 1:]


@dataclass(frozen=True)
class LoRAPlan:
    """A step's tokens grouped by adapter (base tokens and empty slots left out)."""
    groups: tuple[AdapterRows, ...]        # every adapter present: torch GEMMs per adapter
    kernel: KernelGroups | None = None     # the cpu backend: the adapters with few tokens ...
    gemm: tuple[AdapterRows, ...] = ()     # ... and the others, which torch's GEMMs do better


@dataclass
class LoRABatchInfo:
    """A backend fills only the fields its ops read (lora/backends/*.py `batch_info`)."""
    token_slots: torch.Tensor | None = None   # [T] int64 on the device, slot per token, -1 = base
    seg_lens: torch.Tensor | None = None      # [S] int64 on the device (sgmv kernels)
    seg_slots: torch.Tensor | None = None     # [S] int64 on the device
    seg_lens_host: tuple[int, ...] = ()
    token_slots_host: tuple[int, ...] = ()    # eager phases: the slot per token on the host (MoE expert rows)
    seg_slots_host: tuple[int, ...] = ()
    slot_ranks_host: tuple[int, ...] = ()     # [num_slots] effective rank, 0 = empty slot
    max_rank: int = 0
    use_graph: bool = False            # the graph phase: only token_slots may be read
    phase: str = "prefill"             # prefill | decode (eager) | graph (set by use_graph)
    plan: LoRAPlan | None = None       # eager torch / cpu ops: built from the host lists if they are given
    any_lora: bool | None = None       # host-side: a token of the step has an adapter (None: from the plan)
    groups: frozenset[str] | None = None   # the groups whose LoRA runs (None: every group)

    def __post_init__(self):
        if self.use_graph or self.phase == "graph":
            self.use_graph, self.phase = True, "graph"
        elif self.phase not in PHASES:
            raise ValueError(f"LoRA phase must be one of {PHASES}, got {self.phase!r}")
        elif self.plan is None and self.seg_lens_host:
            self.plan = plan_step(self.seg_lens_host, self.seg_slots_host, self.slot_ranks_host, self.max_rank,
                                  self.token_slots.device if self.token_slots is not None else "cpu")

    @property
    def has_lora(self) -> bool:
        """Whether an eager step has anything to add (the graph phase always runs its ops)."""
        if self.any_lora is not None:
            return self.any_lora
        return self.plan is not None and bool(self.plan.groups)

    def computes(self, group: str) -> bool:
        """Whether the layers of `group` run their LoRA op in this step (decided on the host)."""
        return (self.use_graph or self.has_lora) and (self.groups is None or group in self.groups)


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


def plan_step(seg_lens: tuple[int, ...], seg_slots: tuple[int, ...], slot_ranks: tuple[int, ...], max_rank: int,
              device: torch.device | str = "cpu", gemm_min_tokens: int | None = None) -> LoRAPlan:
    """The step's plan from its segments; with `gemm_min_tokens` (the cpu backend) also split for the C
    kernel: adapters with fewer tokens go to `kernel`, the others to `gemm`.

    Every index is a view of one tensor built here (one host->device copy a step, not one a group).
    """
    runs: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for length, slot in zip(seg_lens, seg_slots):
        if slot >= 0 and length > 0:
            runs.setdefault(slot, []).append((start, start + length))
        start += length
    ranks = {slot: min(slot_ranks[slot] if slot < len(slot_ranks) else max_rank, max_rank) for slot in runs}
    count = {slot: sum(hi - lo for lo, hi in spans) for slot, spans in runs.items()}
    present = [slot for slot in runs if ranks[slot] > 0]        # an empty slot adds exactly zero
    split = gemm_min_tokens is not None
    few = [slot for slot in present if split and count[slot] < gemm_min_tokens]
    many = [slot for slot in present if slot not in few]
    order = few + many                                          # the kernel's groups: a prefix
    starts = [0]
    for slot in order:
        starts.append(starts[-1] + count[slot])
    header = [*few, *(ranks[slot] for slot in few), *starts[:len(few) + 1]] if few else []
    index = to_device(header + [t for slot in order for lo, hi in runs[slot] for t in range(lo, hi)], device,
                      torch.int64)
    rows = index[len(header):]
    groups = {slot: AdapterRows(slot, ranks[slot], slice(*runs[slot][0]) if len(runs[slot]) == 1
                                else rows[starts[i]:starts[i + 1]]) for i, slot in enumerate(order)}
    G = len(few)
    kernel = KernelGroups(index[:3 * G + 1 + starts[G]], G) if few else None
    return LoRAPlan(tuple(groups[slot] for slot in present), kernel, tuple(groups[slot] for slot in many if split))


def plan_rows(index: torch.Tensor, ranks: torch.Tensor, max_rank: int, device: torch.device | str = "cpu",
              gemm_min_tokens: int | None = None) -> LoRAPlan:
    """plan_step's plan for rows given one index each (a host int64 tensor, -1: none) with each index's rank
    (host int64), built with a few tensor ops: MoE expert rows (T x top-k rows over as many combined (slot,
    expert) indices) would otherwise cost a Python iteration per row and per index, a layer and a step.
    Groups by ascending index, each its rows in order; with `gemm_min_tokens` the smaller ones first (the kernel)."""
    rank = torch.where(index >= 0, ranks.clamp(max=max_rank)[index.clamp(min=0)], 0)
    live = (rank > 0).nonzero().squeeze(1)                      # an empty slot adds exactly zero
    order = live[torch.argsort(index[live], stable=True)]
    keys, counts = torch.unique_consecutive(index[order], return_counts=True)
    many = counts >= gemm_min_tokens if gemm_min_tokens is not None else torch.ones_like(counts, dtype=torch.bool)
    group = torch.repeat_interleave(torch.arange(len(keys)), counts)
    order = order[torch.argsort(many[group].to(torch.int64) * len(keys) + group, stable=True)]   # few first
    regrouped = torch.cat([(~many).nonzero().squeeze(1), many.nonzero().squeeze(1)])
    keys, counts, many = keys[regrouped], counts[regrouped], many[regrouped]
    G = int((~many).sum())
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    header = torch.cat([keys[:G], rank[order][starts[:G]], starts[:G + 1]]) if G else keys[:0]
    packed = to_device(torch.cat([header, order]), device, torch.int64)
    rows = packed[len(header):]
    groups = [AdapterRows(k, r, rs) for k, r, rs in zip(keys.tolist(), rank[order][starts[:-1]].tolist(),
                                                         rows.split(counts.tolist()))]
    kernel = KernelGroups(packed[:3 * G + 1 + int(starts[G])], G) if G else None
    return LoRAPlan(tuple(groups), kernel, tuple(groups[G:]) if gemm_min_tokens is not None else ())

