"""The LoRA budget of a step: which adapters' sequences run, and how it rotates among adapters that wait.

A step holds at most `max_loras_per_batch` distinct adapters (each is a device slot); the base model needs none.
An adapter holds the budget while it has running sequences, so without rotation a waiting adapter gets in only
when every running sequence of some holder has finished: a wait of whole generations, longer while new requests
keep a holder busy. Rotation bounds it, by age as Chameleon's admission does:

- Every step the adapters that wait (for their waiting requests, or paused) are taken oldest first (age: the
  longest any of its requests has waited on the budget, in steps; ties: the most waiting requests, as one slot
  then serves more). Room left in the budget goes to them in that order.
- When the oldest has waited `max_wait_steps` and there is no room, the holder that entered the budget last is
  paused for it: its running sequences keep their KV blocks and sampler rows and sit out (nothing is recomputed)
  until their adapter's turn comes again, as a waiting adapter's would.
- No thrash: only a holder that has held the budget for `max_wait_steps` steps can be paused, so a slot load is
  followed by at least that many steps of use; a pinned adapter is never paused (its slot is not given up).

No starvation: a waiting adapter gets room within `max_wait_steps` steps of becoming the oldest plus the
`max_wait_steps` its victim may still have to hold the budget.
"""
from __future__ import annotations

from typing import Callable, Iterable

from lora.ref import AdapterRef
from workers.adapters import AdapterManager
from workers.sequence import Sequence

LoRAId = AdapterRef | str   # an adapter version; a name: requests for an adapter unloaded while they waited


class LoRABudget:
    def __init__(self, max_loras_per_batch: int, max_wait_steps: int, adapters: AdapterManager | None):
        self.limit = max_loras_per_batch
        self.max_wait_steps = max_wait_steps
        self.adapters = adapters
        self.paused: set[LoRAId] = set()        # adapter versions whose running sequences sit out
        self.since: dict[LoRAId, int] = {}      # adapter version -> the step it last entered the budget
        self.num_pauses = 0

    def fits(self, lora: LoRAId, holders: set[LoRAId]) -> bool:
        """Whether `lora` can run beside `holders` (MoE: an adapter with expert weights also needs an expert slot)."""
        if lora in holders:
            return True
        if len(holders) >= self.limit:
            return False
        adapters = self.adapters
        return not (adapters.uses_experts(lora) and sum(map(adapters.uses_experts, holders)) >= adapters.max_expert_loras)

    def enter(self, lora: LoRAId, holders: set[LoRAId], step: int) -> None:
        holders.add(lora)
        self.paused.discard(lora)
        self.since[lora] = step

    def is_paused(self, seq: Sequence) -> bool:
        return seq.adapter_ref in self.paused

    def rotate(self, running: list[Sequence], waiting: Iterable[Sequence], lora_id: Callable[[Sequence], LoRAId | None],
               startable: Callable[[Sequence], bool], step: int) -> set[LoRAId]:
        """Pause and resume adapters for this step. Returns the holders: the adapters whose running sequences run,
        and those given room for their waiting requests. A waiting adapter gets room only if its oldest request
        is `startable` now (its adapter in host memory, KV blocks, a sampler row): a holder is never paused for a
        request that could not start."""
        running_loras = {s.adapter_ref for s in running if s.adapter}
        self.paused &= running_loras
        self.since = {k: v for k, v in self.since.items() if k in running_loras}   # a drained adapter left it
        holders = running_loras - self.paused
        age: dict[LoRAId, int] = {}
        count: dict[LoRAId, int] = {}
        first: dict[LoRAId, Sequence] = {}   # a waiting adapter's oldest request
        paused_seqs = [s for s in running if s.adapter_ref in self.paused]
        for seq in (*waiting, *paused_seqs):
            lora = lora_id(seq)
            if lora is not None and lora not in holders:
                age[lora] = max(age.get(lora, 0), seq.lora_skips)
                count[lora] = count.get(lora, 0) + 1
                first.setdefault(lora, seq)
        for lora in sorted(age, key=lambda k: (age[k], count[k]), reverse=True):   # stable: ties in arrival order
            if lora not in self.paused and not startable(first[lora]):
                continue
            if not self.fits(lora, holders):
                victim = self._victim(lora, holders, step) if age[lora] >= self.max_wait_steps else None
                if victim is None:
                    continue
                self.paused.add(victim)
                holders.discard(victim)
                self.num_pauses += 1
            if lora in self.paused:
                for seq in paused_seqs:
                    if seq.adapter_ref == lora:
                        seq.lora_skips = 0
            self.enter(lora, holders, step)
        return holders

    def _victim(self, lora: LoRAId, holders: set[LoRAId], step: int) -> LoRAId | None:
        """The holder to pause for `lora`: the one that entered last among those held long enough and not pinned
        whose place `lora` fits in."""
        pinned = self.adapters.pinned
        eligible = [k for k in holders if k not in pinned and step - self.since.get(k, step) >= self.max_wait_steps
                    and self.fits(lora, holders - {k})]
        return max(eligible, key=lambda k: self.since[k], default=None)

    def count_skips(self, seqs: Iterable[Sequence], holders: set[LoRAId], lora_id: Callable[[Sequence], LoRAId | None]):
        """One more step waited on the budget for each of `seqs` (waiting or paused) whose adapter has no room."""
        for seq in seqs:
            lora = lora_id(seq)
            if lora is not None and not self.fits(lora, holders):
                seq.lora_skips += 1
