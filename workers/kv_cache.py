"""Paged KV cache: fixed-size blocks, block tables, a block allocator, attention in torch.

Block 0 is a scratch block never handed out: padded rows of a decode bucket
write their K/V there, so the write is a plain index_copy_ with no masking.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

from workers import cpu_attention

SCRATCH_BLOCK = 0


class BlockAllocator:
    def __init__(self, num_blocks: int):
        assert num_blocks >= 2, "need at least one usable block besides the scratch block"
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free), f"asked for {n} blocks, {len(self.free)} free"
        return [self.free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCache:
    """Per-layer K and V: [num_kv_heads, num_blocks, block_size, head_dim], allocated once.

    Head-major, so the blocks decode gathers come out as [kv_heads, seqs, tokens, head_dim],
    already the layout of its batched matmuls (a token-major cache needs one more full copy
    of the gathered K and V per layer).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[h].flat[slot_mapping[t]] = k[t, h] (and v); k: [T, kv_heads, head_dim]."""
    kv_heads, head_dim = k.shape[1:]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                      scale: float) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch (fresh K/V, no cached prefix).

    q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D].
    """
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     graph_safe: bool = True) -> torch.Tensor:
    """One query token per sequence over its paged context; fixed shapes, no host sync.

    graph_safe=False (an eager step) lets the CPU use its C kernel (workers/cpu_attention.c),
    which reads the blocks in place instead of gathering them.

    q: [B, H, D]; k_cache/v_cache: [kv_heads, blocks, block_size, D]; block_tables: [B, W];
    context_lens: [B] -> [B, H, D]. Keys are gathered for all W blocks and masked past context_lens.
    """
    if not graph_safe and q.device.type == "cpu":
        out = cpu_attention.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
        if out is not None:
            return out
    B, W = block_tables.shape
    kv_heads, num_blocks, bs, D = k_cache.shape
    group = q.shape[1] // kv_heads
    # Two batched matmuls over (kv_head, seq) rather than SDPA: for one query token SDPA's CPU
    # kernels ran 15-40x slower than this (batch 32, 100 tokens, bf16). The gather is one
    # index_select over whole (head, block) rows of block_size * D contiguous elements, several
    # times faster than advanced indexing with a 2-D index or index_select on dim 1.
    heads = torch.arange(kv_heads, device=q.device)[:, None] * num_blocks
    rows = (heads + block_tables.reshape(1, -1)).reshape(-1)
    k = k_cache.view(kv_heads * num_blocks, bs * D).index_select(0, rows).view(kv_heads, B, W * bs, D)
    v = v_cache.view(kv_heads * num_blocks, bs * D).index_select(0, rows).view(kv_heads, B, W * bs, D)
    q = q.view(B, kv_heads, group, D).transpose(0, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    past = torch.arange(W * bs, device=q.device)[None, :] >= context_lens[:, None]
    probs = torch.softmax(scores.masked_fill_(past[None, :, None, :], float("-inf")), dim=-1)
    return torch.matmul(probs.to(v.dtype), v).transpose(0, 1).reshape(B, kv_heads * group, D)
