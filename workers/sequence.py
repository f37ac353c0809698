"""A request's state inside the engine, and the outputs handed back to callers."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from lora.ref import AdapterRef
from workers.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)   # identity: queues remove a sequence by identity, not by comparing token lists
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    adapter: str | None = None
    # the adapter version it runs on (lora/ref.py), held from admission to its end, preemption included
    adapter_ref: AdapterRef | None = field(default=None, init=False)
    arrival_step: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    queue_time: float | None = None       # seconds from arrival to its first admission (vLLM's queued time)
    status: Status = Status.WAITING
    token_ids: list[int] = field(init=False)   # prompt then outputs, appended in place (no copy per step)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)   # when params.top_logprobs
    prompt_logprobs: list = field(default_factory=list)  # [i]: (logprob, alternatives) of prompt token i; [0] None
    block_table: list[int] = field(default_factory=list)
    sampler_slot: int = -1                # its row of the workers' SamplerState while running
    num_computed_tokens: int = 0          # tokens whose KV is in the cache (computed or a prefix-cache hit)
    num_cached_tokens: int = 0            # of the prompt, found in the prefix cache at the last admission
    block_hashes: list[bytes] = field(default_factory=list)   # hash chain of its full blocks (block_pool)
    hash_root: bytes | None = None        # the chain `block_hashes` extend: the weights they were computed under
    num_registered_blocks: int = 0        # leading full blocks already offered to the prefix cache
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_preemptions: int = 0
    lora_skips: int = 0                   # admissions that passed it over for lack of a LoRA slot
    num_reported: int = 0                 # output tokens already handed out in a delta
    # its grammar position (workers/grammar.py) when params.structured: advanced with every token it keeps,
    # so it survives preemption (the recompute samples nothing it has already accepted)
    matcher: object | None = None

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.params.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model; 1 for a decoding sequence (its newest token)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    # ---- a step's output (workers/controller.py Controller.complete) ------
    def add_prompt_logprobs(self, entries: list[tuple[float, list[tuple[int, float]]]]) -> None:
        """(logprob, alternatives) of the prompt tokens a chunk predicted, from its first uncomputed one on."""
        start = self.num_computed_tokens
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)   # the first prompt token has no context to score it
        for j, (logprob, top) in enumerate(entries):
            if len(self.prompt_logprobs) == start + 1 + j:   # recomputed after preemption: kept once
                self.prompt_logprobs.append((logprob, top[:self.params.prompt_logprobs]))

    def take_token(self, token: int, logprob: float, top_logprobs: list[tuple[int, float]] | None,
                   eos_token_ids: frozenset, max_model_len: int) -> tuple[str, str | None] | None:
        """Keep a sampled token (its grammar advanced); returns (finish_reason, error) if it ends the sequence:
        its grammar refused it, a stop or EOS token, or a length limit (vLLM's check_stop)."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        p = self.params   # (min_tokens: the sampler held the stop tokens back until it was reached)
        if p.top_logprobs:
            self.top_logprobs.append(top_logprobs[:p.top_logprobs])
        if self.matcher is not None and not self.matcher.accept(token):   # the mask allowed it: never expected
            return "error", f"token {token} does not fit the {p.structured.field} grammar"
        if token in self.stop_token_ids or (token in eos_token_ids and not p.ignore_eos):
            return "stop", None
        if self.num_output_tokens >= p.max_tokens or len(self) >= max_model_len:
            return "length", None
        return None


@dataclass
class TokenDelta:
    """What one step did to one request: its new tokens (at most one a step), or its end."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finish_reason: str | None
    error: str | None = None
    num_cached_tokens: int = 0
    new_top_logprobs: list[list[tuple[int, float]]] | None = None   # when the request asked for them
    prompt_logprobs: list | None = None                              # once, with the first token
    queue_time: float | None = None                                  # once admitted (Sequence.queue_time)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, seq: Sequence) -> TokenDelta:
        first, done = seq.num_reported, seq.num_output_tokens
        seq.num_reported = done
        p = seq.params
        return cls(seq.request_id, seq.token_ids[seq.num_prompt_tokens + first:], seq.logprobs[first:],
                   seq.finish_reason, seq.error, seq.num_cached_tokens,
                   seq.top_logprobs[first:] if p.top_logprobs else None,
                   seq.prompt_logprobs if first == 0 and p.prompt_logprobs is not None else None, seq.queue_time)


@dataclass
class RequestOutput:
    """A request's output. Cumulative (everything so far) unless it says it is a delta (new tokens and text
    only, from `AsyncLLMEngine.generate(..., delta=True)`)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None
    adapter: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    top_logprobs: list[list[tuple[int, float]]] | None = None   # per token: (id, logprob) of the likeliest
    prompt_logprobs: list | None = None   # per prompt token: (logprob, alternatives); the first is None
    queue_time: float | None = None       # seconds it waited for its first admission in the engine

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
