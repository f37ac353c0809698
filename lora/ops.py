"""The LoRA maths in plain PyTorch, punica style: output first, updated in place. Every backend
(lora/backends/) is tested against these, and falls back to them where its kernels do not apply.

Buffer layout shared with the slot pool and the LoRA layers (L slots, R = max_rank):
    a        [L, stack * R, in]   slice s of slot l is a[l, s*R:(s+1)*R]; rows past the rank are zero
    b[s]     [L, out_s, R]        one contiguous block per slot and slice, scaling folded in;
                                  columns past the rank are zero
    offsets  (stack + 1,)         slice s writes y[:, offsets[s]:offsets[s+1]]
    h        [T, stack * R] fp32  the shrunk activations
    embedding: a [L, vocab, R] (lora_embedding_A transposed), b [L, hidden, R]
Slot -1 (base model) contributes exactly zero, and so do the zero rows / columns past a
slot's rank, so every op may compute all R ranks:

    add_lora:            y[t, offsets[s]:offsets[s+1]] += x[t] @ a[l, s*R:(s+1)*R].T @ b[s][l].T
    add_embedding_lora:  y[t] += a[l, ids[t]] @ b[l].T            with l = info.token_slots[t]

Two forms of each:
- `*_segments`: the eager phases. One pair of GEMMs per adapter present in the step
  (info.plan.groups, built once per step), exactly the size of its tokens.
- `*_masked`: the graph phase. Fixed shapes, no host sync, no data-dependent shapes: reads
  only info.token_slots, computes against every slot and keeps each token's own.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from lora.batch import LoRABatchInfo

def add_lora_rows(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                  offsets: Sequence[int], rows: slice | torch.Tensor) -> None:
    """y[rows, offsets[s]:offsets[s+1]] += x[rows] @ a[s*R:(s+1)*R].T @ b[s].T for one adapter.

    a [stack*R, in], b[s] [out_s, R]; rows a run (slice) or an index tensor. A run
    accumulates in place by addmm_ (one op and one rounding per slice); scattered rows are
    gathered once and their deltas index_add_-ed back.
    """
    R = b[0].shape[1]
    if isinstance(rows, slice):
        h = x[rows] @ a.T
        out = y[rows]
        for s, b_s in enumerate(b):
            out[:, offsets[s]:offsets[s + 1]].addmm_(h[:, s * R:(s + 1) * R], b_s.T)
        return
    h = x.index_select(0, rows) @ a.T
    for s, b_s in enumerate(b):
        y[:, offsets[s]:offsets[s + 1]].index_add_(0, rows, h[:, s * R:(s + 1) * R] @ b_s.T)


def add_lora_segments(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                      offsets: Sequence[int], info: LoRABatchInfo) -> None:
    """y[t, offsets[s]:offsets[s+1]] += x[t] @ a[l, s*R:(s+1)*R].T @ b[s][l].T, adapter by adapter."""
    for group in info.plan.groups:
        add_lora_rows(y, x, a[group.slot], [b_s[group.slot] for b_s in b], offsets, group.rows)


def add_embedding_segments(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           info: LoRABatchInfo) -> None:
    """y[t] += a[l, ids[t]] @ b[l].T, adapter by adapter; a [L, vocab, R], b [L, hidden, R]."""
    for group in info.plan.groups:
        rows = group.rows
        delta = (a[group.slot, ids[rows]].float() @ b[group.slot].float().T).to(y.dtype)
        if isinstance(rows, slice):
            y[rows] += delta
        else:
            y.index_add_(0, rows, delta)


def shrink_masked(h: torch.Tensor, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> None:
    """h[t] = x[t] @ a[token_slots[t]].T, or 0 where token_slots[t] < 0. Graph-safe.

    h [T, stack*R] (fp32), x [T, in], a [L, stack*R, in], token_slots [T] int64.
    """
    num_slots, rows, in_dim = a.shape
    T = x.shape[0]
    assert h.shape == (T, rows) and x.shape[1] == in_dim, (h.shape, x.shape, a.shape)
    # One GEMM against every slot: fixed shapes, no gather of per-token weights.
    every = (x @ a.reshape(num_slots * rows, in_dim).T).view(T, num_slots, rows)
    index = token_slots.clamp(min=0).view(T, 1, 1).expand(T, 1, rows)
    own = every.gather(1, index).squeeze(1)
    # where, not a multiply: a base token's row is exactly 0 whatever slot 0 holds.
    h.copy_(torch.where((token_slots >= 0).unsqueeze(1), own, 0))


def expand_masked(y: torch.Tensor, h: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
                  token_slots: torch.Tensor) -> None:
    """y[t, offsets[s]:offsets[s+1]] += h[t, s*R:(s+1)*R] @ b[s][token_slots[t]].T; nothing where < 0. Graph-safe.

    y [T, >= offsets[-1]], h [T, stack*R], b[s] [L, out_s, R], token_slots [T] int64.
    """
    num_slots, _, R = b[0].shape
    assert len(offsets) == len(b) + 1 and h.shape[1] == len(b) * R, (len(b), offsets, h.shape, R)
    for s, b_s in enumerate(b):
        h_s = h[:, s * R:(s + 1) * R]
        delta = torch.zeros(h.shape[0], b_s.shape[1], dtype=torch.float32, device=y.device)
        # A static loop over the slots: each token's own block, without a [T, out, R] gather.
        for slot in range(num_slots):
            mine = torch.where((token_slots == slot).unsqueeze(1), h_s, 0)
            delta += mine.to(b_s.dtype) @ b_s[slot].T
        y[:, offsets[s]:offsets[s + 1]] += delta.to(y.dtype)


def add_lora_masked(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                    offsets: Sequence[int], info: LoRABatchInfo) -> None:
    """add_lora by shrink_masked then expand_masked: reads only info.token_slots. Graph-safe."""
    h = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    shrink_masked(h, x, a, info.token_slots)
    expand_masked(y, h, b, offsets, info.token_slots)


def add_embedding_masked(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         info: LoRABatchInfo) -> None:
    """y[t] += a[token_slots[t], ids[t]] @ b[token_slots[t]].T; nothing where < 0. Graph-safe."""
    token_slots = info.token_slots
    rows = a[token_slots.clamp(min=0), ids]
    h = torch.where((token_slots >= 0).unsqueeze(1), rows.float(), 0)
    expand_masked(y, h, (b,), (0, b.shape[1]), token_slots)

