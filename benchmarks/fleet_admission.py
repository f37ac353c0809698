"""The simulated replica's admission under the LoRA budget (benchmarks/fleet_replica.py): the engine's rule itself.

workers/controller.py `schedule` and `_admit` drive workers/lora_budget.py `LoRABudget`: each step the budget
rotates among the adapters that wait, oldest first, and one that has waited `lora_max_wait_steps` steps takes the
place of the holder that entered last, whose running sequences pause (keeping their place) until their turn.
`EngineQueues` drives that same class, called in the same order, and tries waiting requests in the controller's
own `_admission_order`, so the simulation cannot drift from the engine's rule. The simulation's requests stand in
for workers/sequence.py `Sequence` in what the budget reads (`adapter`, `adapter_ref`, `lora_skips`), `DENSE` for
workers/adapters.py `AdapterManager` (`uses_experts`, `max_expert_loras`, `pinned`: the fleet's adapters are dense
and none is pinned, as LLMServer loads them).
What of the controller is not modelled: KV blocks (no preemption; a request needs only a sequence place) and the
adapter's load at admission (Serve's multiplexed loader reads it before the request reaches the engine:
fleet_replica.py `arrive`), so a waiting request can start whenever a place is free (`_can_start`).
"""
from __future__ import annotations

import dataclasses
from collections import deque
from types import SimpleNamespace

from workers.config import EngineConfig
from workers.controller import Controller
from workers.lora_budget import LoRABudget

# The engine's default (workers/config.py): LLMServer and the CLI leave it as it is.
MAX_WAIT_STEPS = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "lora_max_wait_steps")
DENSE = SimpleNamespace(uses_experts=lambda lora: False, max_expert_loras=0, pinned=frozenset())


class EngineQueues:
    """One engine's waiting queue and running set (paused sequences included), stepped as Controller.schedule."""

    _admission_order = Controller._admission_order   # the engine's order of trying waiting requests, itself

    def __init__(self, max_num_seqs: int, max_loras_per_batch: int, max_wait_steps: int = MAX_WAIT_STEPS):
        self.max_num_seqs = max_num_seqs
        self.budget = LoRABudget(max_loras_per_batch, max_wait_steps, DENSE)
        self.waiting: deque = deque()
        self.running: list = []
        self.step_count = 0
        self.running_steps = 0   # sum over steps of the running requests, and of those paused (fleet_waits.py)
        self.paused_steps = 0

    @staticmethod
    def _lora_id(req) -> str:
        return req.adapter

    def _can_start(self, req) -> bool:
        return len(self.running) < self.max_num_seqs

    def schedule(self, max_num_batched_tokens: int) -> tuple[list, list, list]:
        """The step's decodes (running requests past their prompt, not paused), chunks of prompts in progress and
        the requests admitted now with their first chunk ((request, tokens)), as Controller.schedule picks them."""
        self.step_count += 1
        holders = self.budget.rotate(self.running, self.waiting, self._lora_id, self._can_start, self.step_count)
        runnable = [req for req in self.running if not self.budget.is_paused(req)]
        self.running_steps += len(self.running)
        self.paused_steps += len(self.running) - len(runnable)
        decodes = [req for req in runnable if not req.prefill_left]
        budget = max_num_batched_tokens - len(decodes)
        chunks = []
        for req in runnable:
            if req.prefill_left and budget > 0:
                n = min(req.prefill_left, budget)
                chunks.append((req, n))
                budget -= n
        admitted = self._admit(budget, holders)
        self.running.extend(req for req, _ in admitted)
        return decodes, chunks, admitted

    def _admit(self, budget: int, holders: set[str]) -> list[tuple[object, int]]:
        """Controller._admit without KV blocks: waiting requests in `_admission_order` while a place and the token
        budget last, each whose adapter holds the budget or finds room in it; then one more skipped step for each
        waiting or paused request whose adapter has no room."""
        admitted = []
        for req in self._admission_order():
            if budget <= 0 or len(self.running) + len(admitted) >= self.max_num_seqs:
                break
            if not self.budget.fits(req.adapter, holders):
                continue
            self.waiting.remove(req)
            req.adapter_ref = req.adapter
            if req.adapter_ref not in holders:
                self.budget.enter(req.adapter_ref, holders, self.step_count)
            req.budget_skips, req.admitted_step = req.lora_skips, self.step_count
            req.lora_skips = 0
            req.prefill_left = req.prompt_tokens
            n = min(req.prompt_tokens, budget)
            admitted.append((req, n))
            budget -= n
        paused = [req for req in self.running if self.budget.is_paused(req)]
        self.budget.count_skips((*self.waiting, *paused), holders, self._lora_id)
        return admitted

    def active_adapters(self) -> set[str]:
        """The adapters of the step: those of running requests that are not paused (Controller._batch's slots)."""
        return {req.adapter for req in self.running if not self.budget.is_paused(req)}

    def finish(self, ended: list) -> None:
        if ended:
            gone = set(ended)
            self.running = [req for req in self.running if req not in gone]
