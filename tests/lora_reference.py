"""Slow, obvious references for the LoRA ops, and random slot buffers in the shared layout.

Layout (L slots, R = max_rank): a [L, stack*R, in] with slice s of slot l at rows
[s*R, (s+1)*R); b = (b[0], ..., b[stack-1]), b[s] [L, out_s, R]; offsets the cumulative
out sizes. Rows of a and columns of b past a slot's rank are zero. Slot -1 is the base model.
Embedding: a [L, vocab, R], b [L, hidden, R].
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

POPULARITY = ("distinct", "uniform", "zipf", "identical", "mixed_ranks", "base_mixed")


def ref_add_lora(y, x, a, b, offsets, token_slots) -> torch.Tensor:
    """y[t, offsets[s]:offsets[s+1]] += b[s][l] @ (a[l, s*R:(s+1)*R] @ x[t]), token by token in float64."""
    R = a.shape[1] // len(b)
    for t, slot in enumerate(int(v) for v in token_slots):
        if slot < 0:
            continue
        for s, b_s in enumerate(b):
            h = a[slot, s * R:(s + 1) * R].double() @ x[t].double()
            y[t, offsets[s]:offsets[s + 1]] += (b_s[slot].double() @ h).to(y.dtype)
    return y


def ref_add_embedding_lora(y, ids, a, b, token_slots) -> torch.Tensor:
    """y[t] += b[l] @ a[l, ids[t]], token by token in float64."""
    for t, slot in enumerate(int(v) for v in token_slots):
        if slot >= 0:
            y[t] += (b[slot].double() @ a[slot, int(ids[t])].double()).to(y.dtype)
    return y


def slot_ranks(pattern: str, num_slots: int, max_rank: int, gen: torch.Generator) -> list[int]:
    """Random ranks in [1, max_rank]; "mixed_ranks" spreads them from 1 to max_rank on purpose."""
    if pattern == "mixed_ranks":
        spread = itertools.cycle([1, max_rank, max(1, max_rank // 2), 2, max_rank - 1, 3])
        return [next(spread) for _ in range(num_slots)]
    return torch.randint(1, max_rank + 1, (num_slots,), generator=gen).tolist()


def assign_slots(pattern: str, seq_lens: list[int], num_slots: int, gen: torch.Generator) -> list[int]:
    """One slot per sequence (repeated for each of its tokens), by adapter popularity pattern."""
    n = len(seq_lens)
    if pattern in ("distinct", "mixed_ranks"):
        per_seq = [i % num_slots for i in range(n)]
    elif pattern == "uniform":
        per_seq = torch.randint(0, num_slots, (n,), generator=gen).tolist()
    elif pattern == "zipf":
        weights = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.5
        per_seq = torch.multinomial(weights, n, replacement=True, generator=gen).tolist()
    elif pattern == "identical":
        per_seq = [num_slots - 1] * n  # not slot 0: a clamp-to-0 bug must not pass
    elif pattern == "base_mixed":
        per_seq = torch.randint(0, num_slots, (n,), generator=gen).tolist()
        base = torch.rand(n, generator=gen) < 0.4
        per_seq = [-1 if is_base else s for s, is_base in zip(per_seq, base.tolist())]
        per_seq[0] = -1
        if n > 1:
            per_seq[1] = num_slots // 2
    else:
        raise ValueError(f"unknown popularity pattern {pattern!r}")
    return [slot for slot, length in zip(per_seq, seq_lens) for _ in range(length)]


def make_linear_buffers(ranks: list[int], max_rank: int, in_dim: int, out_sizes: tuple[int, ...],
                        dtype: torch.dtype, gen: torch.Generator):
    """(a, b, offsets) in the shared layout; every slot holds random weights up to its rank."""
    num_slots, stack = len(ranks), len(out_sizes)
    a = torch.randn(num_slots, stack * max_rank, in_dim, generator=gen) / in_dim ** 0.5
    b = [torch.randn(num_slots, out, max_rank, generator=gen) / max_rank ** 0.5 for out in out_sizes]
    for slot, rank in enumerate(ranks):
        for s in range(stack):
            a[slot, s * max_rank + rank:(s + 1) * max_rank] = 0
            b[s][slot, :, rank:] = 0
    offsets = tuple(itertools.accumulate(out_sizes, initial=0))
    return a.to(dtype), tuple(b_s.to(dtype) for b_s in b), offsets


def make_embedding_buffers(ranks: list[int], max_rank: int, vocab: int, hidden: int, dtype: torch.dtype,
                           gen: torch.Generator):
    """(a [L, vocab, R], b [L, hidden, R]) with columns past each slot's rank zero."""
    a = torch.randn(len(ranks), vocab, max_rank, generator=gen)
    b = torch.randn(len(ranks), hidden, max_rank, generator=gen) / max_rank ** 0.5
    for slot, rank in enumerate(ranks):
        a[slot, :, rank:] = 0
        b[slot, :, rank:] = 0
    return a.to(dtype), b.to(dtype)


@dataclass
class LoRACase:
    x: torch.Tensor             # [T, in]
    y: torch.Tensor             # [T, offsets[-1]], random: the op adds to it
    a: torch.Tensor
    b: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    token_slots: list[int]
    ranks: list[int]
    max_rank: int


def make_lora_case(pattern: str, seq_lens: list[int], out_sizes: tuple[int, ...], *, num_slots: int = 8,
                   max_rank: int = 8, in_dim: int = 64, dtype: torch.dtype = torch.float32,
                   seed: int = 0) -> LoRACase:
    gen = torch.Generator().manual_seed(seed)
    ranks = slot_ranks(pattern, num_slots, max_rank, gen)
    a, b, offsets = make_linear_buffers(ranks, max_rank, in_dim, out_sizes, dtype, gen)
    token_slots = assign_slots(pattern, seq_lens, num_slots, gen)
    T = len(token_slots)
    x = torch.randn(T, in_dim, generator=gen).to(dtype)
    y = torch.randn(T, offsets[-1], generator=gen).to(dtype)
    return LoRACase(x, y, a, b, offsets, token_slots, ranks, max_rank)


class OpLog(TorchDispatchMode):
    """The names of the ops that ran inside (e.g. "loraserve::sgmv_add"): which kernel a call reached."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))
