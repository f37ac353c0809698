"""Everything one forward pass needs besides the weights, passed explicitly to `forward`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lora.batch import LoRABatchInfo


@dataclass(frozen=True)
class PrefillChunk:
    """Rows [row, row + num_tokens) of a batch: one sequence's new tokens, at positions start, start + 1, ..."""
    row: int
    num_tokens: int
    start: int                            # tokens of the sequence already in the KV cache before this chunk
    block_ids: torch.Tensor | None        # [blocks] int64 covering start + num_tokens; None when start == 0


@dataclass
class ForwardBatch:
    """Rows are tokens: first one row per decoding sequence, then the prefill chunks (`chunks`)."""
    input_ids: torch.Tensor                  # [T]
    positions: torch.Tensor                  # [T]
    slot_mapping: torch.Tensor               # [T] flat KV slot to write
    logits_indices: torch.Tensor             # [S] rows whose logits are needed (the sampling sequences' last)
    num_decode_tokens: int = 0               # leading rows that attend through the decode kernel (each its own query)
    block_tables: torch.Tensor | None = None # [num_decode_tokens, W] of those rows, or per sequence (table_rows)
    context_lens: torch.Tensor | None = None # [num_decode_tokens] (a prompt's row: its position + 1)
    table_rows: torch.Tensor | None = None   # [num_decode_tokens] each row's block_tables row; None: its own
    chunks: tuple[PrefillChunk, ...] = ()
    lora: LoRABatchInfo | None = None        # per token
    lm_lora: LoRABatchInfo | None = None     # per logits row
    graph_safe: bool = False                 # decode ops must be capturable: device tensor ops only
    all_rows_logits: bool = False            # logits_indices is every row in order (a decode batch's static buffers)
    valid_tokens: torch.Tensor | None = None # [1] int64: how many leading rows are real (a CPU graph's padded bucket)
