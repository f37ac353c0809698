"""Device LoRA slots: which adapter owns which slot, and the slot buffers.

`SlotTable` (controller, pure Python) decides slot loads for each batch;
`SlotPool` (each worker) holds the device buffers, allocated once and only
written in place, so captured graphs that read them stay valid.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Container, Iterable

import torch

from lora import native
from lora.adapter import LoRAAdapter, LoRAWeights
from lora.modules import GROUPS, MODULE_GROUPS
from lora.transfer import to_device

__all__ = ["GroupShape", "MODULE_GROUPS", "SlotPool", "SlotTable"]


class SlotTable:
    """Slot assignment: a free slot, else the LRU slot not in the batch and not pinned."""

    def __init__(self, num_slots: int):
        assert num_slots >= 1, num_slots
        self.num_slots = num_slots
        self._names: list[str | None] = [None] * num_slots
        self._slots: dict[str, int] = {}
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self._counts = dict(hits=0, misses=0, evictions=0)

    def slot_of(self, name: str) -> int | None:
        return self._slots.get(name)

    def assign(self, names: Iterable[str], pinned: Container[str] = ()) -> list[tuple[int, str]]:
        """Give every adapter of the batch a slot; returns the loads needed as (slot, name).

        Raises RuntimeError (and changes nothing) if the batch cannot fit.
        """
        names = list(dict.fromkeys(names))
        if len(names) > self.num_slots:
            raise RuntimeError(f"{len(names)} adapters in one batch, only {self.num_slots} slots")
        wanted = set(names)
        candidates = sorted(
            (slot for slot, owner in enumerate(self._names)
             if owner is None or (owner not in wanted and owner not in pinned)),
            key=lambda slot: (self._names[slot] is not None, self._last_used[slot]))
        missing = [name for name in names if name not in self._slots]
        if len(missing) > len(candidates):
            raise RuntimeError(
                f"no slot for {missing[len(candidates):]}: the other slots hold adapters of "
                f"this batch or pinned adapters")
        loads = list(zip(candidates, missing))
        for slot, name in loads:
            owner = self._names[slot]
            if owner is not None:
                del self._slots[owner]
                self._counts["evictions"] += 1
            self._names[slot] = name
            self._slots[name] = slot
        self._counts["misses"] += len(loads)
        self._counts["hits"] += len(names) - len(loads)
        for name in names:
            self._last_used[self._slots[name]] = next(self._clock)
        return loads

    def remove(self, name: str) -> int | None:
        slot = self._slots.pop(name, None)
        if slot is not None:
            self._names[slot] = None
            self._last_used[slot] = 0
        return slot

    def names(self) -> list[str]:
        return list(self._slots)

    def stats(self) -> dict:
        return dict(self._counts, num_slots=self.num_slots, used=len(self._slots))


@dataclass(frozen=True)
class GroupShape:
    in_dim: int                 # local (per-rank) input features; embed_tokens: local vocab size
    out_dims: tuple[int, ...]   # local output features per stacked slice; embed_tokens: (hidden,)
    layers: tuple[int, ...] | None = None   # the layers that have the module (None: every layer)
    experts: int = 0            # an expert group: E per-expert blocks per slot (slot l, expert e at l * E + e)


def _no_shard(module: str, weights: LoRAWeights) -> tuple[torch.Tensor, torch.Tensor]:
    return weights.lora_a, weights.lora_b


class SlotPool:
    """Per-slot LoRA weights on the device; `R = max_rank`, `L = num_slots`.

    Linear group with `stack = len(out_dims)`:
        a [L, stack*R, in_dim]   slice s of slot l in rows [s*R, s*R + r)
        b (stack tensors)        b[s] [L, out_dims[s], R], columns [0, r) used
    embed_tokens:
        a [L, vocab, R]          lora_a.T (PEFT's lora_embedding_A is [r, vocab])
        b (1 tensor)             [L, hidden, R]
    Per layer for the linear groups; once, at layer -1, for embed_tokens / lm_head.
    Expert groups (MoE) have their own, fewer slots (`num_expert_slots`, M): only adapters with
    expert weights take one, at load, beside their slot (`expert_slot_of[slot]`, -1 for none).
    They hold E blocks per expert slot: a [M*E, stack*R, in], b[s] [M*E, out, R], expert slot
    m's expert e at index m*E + e, the one combined index the ops read per row.
    The scaling is folded into b, and every row / column a slot's adapter does
    not use is zero, so a kernel that computes all R ranks (or an empty slot)
    adds exactly the adapter's delta (or zero).
    `a_shared[(layer, group)]` (stacked expert groups; int64 [M*E] on the host, written in place at each
    load) is 1 where every slice of a block holds slice 0's A (PEFT's fused gate_up: gate and up share
    A), so a kernel may read those rows once; every slice keeps its copy, so ignoring it is exact.

    `shard(module, weights)` receives the full (unsharded) PEFT tensors of one
    module and returns this tensor-parallel rank's (lora_a, lora_b), in the
    same orientation; by default the full tensors.
    """

    def __init__(self, num_layers: int, groups: dict[str, GroupShape], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str,
                 shard: Callable[[str, LoRAWeights], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 num_expert_slots: int | None = None):
        assert num_slots >= 1 and max_rank >= 1, (num_slots, max_rank)
        for group, shape in groups.items():
            if group not in GROUPS:
                raise ValueError(f"unknown LoRA group {group!r}; known: {sorted(GROUPS)}")
            if len(shape.out_dims) != len(GROUPS[group].modules):
                raise ValueError(f"group {group!r} stacks {len(GROUPS[group].modules)} slices, "
                                 f"got out_dims {shape.out_dims}")
        self.num_layers, self.groups = num_layers, dict(groups)
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        self.shard = shard or _no_shard
        self.num_expert_slots = num_slots if num_expert_slots is None else num_expert_slots
        self.slot_ranks: list[int] = [0] * num_slots
        self.slot_groups: list[frozenset[str]] = [frozenset()] * num_slots   # the groups its adapter fills
        # by expert slot: its rank, 0 = empty (host, written in place: a captured decode's expert LoRA reads it)
        self.expert_ranks = torch.zeros(self.num_expert_slots, dtype=torch.int64)
        # slot -> its adapter's expert slot (-1: none); the device copy is what a captured decode reads
        self.expert_slot_of: list[int] = [-1] * num_slots
        self.expert_slot_of_device = torch.full((num_slots,), -1, dtype=torch.int64, device=self.device)
        self.buffers: dict[tuple[int, str], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self.a_shared: dict[tuple[int, str], torch.Tensor] = {}
        for group, shape in self.groups.items():
            for layer in self._layers(group):
                self.buffers[(layer, group)] = self._allocate(group, shape)
                if shape.experts and len(shape.out_dims) > 1:
                    self.a_shared[(layer, group)] = torch.zeros(self.num_expert_slots * shape.experts,
                                                                dtype=torch.int64)

    def _layers(self, group: str):
        if GROUPS[group].path is None:
            return [-1]
        layers = self.groups[group].layers
        return range(self.num_layers) if layers is None else layers

    def _index(self, group: str, slot: int) -> int | slice:
        """A slot's block of a buffer: one index, or in an expert group the E rows of expert slot `slot`."""
        E = self.groups[group].experts
        return slice(slot * E, (slot + 1) * E) if E else slot

    def _allocate(self, group: str, shape: GroupShape):
        L, R = (self.num_expert_slots * shape.experts if shape.experts else self.num_slots), self.max_rank
        zeros = functools.partial(torch.zeros, dtype=self.dtype, device=self.device)
        if shape.experts and self.device.type == "cpu":   # a decode step reads a few rows' blocks scattered over
            # them: huge pages spare the page walks (the fused MoE block's expert LoRA 0.8x the time,
            # results/moe_fused_lora.md)
            zeros = functools.partial(native.huge_page_zeros, dtype=self.dtype)
        if group == "embed_tokens":
            a = zeros((L, shape.in_dim, R))
        else:
            a = zeros((L, len(shape.out_dims) * R, shape.in_dim))
        return a, tuple(zeros((L, out, R)) for out in shape.out_dims)

    def load(self, slot: int, adapter: LoRAAdapter, expert_slot: int | None = None) -> None:
        """Copy `adapter` into `slot` (its expert weights into `expert_slot`) in place; everything it does not
        use becomes zero. An adapter without expert weights leaves the expert slots alone.

        Everything is checked (ValueError) before the slot is touched.
        """
        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"adapter {adapter.name!r}: rank {adapter.rank} > max_lora_rank {self.max_rank}")
        pieces = [self._prepare(adapter.name, key, weights) for key, weights in adapter.weights.items()]
        has_experts = any(self.groups[group].experts for (_, group, _), _, _, _ in pieces)
        if has_experts and not (expert_slot is not None and 0 <= expert_slot < self.num_expert_slots):
            raise ValueError(f"adapter {adapter.name!r} has expert weights: it needs an expert slot in "
                             f"[0, {self.num_expert_slots}), got {expert_slot}")
        # Zero only what the pieces leave: a slice they fill at full rank needs no clearing (with
        # every module at max rank, nothing); this and the copies below run on the step's thread.
        full = {key for key, a, _, _ in pieces if a.shape[-2] == self.max_rank}
        for (layer, group), (buf_a, buf_b) in self.buffers.items():
            if self.groups[group].experts and not has_experts:
                continue
            index = self._index(group, expert_slot if self.groups[group].experts else slot)
            for s, b_s in enumerate(buf_b):
                if (layer, group, s) not in full:
                    self._slice(buf_a, group, index, s).zero_()
                    b_s[index].zero_()
        for (layer, group, s), a, b, scaling in pieces:
            # the host copies onto the slot's device first: no op may mix host and device tensors
            a, b, r = to_device(a, self.device), to_device(b, self.device), a.shape[-2]
            buf_a, buf_b = self.buffers[(layer, group)]
            index = self._index(group, expert_slot if self.groups[group].experts else slot)
            if group == "embed_tokens":
                buf_a[slot, :, :r].copy_(a.T)
            else:
                buf_a[index, s * self.max_rank:s * self.max_rank + r].copy_(a)
            # scaled in fp32 and rounded once, straight into the slot (no temporary)
            torch.mul(b.float(), scaling, out=buf_b[s][index, :, :r])
        self.slot_ranks[slot] = adapter.rank
        self.slot_groups[slot] = frozenset(group for (_, group, _), _, _, _ in pieces)
        self._map_expert_slot(slot, expert_slot if has_experts else -1)
        if has_experts:
            self.expert_ranks[expert_slot] = max(a.shape[-2] for (_, group, _), a, _, _ in pieces
                                                 if self.groups[group].experts)
            self._mark_shared(pieces, expert_slot)

    def _mark_shared(self, pieces: list, expert_slot: int) -> None:
        """a_shared of the expert slot's blocks: 1 where the adapter gave every slice and each equals slice 0."""
        given: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for (layer, group, s), a, _, _ in pieces:
            if (layer, group) in self.a_shared:
                given.setdefault((layer, group), {})[s] = a
        for (layer, group), table in self.a_shared.items():
            a = given.get((layer, group), {})
            n = len(self.groups[group].out_dims)
            same = len(a) == n and all(torch.equal(a[s], a[0]) for s in range(1, n))
            table[self._index(group, expert_slot)] = int(same)

    def _map_expert_slot(self, slot: int, expert_slot: int) -> None:
        self.expert_slot_of[slot] = expert_slot
        self.expert_slot_of_device[slot] = expert_slot   # a scalar write in place: graphs keep reading it

    def _slice(self, buf_a: torch.Tensor, group: str, index: int | slice, s: int) -> torch.Tensor:
        """A slot's (`index`, see _index) slice `s` of an A buffer (embed_tokens: the whole [vocab, R] block)."""
        return buf_a[index] if group == "embed_tokens" else buf_a[index, s * self.max_rank:(s + 1) * self.max_rank]

    def _prepare(self, name: str, key: tuple[int, str], weights: LoRAWeights):
        """Shard and check one module's weights: ((layer, group, slice), a, b, scaling)."""
        layer, module = key
        if module not in MODULE_GROUPS:
            raise ValueError(f"adapter {name!r}: unknown module {module!r}")
        group, s = MODULE_GROUPS[module]
        if group not in self.groups:
            raise ValueError(f"adapter {name!r}: module {module!r} has no LoRA buffer (group {group!r})")
        valid_layer = layer == -1 if GROUPS[group].path is None else layer in self._layers(group)
        if not valid_layer:
            raise ValueError(f"adapter {name!r}: module {module!r} at invalid layer {layer}")
        if weights.rank > self.max_rank:
            raise ValueError(f"adapter {name!r}: {module!r} layer {layer} rank {weights.rank} "
                             f"> max_lora_rank {self.max_rank}")
        a, b = self.shard(module, weights)
        shape, r = self.groups[group], weights.rank
        experts = (shape.experts,) if shape.experts else ()
        expected_a, expected_b = (*experts, r, shape.in_dim), (*experts, shape.out_dims[s], r)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise ValueError(f"adapter {name!r}: {module!r} layer {layer} local shapes "
                             f"a {tuple(a.shape)} b {tuple(b.shape)}, expected {expected_a} {expected_b}")
        return (layer, group, s), a, b, weights.scaling

    def clear(self, slot: int) -> None:
        """Zero the slot (rank 0): an empty slot adds exactly zero."""
        self._check_slot(slot)
        expert_slot = self.expert_slot_of[slot]
        for (_, group), (a, bs) in self.buffers.items():
            if self.groups[group].experts and expert_slot < 0:
                continue
            index = self._index(group, expert_slot if self.groups[group].experts else slot)
            a[index].zero_()
            for b in bs:
                b[index].zero_()
        if expert_slot >= 0:
            self.expert_ranks[expert_slot] = 0
            for (_, group), table in self.a_shared.items():
                table[self._index(group, expert_slot)] = 0
        self.slot_ranks[slot] = 0
        self.slot_groups[slot] = frozenset()
        self._map_expert_slot(slot, -1)

    def groups_of(self, slots: Iterable[int]) -> frozenset[str]:
        """The groups that the adapters in `slots` fill (-1, the base, fills none): the only ones whose
        LoRA adds anything for those slots' tokens (every other group's slice of theirs is zero)."""
        return frozenset().union(*(self.slot_groups[s] for s in set(slots) if s >= 0))

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")

    def nbytes(self, experts: bool | None = None) -> int:
        """Bytes of the buffers: all, or only the expert groups' (True) / the others' (False)."""
        return sum(a.nbytes + sum(b.nbytes for b in bs) for (_, group), (a, bs) in self.buffers.items()
                   if experts is None or bool(self.groups[group].experts) == experts)
