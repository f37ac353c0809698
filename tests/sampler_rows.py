"""Sampler rows for the tests that drive workers/sampler.py directly: each row's SamplingParams written at
admission as the engine writes them (SamplerState.admit), then one step's tensors (SamplerState.tensors)."""
from __future__ import annotations

from workers.config import SamplingParams
from workers.plan import SamplerInit
from workers.sampler import SamplerState, SamplingTensors

# every sampler option at once: the processors, min-p, top-k / top-p, top logprobs
EVERYTHING = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                  repetition_penalty=1.2, min_tokens=4, logit_bias={3: 5.0, 7: -100.0}, top_logprobs=3)


def step_rows(params: SamplingParams, seeds: list[int], vocab: int, steps: list[int] | None = None,
              state: SamplerState | None = None, use_grammar: bool = False) -> tuple[SamplingTensors, SamplerState]:
    """Rows 0..len(seeds)-1 under `params` (row i seeded seeds[i]), drawing token `steps[i]` (default 0)."""
    n = len(seeds)
    state = state or SamplerState(n, vocab, max(1, len(params.logit_bias or {})), "cpu")
    state.admit([SamplerInit(i, params, seed, [], [], []) for i, seed in enumerate(seeds)])
    return state.tensors(list(range(n)), steps or [0] * n, use_grammar), state
