"""Batched sampling: logit processors, greedy / temperature / min-p / top-k / top-p, seeds, logprobs.

Randomness is a counter-based hash of (request seed, token index, vocab id),
so a request's samples never depend on what else is in the batch or on a
global generator, and the whole sampler is fixed-shape tensor code with no host
sync (it can run inside a captured graph). A sequence's sampling parameters
and history (the penalties' token counts, the logit bias, the tokens
min_tokens holds back) live in fixed device rows indexed by its sampler slot
(SamplerState), written once when it takes the slot: a step sends only the
slots and token indices, and no step builds tensors from SamplingParams.

Order, as vLLM's: min_tokens and logit_bias on the raw logits, then the
repetition / frequency / presence penalties, then the grammar's token bitmask
(SamplerState.token_bitmask: rows the runner copies in from the plan each step,
unpacked with fixed-shape ops), then temperature, min-p, top-k, top-p.
Returned logprobs (the sampled token's and the top alternatives) are of the raw
distribution, before any of these (vLLM's default `raw_logprobs`); a step none of whose rows asks for them
(SamplingParams.logprobs False, no top_logprobs) computes none (a logsumexp over the vocabulary, ~1 ms at
batch 32) and returns NaN for each. Greedy argmax runs on cpu_ops.c's kernel (torch's own: ~1 ms at batch
32), on the logits in the model's dtype: a step of greedy rows without processors or logprobs never widens
them to fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from lora.transfer import to_device
from workers import cpu_ops
from workers.plan import SamplerInit

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    """One step's view of the sampled rows (SamplerState.tensors): device columns gathered from the rows
    written at admission, and host flags that let the sampler skip what no row uses."""
    temperatures: torch.Tensor   # [B] fp32, 0 = greedy
    top_ks: torch.Tensor         # [B] int64, vocab size = off
    top_ps: torch.Tensor         # [B] fp32
    seeds: torch.Tensor          # [B] int64 (< 2**32)
    steps: torch.Tensor          # [B] int64, index of the token being sampled
    needs_sorting: bool          # host flag: any row uses top-k or top-p
    all_greedy: bool = False     # host flag: every row has temperature 0
    min_ps: torch.Tensor | None = None          # [B] fp32; None: no row uses min-p
    slots: torch.Tensor | None = None           # [B] int64 sampler slots (the rows of SamplerState)
    penalties: torch.Tensor | None = None       # [B, 3] fp32 presence, frequency, repetition
    hold_stops: torch.Tensor | None = None      # [B] bool: min_tokens not reached yet
    use_bias: bool = False
    num_top_logprobs: int = 0                   # host: the most alternatives any row asked for
    use_grammar: bool = False                   # host: rows [0, B) of state.token_bitmask hold this step's masks
    wants_logprobs: bool = True                 # host: some row asked for logprobs (False: none computed)

    @property
    def processes(self) -> bool:
        """Whether any logit processor or grammar mask changes the logits before the draw."""
        return self.hold_stops is not None or self.use_bias or self.penalties is not None or self.use_grammar


class RowFlags(NamedTuple):
    """Host copy of what a row's parameters switch on, so a step decides which ops run without a device read."""
    greedy: bool
    sorts: bool          # top-k or top-p
    min_p: bool
    penalized: bool
    biased: bool
    min_tokens: int
    top_logprobs: int
    logprobs: bool       # the sampled token's logprob (or top alternatives) asked for


# a row's scalars, one per line of SamplerState.floats, then of .ints (so a step's gather of them is contiguous)
_TEMPERATURE, _TOP_P, _MIN_P, _PENALTIES = 0, 1, 2, slice(3, 6)   # presence, frequency, repetition
_TOP_K, _SEED, _MIN_TOKENS = 0, 1, 2


