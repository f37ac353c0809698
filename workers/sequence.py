"""A request's state inside the engine, and the output handed back to callers."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from workers.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    adapter: str | None = None
    arrival_step: int = 0
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_preemptions: int = 0
    lora_skips: int = 0                   # times passed over for lack of a LoRA slot

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None
    adapter: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, seq: Sequence) -> RequestOutput:
        return cls(seq.request_id, list(seq.prompt_token_ids), list(seq.output_token_ids), seq.text,
                   list(seq.logprobs), seq.finish_reason, seq.adapter, seq.error)
