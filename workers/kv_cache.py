"""Paged KV cache: fixed-size blocks (allocated by block_pool.py), KV writes, attention.

Block 0 is a scratch block never handed out: padded rows of a decode bucket
write their K/V there, so the write is a plain index_copy_ with no masking.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers import cpu_attention


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
    """k_cache[h].flat[slot_mapping[t]] = k[t, h] (and v); k: [T, kv_heads, head_dim]. On the CPU the model writes
    through workers/cpu_ops.c instead, in the same pass as rope (cpu_ops.qkv_rope); this is its reference."""
    kv_heads, head_dim = k.shape[1:]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


# On the CPU the decode kernel (workers/cpu_attention.c) runs a mixed step's prompt rows too, each row a query over
# its own context read from the cache, every row of the step in one call, instead of one SDPA call per chunk.
# Against torch 2.13's SDPA per chunk (benchmarks.prefill_attention: 16 query / 2 KV heads of 128, 16- to
# 2048-token prompts, 1 and 2 threads): bf16 0.16-0.68x its time at every length; fp32 (no vector fast path)
# 0.3-0.8x up to 32 tokens, 0.95-1.05x at 64, 1.1-1.5x at 128-512: the contexts up to which the rows take the
# kernel, by dtype (None: any).
ROW_ATTENTION_MAX_CONTEXT = {torch.bfloat16: None, torch.float32: 64}


def attend_as_rows(device: torch.device, dtype: torch.dtype, prefill_totals) -> bool:
    """Whether every prompt row of a mixed step attends through the CPU decode kernel."""
    if device.type != "cpu" or dtype not in ROW_ATTENTION_MAX_CONTEXT or not cpu_attention.applies(dtype):
        return False
    limit = ROW_ATTENTION_MAX_CONTEXT[dtype]
    return limit is None or all(total <= limit for total in prefill_totals)


def row_tables(query_lens, seq_lens, block_tables, as_tensor=torch.tensor):
    """For sequences with n new tokens each, of `total` tokens (positions total - n .. total - 1), as int64 tensors:
    their block tables padded to the widest, per row its context length (position + 1), and per row its sequence's
    index (None when every sequence has one row: the row is the sequence)."""
    width = max(len(t) for t in block_tables)
    lens, rows = [], []
    for i, (n, total) in enumerate(zip(query_lens, seq_lens)):
        lens += range(total - n + 1, total + 1)
        rows += [i] * n
    return (as_tensor([t + [0] * (width - len(t)) for t in block_tables]), as_tensor(lens),
            as_tensor(rows) if len(rows) > len(block_tables) else None)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch, scale: float) -> torch.Tensor:
    """Attention of every row of a ForwardBatch, after the rows' K/V were written to the cache.

    q: [T, H, D], k/v: [T, KVH, D] (the rows' own K/V) -> [T, H, D]. A pure decode batch is one
    decode_attention call (captured / graph-safe where asked), as is, on the CPU, a mixed step whose every row
    attends as a decode row (`attend_as_rows`: no chunks); otherwise a mixed step runs its decode rows through
    decode_attention and each prefill chunk through SDPA.
    """
    if not batch.chunks:
        return decode_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale,
                                batch.graph_safe, batch.table_rows)
    out = torch.empty_like(q)
    d = batch.num_decode_tokens
    if d:
        out[:d] = decode_attention(q[:d], k_cache, v_cache, batch.block_tables, batch.context_lens, scale,
                                   graph_safe=False, rows=batch.table_rows)
    for c in batch.chunks:
        rows = slice(c.row, c.row + c.num_tokens)
        if c.start == 0:   # a whole prompt (or its first chunk): its own fresh K/V, no gather
            out[rows] = _causal(q[rows], k[rows], v[rows], scale)
        else:
            out[rows] = chunk_attention(q[rows], k_cache, v_cache, c.block_ids, c.start, scale)
    return out


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                          scale=scale, enable_gqa=True).transpose(0, 1)


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                    start: int, scale: float) -> torch.Tensor:
    """One sequence's chunk of queries over its whole context, read from its blocks in the cache.

    q: [n, H, D], the tokens at positions start .. start + n - 1; block_ids: the sequence's blocks
    covering start + n tokens -> [n, H, D]. Query i sees keys 0 .. start + i (causal, bottom-right).
    """
    n, context = q.shape[0], start + q.shape[0]
    kv_heads, num_blocks, bs, D = k_cache.shape
    rows = (torch.arange(kv_heads, device=q.device)[:, None] * num_blocks + block_ids[None, :]).reshape(-1)
    k = k_cache.view(kv_heads * num_blocks, bs * D).index_select(0, rows).view(kv_heads, -1, D)[:, :context]
    v = v_cache.view(kv_heads * num_blocks, bs * D).index_select(0, rows).view(kv_heads, -1, D)[:, :context]
    visible = (torch.arange(context, device=q.device)[None, :]
               <= (start + torch.arange(n, device=q.device))[:, None])
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=visible, scale=scale,
                                          enable_gqa=True).transpose(0, 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     graph_safe: bool = True, rows: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context; fixed shapes, no host sync.

    graph_safe=False (an eager step) lets the CPU use its C kernel (workers/cpu_attention.c),
    which reads the blocks in place instead of gathering them.

    q: [B, H, D]; k_cache/v_cache: [kv_heads, blocks, block_size, D]; block_tables: [B, W];
    context_lens: [B] -> [B, H, D]. Keys are gathered for all W blocks and masked past context_lens. rows [B]
    (eager only): query b reads block_tables[rows[b]] (a prompt's tokens share their sequence's table).
    """
    if not graph_safe and q.device.type == "cpu":
        out = cpu_attention.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, rows)
        if out is not None:
            return out
    if rows is not None:
        block_tables = block_tables.index_select(0, rows)
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
