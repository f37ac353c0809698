"""Continuous batching: queues, KV admission and preemption, the LoRA budget, StepPlans.

Each step is either a prefill of newly admitted sequences or a decode of all
running ones. Admission is first-come first-served under four budgets: free KV
blocks, batched tokens, max_num_seqs and distinct adapters
(max_loras_per_batch; the base model needs no slot). A request passed over for
lack of a LoRA slot more than `lora_max_wait_steps` times stops admission
behind it, so the running adapters drain and it gets in (no starvation).
When decode runs out of KV blocks the youngest sequence is preempted and later
recomputed from its prompt and the tokens it already has.
"""
from __future__ import annotations

from collections import deque

from lora.errors import AdapterError
from workers.adapters import AdapterManager
from workers.config import EngineConfig
from workers.kv_cache import BlockAllocator, blocks_needed
from workers.plan import StepPlan
from workers.sequence import Sequence, Status


class Controller:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                 max_num_batched_tokens: int, adapters: AdapterManager | None):
        self.config = config
        self.block_size = config.kv_block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.allocator = BlockAllocator(num_kv_blocks)
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.errored: list[Sequence] = []       # finished outside a step (e.g. adapter load failed)
        self.step_count = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.step_count
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------
    def schedule(self) -> tuple[StepPlan, list[Sequence]] | None:
        self.step_count += 1
        admitted = self._admit()
        if admitted:
            self.running.extend(admitted)
            return self._plan(admitted, is_prefill=True)
        if self._reserve_decode_blocks():
            return self._plan(self.running, is_prefill=False)
        return None

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        num_tokens = 0
        active = {s.adapter for s in self.running if s.adapter}
        for seq in list(self.waiting):
            if len(self.running) + len(admitted) >= self.config.max_num_seqs:
                break
            if num_tokens + len(seq) > self.max_num_batched_tokens:
                break
            if seq.adapter and seq.adapter not in active and len(active) >= self.config.max_loras_per_batch:
                seq.lora_skips += 1
                if seq.lora_skips > self.config.lora_max_wait_steps:
                    break                        # drain the running adapters for this one
                continue
            need = blocks_needed(len(seq), self.block_size)
            if need > self.allocator.num_free:
                break
            if seq.adapter and not self._acquire_adapter(seq):
                continue
            seq.block_table = self.allocator.allocate(need)
            seq.status = Status.RUNNING
            self.waiting.remove(seq)
            if seq.adapter:
                active.add(seq.adapter)
            admitted.append(seq)
            num_tokens += len(seq)
        return admitted

    def _acquire_adapter(self, seq: Sequence) -> bool:
        """Hold a reference to the request's adapter if it is in host memory (else a load starts)."""
        try:
            if not self.adapters.ensure(seq.adapter):
                return False
        except AdapterError as exc:
            self._fail_waiting(seq, exc)
            return False
        try:
            self.adapters.acquire(seq.adapter)
        except AdapterError:   # evicted by a load that finished in between: retry next step
            return False
        return True

    def _fail_waiting(self, seq: Sequence, exc: Exception) -> None:
        self.waiting.remove(seq)
        seq.error = str(exc)
        seq.finish_reason = "error"
        seq.status = Status.FINISHED
        self.errored.append(seq)

    def _reserve_decode_blocks(self) -> bool:
        """Give each running sequence room for its next token, preempting the youngest if needed."""
        kept: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            need = blocks_needed(len(seq), self.block_size) - len(seq.block_table)
            while need > self.allocator.num_free and queue:
                self._preempt(queue.pop())
            if need > self.allocator.num_free:
                self._preempt(seq)
                continue
            if need > 0:
                seq.block_table += self.allocator.allocate(need)
            kept.append(seq)
        self.running = kept
        return bool(kept)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _plan(self, seqs: list[Sequence], is_prefill: bool) -> tuple[StepPlan, list[Sequence]]:
        loads = []
        if self.adapters is not None:
            names = {s.adapter for s in self.running if s.adapter}
            loads = self.adapters.assign_slots(names) if names else []
        slot_of = self.adapters.slot_of if self.adapters is not None else (lambda _: -1)
        seqs = sorted(seqs, key=lambda s: slot_of(s.adapter))   # one LoRA segment per adapter
        plan = StepPlan(is_prefill=is_prefill, input_ids=[], positions=[], seq_lens=[], block_tables=[],
                        lora_slots=[], lora_loads=loads)
        for seq in seqs:
            if is_prefill:
                plan.input_ids += seq.token_ids
                plan.positions += range(len(seq))
                plan.seq_lens.append(len(seq))
            else:
                plan.input_ids.append(seq.token_ids[-1])
                plan.positions.append(len(seq) - 1)
                plan.seq_lens.append(len(seq))
            p = seq.params
            plan.block_tables.append(list(seq.block_table))
            plan.lora_slots.append(slot_of(seq.adapter))
            plan.temperatures.append(p.temperature)
            plan.top_ks.append(p.top_k)
            plan.top_ps.append(p.top_p)
            plan.seeds.append(seq.seed)
            plan.steps.append(len(seq.output_token_ids))
        return plan, seqs

    # ---- after a step ----------------------------------------------------
    def append_tokens(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float],
                      eos_token_ids: set[int]) -> None:
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            seq.output_token_ids.append(token)
            seq.logprobs.append(logprob)
            p = seq.params
            if token in p.stop_token_ids or (token in eos_token_ids and not p.ignore_eos):
                self.finish(seq, "stop")
            elif len(seq.output_token_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
                self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error

    def _release(self, seq: Sequence) -> None:
        self.allocator.release(seq.block_table)
        seq.block_table = []
        if seq.adapter:
            self.adapters.release(seq.adapter)
