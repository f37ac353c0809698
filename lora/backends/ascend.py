"""LoRA on Ascend NPUs through sgl_kernel_npu's sgmv kernels (`torch.ops.npu.*`).

The kernels' conventions, all honoured here (see the buffer layout in torch_native.py):
- sgmv_shrink(x, weight, lora_indices, seq_len, y, scale): x fp16/bf16 [T, in], weight
  [L, rows, in], y fp32 [T, rows] written (rows < in); segments with a negative index are
  skipped, so y is zeroed first.
- sgmv_expand(x, weight, lora_indices, seq_len, y, slice_offset, slice_size): x fp32 [T, R]
  read as a dense array (R = x.size(1)); slot l's weight is read as the contiguous block
  [slice_size, R] at element l * R * slice_size; y fp16/bf16, contiguous, updated in place in
  y[:, slice_offset:slice_offset + slice_size]; R <= slice_size.
- lora_indices and seq_len are int64, one entry per segment (info.seg_slots / info.seg_lens).
  Under graph replay they must keep a fixed size too: the graph runner gives one segment per
  token (seq_len all ones, lora_indices = token_slots), or pads with empty segments.
The kernels silently do nothing for fp32 and are specialised for R in {8, 16, 32, 64}; any
other case goes to the torch-native ops, as does the embedding (a gather, not a GEMM).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from lora.backends.registry import register_lora_backend
from lora.backends.torch_native import TorchNativeBackend, embedding_masked
from lora.batch import LoRABatchInfo

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_RANKS = (8, 16, 32, 64)


@register_lora_backend("ascend")
class AscendBackend:
    """LoRA through sgmv_shrink / sgmv_expand; same maths and signatures as TorchNativeBackend."""

    def __init__(self) -> None:
        if not hasattr(torch.ops.npu, "sgmv_shrink"):
            import sgl_kernel_npu  # noqa: F401  registers torch.ops.npu.* (needs torch_npu and CANN)
        self.native = TorchNativeBackend()

    def shrink(self, h: torch.Tensor, x: torch.Tensor, a: torch.Tensor, info: LoRABatchInfo) -> None:
        """h [T, stack*R] fp32 = x [T, in] @ a[slot(t)] [stack*R, in].T per token; 0 for base tokens."""
        if not (x.dtype in KERNEL_DTYPES and a.dtype == x.dtype and h.dtype == torch.float32
                and info.max_rank in KERNEL_RANKS and x.shape[1] > h.shape[1]):
            return self.native.shrink(h, x, a, info)
        assert h.is_contiguous() and a.is_contiguous(), "sgmv_shrink reads weight and y as dense arrays"
        assert h.shape == (x.shape[0], a.shape[1]), (h.shape, x.shape, a.shape)
        h.zero_()
        torch.ops.npu.sgmv_shrink(x.contiguous(), a, info.seg_slots, info.seg_lens, h, 1.0)

    def expand(self, y: torch.Tensor, h: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
               info: LoRABatchInfo) -> None:
        """y[t, offsets[s]:offsets[s+1]] += h[t, s*R:(s+1)*R] @ b[s][slot(t)].T, b[s] [L, out_s, R]."""
        R = info.max_rank
        assert len(offsets) == len(b) + 1 and h.shape[1] == len(b) * R, (len(b), offsets, h.shape, R)
        if not (y.dtype in KERNEL_DTYPES and R in KERNEL_RANKS
                and all(b_s.dtype == y.dtype and b_s.shape[1] >= R for b_s in b)):
            return self.native.expand(y, h, b, offsets, info)
        out = y if y.is_contiguous() else y.contiguous()
        for s, b_s in enumerate(b):
            assert b_s.is_contiguous() and b_s.shape[2] == R, "sgmv_expand reads each slot's [out_s, R] block densely"
            h_s = h[:, s * R:(s + 1) * R].to(torch.float32).contiguous()
            torch.ops.npu.sgmv_expand(h_s, b_s, info.seg_slots, info.seg_lens, out,
                                      offsets[s], offsets[s + 1] - offsets[s])
        if out is not y:
            y.copy_(out)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                 offsets: Sequence[int], info: LoRABatchInfo) -> None:
        """y[t, offsets[s]:offsets[s+1]] += x[t] @ a[l, s*R:(s+1)*R].T @ b[s][l].T with l = slot(t)."""
        h = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
        self.shrink(h, x, a, info)
        self.expand(y, h, b, offsets, info)

    def add_embedding_lora(self, y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           info: LoRABatchInfo) -> None:
        """y[t] += a[l, ids[t]] @ b[l].T with l = slot(t); y [T, hidden], a [L, vocab, R], b [L, hidden, R]."""
        embedding_masked(y, ids, a, b, info.token_slots)
