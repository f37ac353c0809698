"""The control-flow path's LoRA in torch ops when adapters have few tokens each: padded grids.

Used where the CPU kernel (cpu_sgmv) is not: other devices' eager steps, or with the kernel
off. Same contract and buffer layout as lora/backends/torch_native.py.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lora.batch import token_runs

# Batched (padded) path: with a handful of tokens per adapter, each per-adapter GEMM costs its
# dispatch (tens of us on CPU) rather than its flops, and the loop runs 11 of them per adapter
# and layer. Padding the adapters' tokens into one [adapters, tokens] grid makes that one bmm
# per shrink and per slice. Padding costs only flops: it is bounded per LoRA token, but a small
# grid is always worth it (24 one-token adapters plus one with 8 tokens, a 25 x 8 grid for 32
# tokens: the qkv LoRA takes 0.57 ms batched against 5.8 ms looped).
BATCHED_MAX_TOKENS_PER_ADAPTER = 64
BATCHED_MAX_PADDING = 4             # grid cells per LoRA token, beyond the first ...
BATCHED_FREE_CELLS = 1024           # ... grid cells


@dataclass(frozen=True)
class PaddedLayout:
    """The LoRA tokens of slots first_slot .. first_slot + num_slots - 1 as a slot-major grid.

    rows: when those tokens already are that grid (a contiguous, equally split run of rows)
    the grid is a view of x / y; otherwise `gather` [num_slots * max_len] names each cell's
    token row (T = a zero pad row) and `scatter` [T] each token's cell (num_slots * max_len
    = a zero row, for base tokens).
    """
    first_slot: int
    num_slots: int
    max_len: int
    rows: slice | None
    gather: torch.Tensor | None
    scatter: torch.Tensor | None


@functools.lru_cache(maxsize=64)
def padded_layout(seg_lens: tuple[int, ...], seg_slots: tuple[int, ...],
                  device: torch.device) -> PaddedLayout | None:
    """The grid for the batched path, or None when the control-flow loop is the better choice."""
    runs = token_runs(seg_lens, seg_slots)
    if not runs:
        return None
    tokens = {slot: [t for lo, hi in slot_runs for t in range(lo, hi)] for slot, slot_runs in runs.items()}
    first, num_slots = min(tokens), max(tokens) - min(tokens) + 1
    max_len = max(len(ts) for ts in tokens.values())
    num_lora_tokens = sum(len(ts) for ts in tokens.values())
    if (max_len > BATCHED_MAX_TOKENS_PER_ADAPTER
            or num_slots * max_len > max(BATCHED_MAX_PADDING * num_lora_tokens, BATCHED_FREE_CELLS)):
        return None
    T = sum(seg_lens)
    cells = [T] * (num_slots * max_len)
    for slot, ts in tokens.items():
        start = (slot - first) * max_len
        cells[start:start + len(ts)] = ts
    if T not in cells and cells == list(range(cells[0], cells[0] + len(cells))):
        return PaddedLayout(first, num_slots, max_len, slice(cells[0], cells[0] + len(cells)), None, None)
    scatter = [len(cells)] * T
    for cell, t in enumerate(cells):
        if t < T:
            scatter[t] = cell
    as_index = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return PaddedLayout(first, num_slots, max_len, None, as_index(cells), as_index(scatter))


def add_lora_batched(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                     offsets: Sequence[int], layout: PaddedLayout, max_rank: int) -> None:
    """shrink_segments + expand_segments on the padded grid, with L = slots first .. first + n - 1:

        h[l, j]                          = X[l, j] @ a[l].T                   (one bmm)
        y[t, offsets[s]:offsets[s+1]]   += h[l, j, s*R:(s+1)*R] @ b[s][l].T   (one bmm per slice)

    for the token t in cell (l, j); X's pad cells are zero rows, so they add exactly zero, as
    do the rows past each slot's rank. x [T, in], a [slots, stack*R, in], y [T, >= offsets[-1]].
    """
    n, m, R = layout.num_slots, layout.max_len, max_rank
    if n == 1 and layout.rows is not None and y.dtype == a.dtype:
        add_lora_rows(y, x, a[layout.first_slot], [b_s[layout.first_slot] for b_s in b], offsets, layout.rows, R)
        return
    slots = slice(layout.first_slot, layout.first_slot + n)
    if layout.rows is not None:
        grid = x[layout.rows].view(n, m, x.shape[1])
    else:
        grid = F.pad(x, (0, 0, 0, 1)).index_select(0, layout.gather).view(n, m, x.shape[1])
    h = torch.bmm(grid, a[slots].transpose(1, 2))
    for s, b_s in enumerate(b):
        delta = torch.bmm(h[:, :, s * R:(s + 1) * R], b_s[slots].transpose(1, 2)).view(n * m, -1).to(y.dtype)
        out = y[:, offsets[s]:offsets[s + 1]]
        if layout.rows is not None:
            out[layout.rows].add_(delta)
        else:
            out.add_(F.pad(delta, (0, 0, 0, 1)).index_select(0, layout.scatter))


def add_lora_rows(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                  offsets: Sequence[int], rows: slice | torch.Tensor, R: int) -> None:
    """One adapter (a [stack*R, in], b[s] [out_s, R]) over its rows (a run, or an index): 2-D GEMMs.

    With many tokens these are the efficient GEMMs they look like. A run accumulates the expand
    in place by addmm_ (one op per slice instead of a bmm and an add_, one rounding instead of
    two); scattered rows are gathered once and their deltas index_add_-ed back.
    """
    if isinstance(rows, slice):
        h = x[rows] @ a.T
        out = y[rows]
        for s, b_s in enumerate(b):
            out[:, offsets[s]:offsets[s + 1]].addmm_(h[:, s * R:(s + 1) * R], b_s.T)
        return
    h = x.index_select(0, rows) @ a.T
    for s, b_s in enumerate(b):
        y[:, offsets[s]:offsets[s + 1]].index_add_(0, rows, h[:, s * R:(s + 1) * R] @ b_s.T)
