"""The StepPlan: what every worker executes in one step (small, picklable, host data only)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepPlan:
    """One step's sequences, decodes first (one token each), then prefill chunks.

    Sequence i feeds `query_lens[i]` new tokens at positions `seq_lens[i] - query_lens[i]` ..
    `seq_lens[i] - 1`; the KV of the positions before them is already in its blocks. Only the
    sequences with `samples[i]` (their last prompt token or a decode) produce a token; the
    sampling lists hold one entry per such sequence, in order.
    """
    input_ids: list[int]            # every sequence's new tokens, packed
    positions: list[int]
    query_lens: list[int]           # new tokens per sequence
    seq_lens: list[int]             # context length after this step (cached + new)
    block_tables: list[list[int]]
    lora_slots: list[int]           # per seq, -1 = base model
    # (slot, adapter, source, load id) to load first; the load id names the controller's read of the
    # files, so a rank's own copy keyed by it is re-read whenever the controller's was
    lora_loads: list[tuple[int, str, str, int]] = field(default_factory=list)
    lora_expert_slots: dict[int, int] = field(default_factory=dict)   # slot -> expert slot, loads with experts
    samples: list[bool] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)   # index of the token each sampled seq draws now
    sampler_slots: list[int] = field(default_factory=list)   # its row of the workers' SamplerState
    min_ps: list[float] = field(default_factory=list)
    penalties: list[tuple[float, float, float]] = field(default_factory=list)   # presence, frequency, repetition
    hold_stops: list[bool] = field(default_factory=list)    # min_tokens not reached: no stop token yet
    top_logprobs: list[int] = field(default_factory=list)
    use_bias: bool = False
    # (slot, prompt ids, output ids, stop ids, logit bias) for each sequence taking a sampler slot now;
    # ids a request's options do not need are left empty (host data stays small)
    sampler_inits: list[tuple[int, list[int], list[int], list[int], dict]] = field(default_factory=list)
    # per sequence: the prompt tokens its new tokens' logits are scored against (prompt logprobs), or None
    prompt_logprob_targets: list[list[int] | None] = field(default_factory=list)
    num_prompt_logprobs: int = 0                     # alternatives per prompt token (the most any seq asked)
    # grammar-constrained sampled rows (indices into the sampling lists) and their token bitmasks
    # [len(grammar_rows), ceil(vocab / 32)] int32, filled by the controller from each sequence's matcher
    grammar_rows: list[int] = field(default_factory=list)
    token_bitmask: object = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return any(t is not None for t in self.prompt_logprob_targets)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

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
class StepOutput:
    """What rank 0 sends back: per sampled sequence its token, logprob and top alternatives; per sequence
    that asked, (logprob, alternatives) of each prompt token its new tokens predicted."""
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None] | None = None
    # adapter -> why this rank could not install it into its slot (its requests fail, nothing else does)
    failed_adapters: dict[str, str] = field(default_factory=dict)
