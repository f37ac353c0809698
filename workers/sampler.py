"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Randomness is a counter-based hash of (request seed, token index, vocab id),
so a request's samples never depend on what else is in the batch or on a
global generator, and the whole sampler is fixed-shape tensor code with no host
sync (it can run inside a captured graph).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor   # [B] fp32, 0 = greedy
    top_ks: torch.Tensor         # [B] int64, vocab size = off
    top_ps: torch.Tensor         # [B] fp32
    seeds: torch.Tensor          # [B] int64 (< 2**32)
    steps: torch.Tensor          # [B] int64, index of the token being sampled
    needs_sorting: bool          # host flag: any row uses top-k or top-p
    all_greedy: bool = False     # host flag: every row has temperature 0

    @classmethod
    def from_lists(cls, temperatures, top_ks, top_ps, seeds, steps, vocab_size: int, device) -> SamplingTensors:
        ks = [vocab_size if k <= 0 else min(k, vocab_size) for k in top_ks]
        return cls(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_ks=torch.tensor(ks, dtype=torch.int64, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            seeds=torch.tensor([s & _MASK32 for s in seeds], dtype=torch.int64, device=device),
            steps=torch.tensor(steps, dtype=torch.int64, device=device),
            needs_sorting=any(k < vocab_size for k in ks) or any(p < 1.0 for p in top_ps),
            all_greedy=all(t == 0 for t in temperatures))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors; products wrap, the mask keeps 32 bits."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[b, v] in (0, 1), a pure function of (seeds[b], steps[b], v)."""
    row = _mix32(_mix32(seeds) ^ (steps * 0x9E3779B1))
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(row[:, None] ^ _mix32(vocab + 0x632BE5AB)[None, :])
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def _filter_top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    cumulative = sorted_probs.cumsum(dim=-1)
    drop = (rank >= top_ks[:, None]) | ((cumulative - sorted_probs) > top_ps[:, None])
    drop[:, 0] = False                              # always keep the most likely token
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample(logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B] and the logprob of each under the model's (untempered) distribution."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        # The noise hash over [B, vocab] int64 (~20 ms a step at batch 32 on CPU, more than the
        # LM head) is ignored by greedy rows; the host flag (from the plan, no sync) skips it,
        # and the chosen token's logprob needs only logsumexp, not a [B, vocab] log_softmax.
        chosen = logits.gather(-1, greedy[:, None]).squeeze(-1)
        return greedy, chosen - torch.logsumexp(logits, dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1)
    temperature = torch.where(t.temperatures > 0, t.temperatures, torch.ones_like(t.temperatures))
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    if t.needs_sorting:
        probs = _filter_top_k_top_p(probs, t.top_ks, t.top_ps)
    # Exponential race: argmax p / E with E ~ Exp(1) draws from p (Gumbel-max in another form).
    exponential = -torch.log(uniform_noise(t.seeds, t.steps, logits.shape[-1]))
    sampled = (probs / exponential).argmax(dim=-1)
    tokens = torch.where(t.temperatures > 0, sampled, greedy)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
