"""Continuous batching: queues, KV admission and preemption, the LoRA budget, StepPlans.

A step carries every running decode (one token each) and then prefill chunks,
up to `max_num_batched_tokens` tokens in all: partially prefilled sequences
continue first, then waiting ones are admitted (chunked prefill; with it off a
prompt is only admitted when it fits whole). Admission takes KV blocks for the
whole prompt at once, after reusing the longest cached prefix (block_pool.py),
so a prompt in progress never waits for blocks. The LoRA budget
(max_loras_per_batch distinct adapters among running sequences; the base
model needs none) rotates among adapters by age (workers/lora_budget.py):
room goes to the adapter that has waited longest, and one that has waited
`lora_max_wait_steps` steps takes the place of the adapter that entered it
last, whose sequences pause (keeping their KV) until their turn; waiting
requests are admitted in arrival order, each whose adapter has room. When decode runs out of KV blocks the youngest
sequence is preempted; it is recomputed later from its prompt and
the tokens it already has (its blocks stay cached, so mostly hits). A step's
choice is a `Batch`; workers/plan.py turns it into the StepPlan.
"""
from __future__ import annotations

import time
from collections import deque

from lora.errors import AdapterError
from lora.ref import AdapterRef
from workers.adapters import AdapterManager
from workers.block_pool import BlockPool
from workers.config import EngineConfig
from workers.kv_cache import blocks_needed
from workers.lora_budget import LoRABudget
from workers.plan import Batch, StepOutput
from workers.sequence import Sequence, Status


