"""The StepPlan: what every worker executes in one step (small, picklable, host data only), and the one
place a plan is built from the sequences the scheduler chose (`PlanBuilder`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from lora.ref import AdapterRef
from workers.config import SamplingParams
from workers.grammar import bitmask_width

if TYPE_CHECKING:
    from workers.sequence import Sequence


@dataclass
class SamplerInit:
    """A sequence taking a sampler slot (admitted, or admitted again after preemption): the workers write its
    sampling parameters and history into that row once (workers/sampler.py); steps then name only the slot.
    Ids a request's options do not need are left empty (host data stays small)."""
    slot: int
    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: list[int]


@dataclass
class StepPlan:
    """One step's sequences, decodes first (one token each), then prefill chunks.

    Sequence i feeds `query_lens[i]` new tokens at positions `seq_lens[i] - query_lens[i]` ..
    `seq_lens[i] - 1`; the KV of the positions before them is already in its blocks. Only the
    sequences with `samples[i]` (their last prompt token or a decode) produce a token; `sampler_slots`
    and `steps` hold one entry per such sequence, in order.
    """
    input_ids: list[int]            # every sequence's new tokens, packed
    positions: list[int]
    query_lens: list[int]           # new tokens per sequence
    seq_lens: list[int]             # context length after this step (cached + new)
    block_tables: list[list[int]]
    lora_slots: list[int]           # per seq, -1 = base model
    lora_loads: list[tuple[int, AdapterRef]] = field(default_factory=list)   # (slot, adapter version) to load first
    lora_expert_slots: dict[int, int] = field(default_factory=dict)   # slot -> expert slot, loads with experts
    samples: list[bool] = field(default_factory=list)
    sampler_slots: list[int] = field(default_factory=list)   # each sampled seq's row of the workers' SamplerState
    steps: list[int] = field(default_factory=list)           # index of the token each sampled seq draws now
    sampler_inits: list[SamplerInit] = field(default_factory=list)   # rows (re)written before the step
    # per sequence: the prompt tokens its new tokens' logits are scored against (prompt logprobs), or None
    prompt_logprob_targets: list[list[int] | None] = field(default_factory=list)
    num_prompt_logprobs: int = 0                     # alternatives per prompt token (the most any seq asked)
    # grammar-constrained sampled rows (indices into sampler_slots) and their token bitmasks
    # [len(grammar_rows), ceil(vocab / 32)] int32, filled from each sequence's matcher
    grammar_rows: list[int] = field(default_factory=list)
    token_bitmask: object = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return any(t is not None for t in self.prompt_logprob_targets)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_sampled(self) -> int:
        return len(self.sampler_slots)

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds one token and samples: the shape of the captured / graph-safe decode path."""
        return all(n == 1 for n in self.query_lens) and all(self.samples) and not self.wants_prompt_logprobs

    @property
    def num_decode_rows(self) -> int:
        """Leading sequences with one new token (their attention is the decode kernel's)."""
        count = 0
        for n in self.query_lens:
            if n != 1:
                break
            count += 1
        return count


@dataclass
class Batch:
    """What the scheduler chose for a step: (sequence, new tokens) in plan order (decodes first, then chunks;
    by LoRA slot within each), the LoRA slot loads, and the sequences that took a sampler slot now."""
    items: list[tuple[Sequence, int]]
    lora_slot: Callable[[AdapterRef | None], int]    # adapter version -> its slot (-1: the base model)
    lora_loads: list[tuple[int, AdapterRef]] = field(default_factory=list)
    lora_expert_slots: dict[int, int] = field(default_factory=dict)
    admitted: list[Sequence] = field(default_factory=list)


class PlanBuilder:
    """Turns a Batch into the StepPlan the workers execute; holds the host rows the grammar matchers fill
    each step (one per sampled sequence at most), allocated once."""

    def __init__(self, max_num_seqs: int, vocab_size: int):
        self._bitmask = torch.full((max_num_seqs, bitmask_width(vocab_size)), -1, dtype=torch.int32)

    def build(self, batch: Batch, eos_token_ids: frozenset[int]) -> StepPlan:
        plan = StepPlan(input_ids=[], positions=[], query_lens=[], seq_lens=[], block_tables=[], lora_slots=[],
                        lora_loads=batch.lora_loads, lora_expert_slots=batch.lora_expert_slots,
                        sampler_inits=[sampler_init(s, eos_token_ids) for s in batch.admitted])
        for seq, n in batch.items:
            start, p = seq.num_computed_tokens, seq.params
            plan.input_ids += seq.token_ids[start:start + n]
            plan.positions += range(start, start + n)
            plan.query_lens.append(n)
            plan.seq_lens.append(start + n)
            plan.block_tables.append(list(seq.block_table))
            plan.lora_slots.append(batch.lora_slot(seq.adapter_ref))
            targets = None
            if p.prompt_logprobs is not None:   # each new prompt position scores the prompt token after it
                targets = seq.prompt_token_ids[start + 1:min(start + n + 1, seq.num_prompt_tokens)]
                plan.num_prompt_logprobs = max(plan.num_prompt_logprobs, p.prompt_logprobs)
            plan.prompt_logprob_targets.append(targets)
            samples = start + n == len(seq)
            plan.samples.append(samples)
            if samples:
                if seq.matcher is not None:
                    seq.matcher.fill_bitmask(self._bitmask, len(plan.grammar_rows))
                    plan.grammar_rows.append(len(plan.sampler_slots))
                plan.sampler_slots.append(seq.sampler_slot)
                plan.steps.append(seq.num_output_tokens)
        if plan.grammar_rows:   # a copy: the rows are refilled next step, the plan may still be in flight
            plan.token_bitmask = self._bitmask[:len(plan.grammar_rows)].clone()
        return plan


def sampler_init(seq: Sequence, eos_token_ids: frozenset[int]) -> SamplerInit:
    p = seq.params
    return SamplerInit(seq.sampler_slot, p, seq.seed,
                       list(seq.prompt_token_ids) if p.repetition_penalty != 1.0 else [], seq.output_token_ids,
                       sorted(seq.stop_token_ids | eos_token_ids) if p.min_tokens else [])


@dataclass
class StepOutput:
    """What rank 0 sends back: per sampled sequence its token, logprob and top alternatives; per sequence
    that asked, (logprob, alternatives) of each prompt token its new tokens predicted."""
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None] | None = None
    # adapter version -> why this rank could not install it into its slot (its requests fail, nothing else does)
    failed_adapters: dict[AdapterRef, str] = field(default_factory=dict)