class SamplerState:
    """One row per sampler slot (the controller assigns slots): a sequence's sampling parameters, written once
    when it takes the slot, and its history (token counts, prompt / stop masks, logit bias) in fixed buffers."""

    def __init__(self, num_slots: int, vocab_size: int, max_bias_entries: int, device):
        self.vocab_size = vocab_size
        # per sampled row of a step (not per slot): bit v of row b set = token v allowed; -1 = no constraint
        self.token_bitmask = torch.full((num_slots, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)
        self.floats = torch.zeros(6, num_slots, dtype=torch.float32, device=device)
        self.ints = torch.zeros(3, num_slots, dtype=torch.int64, device=device)
        self.flags: list[RowFlags | None] = [None] * num_slots
        self.output_counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.stop_mask = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.bias_ids = torch.zeros(num_slots, max_bias_entries, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(num_slots, max_bias_entries, dtype=torch.float32, device=device)

    def admit(self, inits: list[SamplerInit]) -> None:
        """Sequences take their slots: every row is rewritten whole (no row keeps what an earlier occupant
        left), the scalars of all of them in one copy per buffer."""
        if not inits:
            return
        device = self.output_counts.device
        as_ids = lambda xs: to_device(xs, device, torch.int64)  # noqa: E731
        slots = as_ids([init.slot for init in inits])
        for history in (self.output_counts, self.prompt_mask, self.stop_mask, self.bias_ids, self.bias_values):
            history.index_fill_(0, slots, 0)
        ks = [_top_k(init.params.top_k, self.vocab_size) for init in inits]
        self.floats.index_copy_(1, slots, to_device(
            [[p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
             for p in (init.params for init in inits)], device, torch.float32).T)
        self.ints.index_copy_(1, slots, as_ids([[k, init.seed & _MASK32, init.params.min_tokens]
                                                for k, init in zip(ks, inits)]).T)
        for k, init in zip(ks, inits):
            p, slot = init.params, init.slot
            self.flags[slot] = RowFlags(p.temperature == 0, k < self.vocab_size or p.top_p < 1.0, p.min_p > 0,
                                        p.uses_penalties, bool(p.logit_bias), p.min_tokens, p.top_logprobs,
                                        p.logprobs or p.top_logprobs > 0)
            if init.output_ids:
                self.output_counts[slot].index_add_(0, as_ids(init.output_ids),
                                                    torch.ones(len(init.output_ids), dtype=torch.int32, device=device))
            for mask, ids in ((self.prompt_mask, init.prompt_ids), (self.stop_mask, init.stop_ids)):
                if ids:
                    mask[slot, as_ids(ids)] = True
            if p.logit_bias:
                n = len(p.logit_bias)
                self.bias_ids[slot, :n] = as_ids(list(p.logit_bias))
                self.bias_values[slot, :n] = to_device(list(p.logit_bias.values()), device, torch.float32)

    def tensors(self, slots: list[int], steps: list[int], use_grammar: bool = False) -> SamplingTensors:
        """The step's sampled rows: `slots[i]` draws its token number `steps[i]`. Two small host copies (the
        slots and steps), the rest gathered on the device."""
        device = self.floats.device
        index, step = to_device(slots, device, torch.int64), to_device(steps, device, torch.int64)
        floats, ints = self.floats.index_select(1, index), self.ints.index_select(1, index)
        flags = [self.flags[slot] for slot in slots]
        holds = any(n < f.min_tokens for n, f in zip(steps, flags))
        return SamplingTensors(
            temperatures=floats[_TEMPERATURE], top_ks=ints[_TOP_K], top_ps=floats[_TOP_P],
            seeds=ints[_SEED], steps=step, needs_sorting=any(f.sorts for f in flags),
            all_greedy=all(f.greedy for f in flags),
            min_ps=floats[_MIN_P] if any(f.min_p for f in flags) else None, slots=index,
            penalties=floats[_PENALTIES].T if any(f.penalized for f in flags) else None,
            hold_stops=step < ints[_MIN_TOKENS] if holds else None, use_bias=any(f.biased for f in flags),
            num_top_logprobs=max(f.top_logprobs for f in flags), use_grammar=use_grammar,
            wants_logprobs=any(f.logprobs for f in flags))

    def load_bitmask(self, num_rows: int, rows: list[int], bitmask: torch.Tensor) -> None:
        """This step's masks: `bitmask[i]` for sampled row `rows[i]`, every other row of [0, num_rows) free."""
        device = self.token_bitmask.device
        target = self.token_bitmask[:num_rows]
        target.fill_(-1)
        target.index_copy_(0, to_device(rows, device, torch.int64), to_device(bitmask, device, torch.int32))

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the sampled tokens (fixed shape: one index_put per step)."""
        self.output_counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


def _top_k(k: int, vocab_size: int) -> int:
    return vocab_size if k <= 0 else min(k, vocab_size)


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
    # (2**24 - 0.5) / 2**24 rounds to 1.0 in fp32: its Exp(1) draw would be 0, and a token of probability 0
    # (masked by a grammar, top-k / top-p / min-p) would win the race as 0 / 0 = NaN
    return (((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp_max(1.0 - 2.0 ** -24)


def apply_processors(logits: torch.Tensor, t: SamplingTensors, state: SamplerState | None) -> torch.Tensor:
    """min_tokens, logit_bias, then the penalties; a new tensor (the raw logits stay for logprobs)."""
    if t.hold_stops is None and not t.use_bias and t.penalties is None:
        return logits
    logits = logits.clone()
    slots = t.slots
    if t.hold_stops is not None:      # min_tokens: the stop tokens cannot be chosen yet
        logits.masked_fill_(state.stop_mask[slots] & t.hold_stops[:, None], float("-inf"))
    if t.use_bias:                    # unused entries add 0 to token 0
        logits.scatter_add_(1, state.bias_ids[slots], state.bias_values[slots])
    if t.penalties is not None:
        presence, frequency, repetition = t.penalties.unbind(1)
        counts = state.output_counts[slots].float()
        seen = state.prompt_mask[slots] | (counts > 0)
        # vLLM's (and HF's) repetition penalty: divide positive logits, multiply negative ones
        repeated = torch.where(logits > 0, logits / repetition[:, None], logits * repetition[:, None])
        logits = torch.where(seen, repeated, logits)
        logits -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
    return logits


_BIT_TABLES: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where the bit of a token is clear (xgrammar's layout: token v is bit v % 32 of word v // 32).

    Read as bytes (little-endian, as every supported host and device is), byte j of a row holds tokens
    8j .. 8j+7 in bit order: one lookup of a [256, 8] table unpacks the row in a single gather."""
    table = _BIT_TABLES.get(logits.device)
    if table is None:
        bits = torch.arange(8, dtype=torch.int32)
        table = ((torch.arange(256, dtype=torch.int32)[:, None] >> bits) & 1).bool()
        table = _BIT_TABLES[logits.device] = to_device(table, logits.device)
    rows = bitmask.contiguous().view(torch.uint8)
    allowed = table.index_select(0, rows.flatten().int()).view(rows.shape[0], -1)[:, :logits.shape[-1]]
    return logits.masked_fill(~allowed, float("-inf"))


def _filter(probs: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if t.min_ps is not None:          # min-p: drop tokens below min_p times the likeliest one's probability
        probs = probs.masked_fill(probs < t.min_ps[:, None] * probs.amax(-1, keepdim=True), 0.0)
    if not t.needs_sorting:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    cumulative = sorted_probs.cumsum(dim=-1)
    top_ps = t.top_ps[:, None] if t.min_ps is None else t.top_ps[:, None] * cumulative[:, -1:]   # of what min-p left
    drop = (rank >= t.top_ks[:, None]) | ((cumulative - sorted_probs) > top_ps)
    drop[:, 0] = False                              # always keep the most likely token
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


@dataclass
class SampleResult:
    tokens: torch.Tensor                 # [B]
    logprobs: torch.Tensor | None        # [B] of each sampled token, raw distribution; None: no row asked
    top_ids: torch.Tensor | None = None  # [B, k] the k likeliest tokens (raw), k = num_top_logprobs
    top_logprobs: torch.Tensor | None = None


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), through the CPU kernel where it applies (the same index: torch's first maximum)."""
    tokens = cpu_ops.argmax(logits)
    return logits.argmax(dim=-1) if tokens is None else tokens


def sample(logits: torch.Tensor, t: SamplingTensors, state: SamplerState | None = None) -> SampleResult:
    """Token ids [B], their logprobs under the model's raw distribution, and the top alternatives. `logits` in
    any float dtype: widened to fp32 where the maths needs it (processors, softmax, logprobs)."""
    if t.all_greedy and not t.processes and not t.wants_logprobs:
        result = SampleResult(argmax(logits), None)   # the argmax of the logits as they are: no fp32 copy
    else:
        result = _sample(logits.float(), t, state)
    if state is not None and t.slots is not None:   # every step: the counts are a sequence's whole output
        state.record(t.slots, result.tokens)
    return result


def _sample(raw: torch.Tensor, t: SamplingTensors, state: SamplerState | None) -> SampleResult:
    logits = apply_processors(raw, t, state)
    if t.use_grammar:
        logits = apply_token_bitmask(logits, state.token_bitmask[:logits.shape[0]])
    greedy = argmax(logits)
    if t.all_greedy:
        # The noise hash over [B, vocab] int64 (~20 ms a step at batch 32 on CPU, more than the
        # LM head) is ignored by greedy rows; the host flag (from the plan, no sync) skips it,
        # and the chosen token's logprob needs only logsumexp, not a [B, vocab] log_softmax.
        tokens = greedy
    else:
        temperature = torch.where(t.temperatures > 0, t.temperatures, torch.ones_like(t.temperatures))
        probs = _filter(torch.softmax(logits / temperature[:, None], dim=-1), t)
        # Exponential race: argmax p / E with E ~ Exp(1) draws from p (Gumbel-max in another form).
        exponential = -torch.log(uniform_noise(t.seeds, t.steps, logits.shape[-1]))
        tokens = torch.where(t.temperatures > 0, argmax(probs / exponential), greedy)
    if not t.wants_logprobs:
        return SampleResult(tokens, None)
    norm = torch.logsumexp(raw, dim=-1)
    result = SampleResult(tokens, raw.gather(-1, tokens[:, None]).squeeze(-1) - norm)
    if t.num_top_logprobs:
        values, ids = raw.topk(t.num_top_logprobs, dim=-1)
        result.top_ids, result.top_logprobs = ids, values - norm[:, None]
    return result
