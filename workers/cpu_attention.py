"""Decode attention on the CPU through cpu_attention.c (ctypes), as the torch op loraserve::decode_attention.

Registered through torch.library with a fake implementation, so FakeTensor mode and
torch.compile see an op of fixed output shape. kv_cache.decode_attention calls it on its
eager CPU path; `decode_attention` returns None where it does not apply (other dtypes, e.g.
fp16, keep torch's).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from lora import native

SOURCE = Path(__file__).with_name("cpu_attention.c")
_SYMBOLS = {torch.bfloat16: "decode_attention_bf16", torch.float32: "decode_attention_f32"}


class _Args(ctypes.Structure):
    """attn_args of cpu_attention.c, field for field."""
    _fields_ = [("q", ctypes.c_void_p), ("q_stride", ctypes.c_int64),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("kv_heads", ctypes.c_int64), ("num_blocks", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("group", ctypes.c_int64),
                ("block_tables", ctypes.c_void_p), ("bt_stride", ctypes.c_int64), ("max_blocks", ctypes.c_int64),
                ("context_lens", ctypes.c_void_p), ("out", ctypes.c_void_p), ("out_stride", ctypes.c_int64),
                ("batch", ctypes.c_int64), ("scale", ctypes.c_float), ("rows", ctypes.c_void_p),
                ("num_tables", ctypes.c_int64)]


_load, available = native.library(SOURCE, {name: [ctypes.c_void_p] for name in _SYMBOLS.values()})


def applies(dtype: torch.dtype) -> bool:
    """Whether the kernel is built and has code for this dtype."""
    return dtype in _SYMBOLS and available()


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor, rows: torch.Tensor | None = None) -> bool:
    """Whether the kernel reads these operands (the KV cache's layout, a dtype it has, int64 tables)."""
    return (available() and q.dtype in _SYMBOLS and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and all(t.device.type == "cpu" for t in (q, k_cache, v_cache, block_tables, context_lens))
            and (rows is None or (rows.device.type == "cpu" and rows.dtype == torch.int64
                                  and rows.is_contiguous()))
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and q.dim() == 3 and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and block_tables.dtype == torch.int64 and block_tables.dim() == 2 and block_tables.stride(1) == 1
            and context_lens.dtype == torch.int64 and context_lens.is_contiguous())


def _check(q, k_cache, v_cache, block_tables, context_lens, rows) -> None:
    B, H, D = q.shape
    kv_heads, _, _, head_dim = k_cache.shape
    tables_ok = block_tables.shape[0] == B if rows is None else rows.shape == (B,)
    if head_dim != D or H % kv_heads or context_lens.shape[0] != B or not tables_ok:
        raise ValueError(f"decode attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, "
                         f"block tables {tuple(block_tables.shape)}, context lens {tuple(context_lens.shape)}"
                         + ("" if rows is None else f", table rows {tuple(rows.shape)}"))


def _decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float, rows=None) -> torch.Tensor:
    _check(q, k_cache, v_cache, block_tables, context_lens, rows)
    if not supports(q, k_cache, v_cache, block_tables, context_lens, rows):
        raise ValueError("decode attention: the CPU kernel does not take these operands (check supports())")
    B, H, D = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    out = torch.empty(B, H, D, dtype=q.dtype)
    args = _Args(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), kv_heads, num_blocks, block_size,
                 D, H // kv_heads, block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
                 context_lens.data_ptr(), out.data_ptr(), H * D, B, scale,
                 rows.data_ptr() if rows is not None else None, block_tables.shape[0])
    native.call(getattr(_load(), _SYMBOLS[q.dtype]), args, _failed)
    return out


def _failed(status: int) -> None:
    if status == 2:
        raise MemoryError("decode attention: out of memory for the kernel's scratch buffers")
    raise ValueError("decode attention: a context length, a block id or a table row is out of range")


def _fake(q, k_cache, v_cache, block_tables, context_lens, scale: float, rows=None) -> torch.Tensor:
    _check(q, k_cache, v_cache, block_tables, context_lens, rows)
    return q.new_empty(q.shape)


_LIB = torch.library.Library("loraserve", "FRAGMENT")   # lora/backends/cpu_sgmv.py adds the LoRA ops
_LIB.define("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
            "float scale, Tensor? rows=None) -> Tensor")
_LIB.impl("decode_attention", native.recordable(_decode_attention), "CPU")
torch.library.register_fake("loraserve::decode_attention", _fake, lib=_LIB)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float,
                     rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """kv_cache.decode_attention's contract, or None when the kernel does not take these operands."""
    if not supports(q, k_cache, v_cache, block_tables, context_lens, rows):
        return None
    return torch.ops.loraserve.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, rows)
