"""Everything one forward pass needs besides the weights, passed explicitly to `forward`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lora.batch import LoRABatchInfo


@dataclass
class ForwardBatch:
    is_prefill: bool
    input_ids: torch.Tensor                  # [T]
    positions: torch.Tensor                  # [T]
    slot_mapping: torch.Tensor               # [T] flat KV slot to write
    logits_indices: torch.Tensor             # [B] rows whose logits are needed (last token of each seq)
    cu_seqlens: list[int] | None = None      # prefill: packed sequence boundaries (host)
    block_tables: torch.Tensor | None = None # decode: [B, W]
    context_lens: torch.Tensor | None = None # decode: [B]
    lora: LoRABatchInfo | None = None        # per token
    lm_lora: LoRABatchInfo | None = None     # per logits row
    graph_safe: bool = False                 # decode ops must be capturable: device tensor ops only
