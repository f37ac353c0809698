"""Decode through static input buffers and batch-size buckets.

Decode is the hot path and runs once per generated token, so on CUDA / NPU it
is captured as one device graph per bucket and replayed: every input lives in a
buffer allocated here once, and nothing in the step reads back to the host.
On CPU the same static-buffer path runs eagerly (trimming the block table to
the widest sequence, which only an eager run can do).
"""
from __future__ import annotations

import torch

from lora.batch import LoRABatchInfo
from workers.forward_batch import ForwardBatch
from workers.kv_cache import blocks_needed
from workers.plan import StepPlan


class GraphRunner:
    def __init__(self, model, kv_cache, platform, device, config, max_model_len: int, capture: bool, graph_safe: bool,
                 lora_backend=None):
        self.model, self.kv_cache, self.platform, self.device = model, kv_cache, platform, device
        self.block_size = config.kv_block_size
        self.capture, self.graph_safe = capture, graph_safe
        self.lora_backend = lora_backend   # None: LoRA off
        self.buckets = sorted({b for b in config.graph_batch_sizes if b < config.max_num_seqs} | {config.max_num_seqs})
        n, self.width = self.buckets[-1], blocks_needed(max_model_len, self.block_size)
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.zeros(n, **i64)        # padded rows write into the scratch block
        self.context_lens = torch.ones(n, **i64)
        self.block_tables = torch.zeros(n, self.width, **i64)
        self.token_slots = torch.full((n,), -1, **i64)
        self.logits_indices = torch.arange(n, **i64)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def _bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def _graph_lora(self, b: int) -> LoRABatchInfo | None:
        if self.lora_backend is None:
            return None
        return self.lora_backend.graph_info(self.token_slots[:b])

    def _batch(self, b: int, width: int, lora: LoRABatchInfo | None) -> ForwardBatch:
        return ForwardBatch(input_ids=self.input_ids[:b], positions=self.positions[:b],
                            slot_mapping=self.slot_mapping[:b], logits_indices=self.logits_indices[:b],
                            num_decode_tokens=b, block_tables=self.block_tables[:b, :width],
                            context_lens=self.context_lens[:b], lora=lora, lm_lora=lora, graph_safe=self.graph_safe)

    def _fill(self, plan: StepPlan, b: int) -> int:
        """Copy the plan into the static buffers (padded rows reset); returns the block-table width used."""
        B, bs = plan.num_seqs, self.block_size
        pad = b - B
        width = max(blocks_needed(n, bs) for n in plan.seq_lens)
        tables = [t + [0] * (width - len(t)) for t in plan.block_tables] + [[0] * width] * pad
        slot_mapping = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(plan.block_tables, plan.seq_lens)]
        host = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        self.input_ids[:b].copy_(host(plan.input_ids + [0] * pad), non_blocking=True)
        self.positions[:b].copy_(host(plan.positions + [0] * pad), non_blocking=True)
        self.slot_mapping[:b].copy_(host(slot_mapping + [0] * pad), non_blocking=True)
        self.context_lens[:b].copy_(host(plan.seq_lens + [1] * pad), non_blocking=True)
        self.block_tables[:b].zero_()
        self.block_tables[:b, :width].copy_(host(tables), non_blocking=True)
        self.token_slots[:b].copy_(host(plan.lora_slots + [-1] * pad), non_blocking=True)
        return width

    def decode(self, plan: StepPlan, lora: LoRABatchInfo | None) -> torch.Tensor:
        """Logits [num_seqs, vocab]; `lora` is the host-segment info used by the eager control path."""
        B = plan.num_seqs
        b = self._bucket(B) if (self.capture or self.graph_safe) else B
        width = self._fill(plan, b)
        if b in self.graphs:
            graph, logits = self.graphs[b]
            graph.replay()
            return logits[:B]
        lora = self._graph_lora(b) if self.graph_safe else lora
        return self.model(self._batch(b, width if not self.capture else self.width, lora), self.kv_cache)[:B]

    def _capture_all(self) -> None:
        pool = None
        for b in reversed(self.buckets):  # largest first so smaller graphs reuse its memory pool
            batch = self._batch(b, self.width, self._graph_lora(b))
            self.model(batch, self.kv_cache)  # warm-up: lazy initialisation must not happen while capturing
            self.platform.synchronize()
            graph = self.platform.graph()
            with self.platform.graph_context(graph, pool):
                logits = self.model(batch, self.kv_cache)
            pool = graph.pool()
            self.graphs[b] = (graph, logits)
