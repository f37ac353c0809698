"""Portable LoRA ops in plain PyTorch, punica style: output first, updated in place.

Buffer layout shared with the slot pool and the LoRA layers (L slots, R = max_rank):
    a        [L, stack * R, in]   slice s of slot l is a[l, s*R:(s+1)*R]; rows past the rank are zero
    b[s]     [L, out_s, R]        one contiguous block per slot and slice, scaling folded in;
                                  columns past the rank are zero
    offsets  (stack + 1,)         slice s writes y[:, offsets[s]:offsets[s+1]]
    h        [T, stack * R] fp32  the shrunk activations
Slot -1 (base model) contributes exactly zero.

Each op has two implementations:
- `*_segments`, the control-flow path (eager prefill, CPU decode): loops over the
  adapters present in the batch (host lists) and reads only their first `rank`
  rows of each slice, which is exact because the rows past the rank are zero.
  `add_lora` prefers, when adapters have few tokens each: on CPU the C kernel
  (cpu_sgmv: one call per layer, each adapter's weights read once); elsewhere
  torch_batched's padded grids (one bmm per shrink / slice);
- `*_masked`, the graph-safe path (captured decode): fixed shapes, no host sync,
  no data-dependent shapes; reads only `token_slots`, computes against every slot
  and keeps each token's own.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from lora.backends import cpu_sgmv
from lora.backends.registry import register_lora_backend
from lora.backends.torch_batched import add_lora_batched, padded_layout
from lora.batch import LoRABatchInfo, token_runs


def _rows_by_slot(info: LoRABatchInfo, device: torch.device) -> list[tuple[int, int, slice | torch.Tensor]]:
    """(slot, rank, rows) per adapter present; rows is a slice when its tokens form one run."""
    # Cached on the host lists: every LoRA layer of a step asks the same question twice.
    return _groups(info.seg_lens_host, info.seg_slots_host, info.slot_ranks_host, info.max_rank, device)


@functools.lru_cache(maxsize=64)
def _groups(seg_lens: tuple[int, ...], seg_slots: tuple[int, ...], slot_ranks: tuple[int, ...], max_rank: int,
            device: torch.device) -> list[tuple[int, int, slice | torch.Tensor]]:
    groups = []
    for slot, runs in token_runs(seg_lens, seg_slots).items():
        rank = slot_ranks[slot] if slot < len(slot_ranks) else max_rank
        rank = min(rank, max_rank)
        if rank <= 0:  # an empty slot is all zeros
            continue
        if len(runs) == 1:
            rows: slice | torch.Tensor = slice(*runs[0])
        else:
            rows = torch.tensor([t for lo, hi in runs for t in range(lo, hi)], dtype=torch.int64, device=device)
        groups.append((slot, rank, rows))
    return groups


def _add_rows(y: torch.Tensor, rows: slice | torch.Tensor, delta: torch.Tensor) -> None:
    if isinstance(rows, slice):
        y[rows] += delta.to(y.dtype)
    else:
        y.index_add_(0, rows, delta.to(y.dtype))


def shrink_segments(h: torch.Tensor, x: torch.Tensor, a: torch.Tensor, info: LoRABatchInfo) -> None:
    """h[t, s*R:s*R+r] = x[t] @ a[l, s*R:s*R+r].T for the tokens t of slot l (rank r); other entries 0.

    h [T, stack*R] (fp32), x [T, in], a [L, stack*R, in].
    """
    R = info.max_rank
    assert a.shape[1] % R == 0 and h.shape == (x.shape[0], a.shape[1]), (h.shape, x.shape, a.shape, R)
    h.zero_()
    for slot, rank, rows in _rows_by_slot(info, x.device):
        xs = x[rows]
        for s in range(a.shape[1] // R):
            cols = slice(s * R, s * R + rank)
            h[rows, cols] = (xs @ a[slot, cols].T).to(h.dtype)


def expand_segments(y: torch.Tensor, h: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
                    info: LoRABatchInfo) -> None:
    """y[t, offsets[s]:offsets[s+1]] += h[t, s*R:s*R+r] @ b[s][l, :, :r].T for the tokens t of slot l.

    y [T, >= offsets[-1]], h [T, stack*R], b[s] [L, out_s, R].
    """
    R = info.max_rank
    assert len(offsets) == len(b) + 1 and h.shape[1] == len(b) * R, (len(b), offsets, h.shape, R)
    for slot, rank, rows in _rows_by_slot(info, y.device):
        for s, b_s in enumerate(b):
            # In b's dtype: h holds values of a GEMM in that dtype already, so this is as exact
            # as an fp32 GEMM rounded once, without fp32 copies of b and a [T, out] fp32 delta
            # (which made a bf16 prefill with LoRA ~2x slower in the expand).
            delta = h[rows, s * R:s * R + rank].to(b_s.dtype) @ b_s[slot, :, :rank].T
            _add_rows(y[:, offsets[s]:offsets[s + 1]], rows, delta)


def embedding_segments(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       info: LoRABatchInfo) -> None:
    """y[t] += a[l, ids[t], :r] @ b[l, :, :r].T for the tokens t of slot l (rank r).

    y [T, hidden], ids [T], a [L, vocab, R], b [L, hidden, R].
    """
    for slot, rank, rows in _rows_by_slot(info, y.device):
        delta = a[slot, ids[rows], :rank].float() @ b[slot, :, :rank].float().T
        _add_rows(y, rows, delta)


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


def embedding_masked(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     token_slots: torch.Tensor) -> None:
    """y[t] += a[token_slots[t], ids[t]] @ b[token_slots[t]].T; nothing where < 0. Graph-safe.

    y [T, hidden], ids [T], a [L, vocab, R], b [L, hidden, R], token_slots [T] int64.
    """
    rows = a[token_slots.clamp(min=0), ids]
    h = torch.where((token_slots >= 0).unsqueeze(1), rows.float(), 0)
    expand_masked(y, h, (b,), (0, b.shape[1]), token_slots)


@register_lora_backend("torch_native")
class TorchNativeBackend:
    """LoRA for any device; `info.use_graph` picks the graph-safe path over the control-flow one.

    With slot l = info.token_slots[t] (-1: base model, zero delta) and R = info.max_rank:
        shrink:  h[t, :] = x[t] @ a[l].T
        expand:  y[t, offsets[s]:offsets[s+1]] += h[t, s*R:(s+1)*R] @ b[s][l].T
    """

    def shrink(self, h: torch.Tensor, x: torch.Tensor, a: torch.Tensor, info: LoRABatchInfo) -> None:
        """h [T, stack*R] fp32 = x [T, in] @ a[slot(t)] [stack*R, in].T per token; 0 for base tokens."""
        if info.use_graph:
            shrink_masked(h, x, a, info.token_slots)
        else:
            shrink_segments(h, x, a, info)

    def expand(self, y: torch.Tensor, h: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
               info: LoRABatchInfo) -> None:
        """y[t, offsets[s]:offsets[s+1]] += h[t, s*R:(s+1)*R] @ b[s][slot(t)].T, b[s] [L, out_s, R]."""
        if info.use_graph:
            expand_masked(y, h, b, offsets, info.token_slots)
        else:
            expand_segments(y, h, b, offsets, info)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                 offsets: Sequence[int], info: LoRABatchInfo) -> None:
        """y[t, offsets[s]:offsets[s+1]] += x[t] @ a[l, s*R:(s+1)*R].T @ b[s][l].T with l = slot(t)."""
        if not info.use_graph:
            if not info.has_lora:
                return
            if x.device.type == "cpu" and cpu_sgmv.add_lora(y, x, a, b, offsets, info):
                return
            layout = padded_layout(info.seg_lens_host, info.seg_slots_host, x.device)
            if layout is not None and x.dtype == a.dtype:
                add_lora_batched(y, x, a, b, offsets, layout, info.max_rank)
                return
        h = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
        self.shrink(h, x, a, info)
        self.expand(y, h, b, offsets, info)

    def add_embedding_lora(self, y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           info: LoRABatchInfo) -> None:
        """y[t] += a[l, ids[t]] @ b[l].T with l = slot(t); y [T, hidden], a [L, vocab, R], b [L, hidden, R]."""
        if info.use_graph:
            embedding_masked(y, ids, a, b, info.token_slots)
        else:
            embedding_segments(y, ids, a, b, info)