class Controller:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                 max_num_batched_tokens: int, adapters: AdapterManager | None, eos_token_ids: frozenset = frozenset()):
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.free_sampler_slots = list(range(config.max_num_seqs - 1, -1, -1))   # one per running sequence
        self.block_size = config.kv_block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.blocks = BlockPool(num_kv_blocks, config.enable_prefix_caching)
        self.adapters = adapters
        self.budget = LoRABudget(config.max_loras_per_batch, config.lora_max_wait_steps, adapters)
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
    def schedule(self) -> Batch | None:
        """The step's sequences (with their new tokens, in plan order) and LoRA slots; None when nothing can run."""
        self.step_count += 1
        self._new_sampler_slots: list[Sequence] = []
        budget = self.max_num_batched_tokens
        self._reserve_decode_blocks()
        holders = self.budget.rotate(self.running, self.waiting, self._lora_id, self._can_start, self.step_count)
        runnable = [seq for seq in self.running if not self.budget.is_paused(seq)]
        decodes = [(seq, 1) for seq in runnable if seq.num_uncomputed == 1]
        budget -= len(decodes)
        chunks = []
        for seq in runnable:
            if seq.num_uncomputed > 1 and budget > 0:
                n = min(seq.num_uncomputed, budget)
                chunks.append((seq, n))
                budget -= n
        for seq, n in decodes + chunks:   # offered before the step runs: see BlockPool.cache_full_blocks
            self.blocks.cache_full_blocks(seq, seq.num_computed_tokens + n, self.block_size)
        admitted = self._admit(budget, holders)
        self.running.extend(seq for seq, _ in admitted)
        scheduled = decodes + chunks + admitted
        return self._batch(scheduled) if scheduled else None

    def _reserve_decode_blocks(self) -> None:
        """Room for the next token of every decoding sequence, preempting the youngest if blocks run out."""
        kept: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            need = blocks_needed(len(seq), self.block_size) - len(seq.block_table)
            while need > self.blocks.num_free and queue:
                self._preempt(queue.pop())
            if need > self.blocks.num_free:
                self._preempt(seq)
                continue
            if need > 0:
                seq.block_table += self.blocks.allocate(need)
            kept.append(seq)
        self.running = kept

    def _admit(self, budget: int, holders: set[str]) -> list[tuple[Sequence, int]]:
        """Start waiting requests in `_admission_order` while their adapter holds the budget or finds room in it."""
        admitted: list[tuple[Sequence, int]] = []
        for seq in self._admission_order():
            if budget <= 0 or len(self.running) + len(admitted) >= self.config.max_num_seqs:
                break
            lora = self._lora_id(seq)
            if lora and not self.budget.fits(lora, holders):
                continue
            started = self._start(seq, budget)
            if started is None:
                break                            # out of KV blocks (or, unchunked, of tokens): keep FCFS order
            if started == 0:
                continue                         # its adapter is loading (or failed)
            if seq.adapter and seq.adapter_ref not in holders:
                self.budget.enter(seq.adapter_ref, holders, self.step_count)
            seq.lora_skips = 0
            admitted.append((seq, started))
            budget -= started
            self.blocks.cache_full_blocks(seq, seq.num_computed_tokens + started, self.block_size)
        paused = [seq for seq in self.running if self.budget.is_paused(seq)]
        self.budget.count_skips((*self.waiting, *paused), holders, self._lora_id)
        return admitted

    def _admission_order(self) -> list[Sequence]:
        """Waiting requests in the order admission tries them: arrival order, as vLLM's scheduler, each skipped
        while its adapter has no room. Which adapters have room the budget's rotation chose at the step's start,
        oldest first; a free place goes to the oldest request that fits. (Trying the running adapters' requests
        first starved the others: while a busy adapter kept a queue, a request of an adapter with room in the
        budget waited for places without end, its wait counted nowhere.)"""
        return list(self.waiting)

    def _start(self, seq: Sequence, budget: int) -> int | None:
        """Admit `seq`: adapter reference, cached prefix, blocks. Returns its first chunk's size, 0 when its
        adapter is not ready, None when it does not fit now."""
        held = seq.adapter_ref is not None   # preempted: it keeps the version it started on
        if seq.adapter and not held and not self._acquire_adapter(seq):
            return 0
        hit = self.blocks.match_prefix(seq, self.block_size)
        cached = len(hit) * self.block_size
        need = blocks_needed(len(seq), self.block_size) - len(hit)
        if (need > self.blocks.num_free_after_taking(hit)
                or (not self.chunked_prefill and len(seq) - cached > budget)):
            if seq.adapter and not held:
                self._release_adapter(seq)   # not started: the next try takes the version current then
            return None
        self.blocks.take(hit)
        seq.block_table = hit + self.blocks.allocate(need)
        seq.num_computed_tokens = cached
        seq.num_registered_blocks = len(hit)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached
            seq.queue_time = time.monotonic() - seq.arrival_time
            self.blocks.record_query(len(seq), cached)
        seq.status = Status.RUNNING
        seq.sampler_slot = self.free_sampler_slots.pop()
        self._new_sampler_slots.append(seq)
        self.waiting.remove(seq)
        return min(len(seq) - cached, budget)

    def _can_start(self, seq: Sequence) -> bool:
        """Whether `seq` could start now: a sampler row, KV blocks for its whole prompt (prefix hits not counted)
        and its adapter in host memory (else its load starts)."""
        if len(self.running) >= self.config.max_num_seqs or \
                blocks_needed(len(seq), self.block_size) > self.blocks.num_free:
            return False
        try:
            return self.adapters.ensure(self._lora_id(seq))
        except AdapterError as exc:   # unloaded while it waited, or its load failed (reported once): as admission
            self._fail_waiting(seq, exc)
            return False

    def _lora_id(self, seq: Sequence) -> AdapterRef | str | None:
        """The adapter version `seq` runs on (or would, admitted now): what takes a slot (its name: unloaded)."""
        if seq.adapter is None:
            return None
        return seq.adapter_ref or self.adapters.current(seq.adapter) or seq.adapter

    def _acquire_adapter(self, seq: Sequence) -> bool:
        """Hold the current version of the request's adapter (AdapterManager.acquire_current) to its end."""
        try:
            seq.adapter_ref = self.adapters.acquire_current(seq.adapter)
        except AdapterError as exc:
            self._fail_waiting(seq, exc)
            return False
        return seq.adapter_ref is not None

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter_ref is not None:
            self.adapters.release(seq.adapter_ref)
            seq.adapter_ref = None

    def _fail_waiting(self, seq: Sequence, exc: Exception) -> None:
        self.waiting.remove(seq)
        self._release_adapter(seq)
        seq.error = str(exc)
        seq.finish_reason = "error"
        seq.status = Status.FINISHED
        self.errored.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _batch(self, scheduled: list[tuple[Sequence, int]]) -> Batch:
        loads, expert_slots = [], {}
        if self.adapters is not None:
            # slots of chunks in progress stay too; paused adapters' may go to others
            refs = {s.adapter_ref for s in self.running if s.adapter and not self.budget.is_paused(s)}
            loads, expert_slots = self.adapters.assign_slots(refs) if refs else ([], {})
        slot_of = self.adapters.slot_of if self.adapters is not None else (lambda _: -1)
        # Decodes first, then chunks; within each, by slot: one LoRA segment per adapter.
        scheduled.sort(key=lambda item: (item[1] > 1 or item[0].num_uncomputed > 1, slot_of(item[0].adapter_ref)))
        return Batch(scheduled, slot_of, loads, expert_slots, self._new_sampler_slots)

    # ---- after a step ----------------------------------------------------
    def complete(self, scheduled: list[tuple[Sequence, int]], out: StepOutput) -> list[Sequence]:
        """Record a step's work: computed tokens, prompt logprobs, sampled tokens and stop conditions.
        Returns the sequences that produced a token."""
        row = 0
        produced = []
        samples = [seq.num_computed_tokens + n >= len(seq) for seq, n in scheduled]   # which rows hold a token
        for ref, error in out.failed_adapters.items():   # before any token of theirs is kept
            self.fail_adapter(ref, error)
        for i, (seq, n) in enumerate(scheduled):
            if seq.is_finished:   # failed with its adapter: its row (if any) is skipped
                row += samples[i]
                continue
            if out.prompt_logprobs and out.prompt_logprobs[i] is not None:
                seq.add_prompt_logprobs(out.prompt_logprobs[i])   # before its computed tokens move on
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < len(seq):
                continue                          # a chunk of a longer prompt: nothing sampled yet
            stop = seq.take_token(out.tokens[row], out.logprobs[row],
                                  out.top_logprobs[row] if seq.params.top_logprobs else None,
                                  self.eos_token_ids, self.max_model_len)
            row += 1
            produced.append(seq)
            if stop is not None:
                self.finish(seq, *stop)
        return produced

    def fail_adapter(self, ref: AdapterRef, error: str) -> None:
        """An adapter version a rank could not install: its requests end with `error`, its slot is given up
        (the next request for it loads it again), every other request carries on."""
        for seq in [s for s in (*self.running, *self.waiting) if self._lora_id(s) == ref]:
            self.finish(seq, "error", error=error)
            self.errored.append(seq)
        self.adapters.forget_slot(ref)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting.remove(seq)
        self._release_adapter(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.free_sampler_slots.append(seq.sampler_slot)
        seq.sampler_slot = -1   # (its adapter version is held until it finishes, preempted or not)
