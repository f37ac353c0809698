"""Decode through static input buffers, batch-size buckets and block-table width buckets.

Decode is the hot path and runs once per generated token, so on CUDA / NPU it is captured as device graphs
and replayed: every input lives in a buffer allocated here once, and nothing in the step reads back to the
host. One graph per (batch bucket, width bucket): the width is the block-table width the graph's decode
attention reads (it gathers every block of that width for every sequence), in powers of two blocks up to
max_model_len's; a step replays the smallest graph covering its batch and its widest sequence, so its cost
follows the batch's context, not max_model_len.

When the graphs are captured: on a device all of them up front, largest first, sharing one memory pool (each
smaller graph fits in what the larger ones freed; about batch buckets x log2(max_model_len / block) captures
per LoRA tier (below), e.g. 7 x 10 at 32k, a few seconds each batch bucket, paid once at start-up instead of
as a latency spike in serving). The CPU capture emulation (EngineConfig.emulate_capture, workers/tape_graph.py)
captures each (batch, width) lazily on its first use: a tape keeps every tensor it allocated, with no pool to share, so
capturing every width up front would hold each width's whole gathered KV at once (at 32k, batch 16 on the
bench checkpoint, ~16 GB for the widest graph alone).

A graph whose capture fails (ACL graph stream limits, an old driver, an op that syncs) is not fatal: that
(batch, width) bucket runs eagerly on the static buffers, with one warning naming it and the error;
`enforce_eager` still turns capture off altogether. Collectives inside ACL graphs (tensor parallel on NPU)
need HCCL's AIV expansion: set `HCCL_OP_EXPANSION_MODE=AIV` in the workers' environment, or the all-reduce
capture fails (and its buckets then run eagerly).

On the CPU without the emulation a decode step replays a kernel program (workers/cpu_graph.py: the step's C
kernel calls back to back from C, no Python between them), one per (batch bucket, LoRA tier), captured on its
first use; it reads the full-width block table (the attention kernel walks each sequence's own blocks only) and,
with adapters, each row's LoRA slot from the static slot buffer (the LoRA kernel's per-token entry). A (bucket,
tier) whose capture fails or whose layers run torch ops runs eagerly on the same static buffers (trimming the
block table to the widest sequence, which only an eager run can do), as does everything when the CPU graphs are
off (`enforce_eager`, TP > 1).

LoRA: a module that no adapter of the step targets would add only zeros (embed_tokens and lm_head, in the
default targets, read vocab x rank weights per adapter for that). A graph replays a fixed
op sequence, so the skip is chosen per graph: each (batch, width) is captured once per LoRA tier, the
group sets of `lora_tiers` (no LoRA at all, as vLLM's cudagraph_specialize_lora; the per-layer groups;
every target), and a step replays the narrowest tier covering the groups its adapters fill. So an adapter
hot-loaded later with lm_head weights is computed from its first step on, and the usual adapters (the
projections only) never pay for the LM head. Eager steps skip exactly the groups no adapter of theirs fills.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from lora.batch import LoRABatchInfo
from lora.modules import GROUPS
from workers import cpu_gemv, cpu_graph, tape_graph
from workers.forward_batch import ForwardBatch
from workers.kv_cache import blocks_needed
from workers.plan import StepPlan

logger = logging.getLogger(__name__)

MIN_GRAPH_WIDTH = 4   # blocks: a narrower graph saves nothing worth its capture (64 tokens at block size 16)
# A CPU graph is kept where the layers are our kernels alone: a bf16 dense or MoE step's one torch op is its
# embedding, whatever its depth (an adapter's embedding LoRA adds a few). Where layers run torch ops (W8A8's
# linears; a MoE step's expert LoRA between its projections) the step stays eager, as measured before the graphs;
# fp32 and buckets of more rows than cpu_gemv.c takes (oneDNN's linears, whose bits depend on the batch: padded
# rows must not reach them) are not even captured.
MAX_CPU_GRAPH_TORCH_OPS = 4


def lora_tiers(groups: frozenset[str] | None) -> tuple[frozenset[str] | None, ...]:
    """The LoRA group sets captured for each (batch, width), narrowest first: none, the per-layer groups,
    all of `groups` (the buffers the runner has); (None,) with LoRA off."""
    if groups is None:
        return (None,)
    per_layer = frozenset(g for g in groups if GROUPS[g].path is not None)
    return tuple(dict.fromkeys((frozenset(), per_layer, groups)))


def _groups(tier: frozenset[str] | None) -> str:
    return "none" if not tier else ", ".join(sorted(tier))


def width_buckets(max_blocks: int, smallest: int = MIN_GRAPH_WIDTH) -> tuple[int, ...]:
    """Block-table widths to capture: powers of two from `smallest`, then max_blocks itself (the last)."""
    widths, w = [], 1
    while w < min(smallest, max_blocks):
        w *= 2
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return (*widths, max_blocks)


class GraphRunner:
    def __init__(self, model, kv_cache, platform, device, config, max_model_len: int, capture: bool, graph_safe: bool,
                 lora_backend=None, lora_groups: frozenset[str] | None = None, tp_size: int = 1):
        self.model, self.kv_cache, self.platform, self.device = model, kv_cache, platform, device
        self.block_size = config.kv_block_size
        self.emulated = platform.name == "cpu" and config.emulate_capture and not config.enforce_eager
        if self.emulated:    # captured decode needs the graph-safe ops (config.py refuses graph_safe_decode=False)
            capture, graph_safe = True, True
        self.capture, self.graph_safe = capture, graph_safe
        self.lora_backend = lora_backend   # None: LoRA off
        self.tiers = lora_tiers(lora_groups if lora_backend is not None else None)
        self.buckets = sorted({b for b in config.graph_batch_sizes if b < config.max_num_seqs} | {config.max_num_seqs})
        n, self.width = self.buckets[-1], blocks_needed(max_model_len, self.block_size)
        self.widths = width_buckets(self.width)
        i64 = dict(dtype=torch.int64, device=device)
        # the per-row inputs, rows of one buffer filled by one copy a step: ids, positions, KV slots (padded rows
        # write into the scratch block), context lengths, LoRA slots
        self._rows = torch.zeros(5, n, **i64)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.token_slots = self._rows.unbind()
        self.context_lens.fill_(1)
        self.token_slots.fill_(-1)
        self.num_valid = torch.zeros(1, **i64)   # the step's real rows: a MoE block routes no padded row
        self.block_tables = torch.zeros(n, self.width, **i64)
        self.logits_indices = torch.arange(n, **i64)
        # (batch, width, LoRA tier) -> graph, logits / -> the capture's error (that bucket runs eagerly)
        self.graphs: dict[tuple[int, int, frozenset | None], tuple[object, torch.Tensor]] = {}
        self.failed: dict[tuple[int, int, frozenset | None], str] = {}
        self._pool = None
        if self.emulated:
            self._new_graph, self._graph_context = tape_graph.TapeGraph, tape_graph.graph
        else:
            self._new_graph, self._graph_context = platform.graph, platform.graph_context
        self.lazy = self.emulated
        # (batch bucket, LoRA tier) -> (CPUGraph, logits), None where it runs eagerly (its capture failed)
        self.use_cpu_graphs = (platform.name == "cpu" and not config.enforce_eager and not self.emulated
                               and tp_size == 1 and cpu_graph.available())   # TP: its collectives are no ops
        # the buckets whose linears cpu_gemv.c takes (bf16, up to max_rows rows): the others' would be oneDNN's
        self.cpu_graph_rows = (cpu_gemv.max_rows() if self.use_cpu_graphs and kv_cache.k.dtype == torch.bfloat16
                               else 0)
        self.cpu_graphs: dict[tuple[int, frozenset | None], tuple[cpu_graph.CPUGraph, torch.Tensor] | None] = {}
        if capture and not self.lazy:
            self._capture_all()

    def _bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def width_bucket(self, width: int) -> int:
        """The narrowest captured width covering `width` blocks."""
        return next(w for w in self.widths if w >= width)

    def tier(self, groups: frozenset[str] | None) -> frozenset[str] | None:
        """The narrowest captured LoRA tier covering `groups` (what the step's adapters fill; None: all)."""
        if groups is None:
            return self.tiers[-1]
        return next((t for t in self.tiers if t is None or groups <= t), self.tiers[-1])

    def _graph_lora(self, b: int, groups: frozenset[str] | None) -> LoRABatchInfo | None:
        if self.lora_backend is None:
            return None
        return self.lora_backend.graph_info(self.token_slots[:b], groups)

    def _batch(self, b: int, width: int, lora: LoRABatchInfo | None) -> ForwardBatch:
        return ForwardBatch(input_ids=self.input_ids[:b], positions=self.positions[:b],
                            slot_mapping=self.slot_mapping[:b], logits_indices=self.logits_indices[:b],
                            num_decode_tokens=b, block_tables=self.block_tables[:b, :width],
                            context_lens=self.context_lens[:b], lora=lora, lm_lora=lora, graph_safe=self.graph_safe,
                            all_rows_logits=True)

    def _fill(self, plan: StepPlan, b: int, zero_tables: bool = True) -> int:
        """Copy the plan into the static buffers (padded rows reset); returns the block-table width used. Without
        zero_tables the columns past it keep older steps' blocks (the CPU graphs' kernel reads a row's own only)."""
        B, bs = plan.num_seqs, self.block_size
        pad = b - B
        width = max(blocks_needed(n, bs) for n in plan.seq_lens)
        tables = [t + [0] * (width - len(t)) for t in plan.block_tables] + [[0] * width] * pad
        slot_mapping = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(plan.block_tables, plan.seq_lens)]
        rows = [plan.input_ids + [0] * pad, plan.positions + [0] * pad, slot_mapping + [0] * pad,
                plan.seq_lens + [1] * pad, plan.lora_slots + [-1] * pad]
        self._rows[:, :b].copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
        self.num_valid.fill_(B)
        if zero_tables:
            self.block_tables[:b].zero_()
        self.block_tables[:b, :width].copy_(torch.tensor(tables, dtype=torch.int64), non_blocking=True)
        return width

    def decode(self, plan: StepPlan, lora: Callable[[], LoRABatchInfo | None] | None,
               groups: frozenset[str] | None = None) -> torch.Tensor:
        """Logits [num_seqs, vocab]; `lora` makes the host-segment info the eager control path uses (a step that
        replays a graph does not), `groups` the LoRA groups the step's adapters fill (None: every group)."""
        B = plan.num_seqs
        b = self._bucket(B)
        cpu_key = (b, self.tier(groups))
        if self.use_cpu_graphs and b <= self.cpu_graph_rows and self.cpu_graphs.get(cpu_key, ()) is not None:
            self._fill(plan, b, zero_tables=False)   # () above: not tried yet; None: its capture failed
            if cpu_key not in self.cpu_graphs:
                self.cpu_graphs[cpu_key] = self._capture_cpu(*cpu_key)
            if self.cpu_graphs[cpu_key] is not None:
                graph, logits = self.cpu_graphs[cpu_key]
                graph.replay()
                return logits[:B]
        b = b if (self.capture or self.graph_safe) else B
        width = self._fill(plan, b)
        if self.capture:
            key = (b, self.width_bucket(width), self.tier(groups))
            if self.lazy and key not in self.graphs and key not in self.failed:
                self._capture(*key)
            if key in self.graphs:
                graph, logits = self.graphs[key]
                graph.replay()
                return logits[:B]
        lora = self._graph_lora(b, groups) if self.graph_safe else (lora() if lora is not None else None)
        return self.model(self._batch(b, width, lora), self.kv_cache)[:B]

    def _cpu_batch(self, b: int, tier: frozenset[str] | None) -> ForwardBatch:
        """The static buffers' first b rows at full width, for the C kernels: attention reads the tables in place,
        LoRA (the tier's groups; none: no LoRA code at all) each row's slot from the static slot buffer."""
        lora = self._graph_lora(b, tier) if tier else None
        return ForwardBatch(input_ids=self.input_ids[:b], positions=self.positions[:b],
                            slot_mapping=self.slot_mapping[:b], logits_indices=self.logits_indices[:b],
                            num_decode_tokens=b, block_tables=self.block_tables[:b], context_lens=self.context_lens[:b],
                            lora=lora, lm_lora=lora, graph_safe=False, all_rows_logits=True,
                            valid_tokens=self.num_valid)

    def _capture_cpu(self, b: int, tier: frozenset[str] | None) -> tuple[cpu_graph.CPUGraph, torch.Tensor] | None:
        """Batch bucket b's kernel program with LoRA tier `tier` on the static buffers as they are (this step's), or
        None: that (bucket, tier) then runs eagerly (said once in the log)."""
        batch = self._cpu_batch(b, tier)
        try:
            with torch.inference_mode():
                self.model(batch, self.kv_cache)   # warm-up: lazy initialisation must not happen while capturing
                graph = cpu_graph.CPUGraph()
                with cpu_graph.graph(graph):
                    logits = self.model(batch, self.kv_cache)
        except Exception as e:   # noqa: BLE001: the eager path is the same maths, a failed capture only costs speed
            logger.info("CPU decode graph for batch bucket %d, LoRA groups %s not captured, it runs eagerly: %s: %s",
                        b, _groups(tier), type(e).__name__, e)
            return None
        if graph.num_torch_ops > MAX_CPU_GRAPH_TORCH_OPS:
            logger.info("CPU decode graph for batch bucket %d, LoRA groups %s: %d torch ops beside %d kernel calls; "
                        "it runs eagerly", b, _groups(tier), graph.num_torch_ops, graph.num_kernel_calls)
            return None
        return graph, logits

    def _capture_all(self) -> None:
        for tier in reversed(self.tiers):     # largest first so smaller graphs reuse its memory pool
            for b in reversed(self.buckets):
                for w in reversed(self.widths):
                    self._capture(b, w, tier)

    def _capture(self, b: int, w: int, tier: frozenset[str] | None) -> None:
        """Capture the (batch b, width w) graph with the LoRA ops of `tier` on the static buffers as they are;
        on failure that bucket runs eagerly from now on (one warning)."""
        key = (b, w, tier)
        batch = self._batch(b, w, self._graph_lora(b, tier))
        try:
            with torch.inference_mode():
                self.model(batch, self.kv_cache)  # warm-up: lazy initialisation must not happen while capturing
                self.platform.synchronize()
                graph = self._new_graph()
                with self._graph_context(graph, self._pool):
                    logits = self.model(batch, self.kv_cache)
        except Exception as e:   # noqa: BLE001: any capture failure degrades to eager, never kills the worker
            self.failed[key] = f"{type(e).__name__}: {e}"
            logger.warning("decode graph capture failed for batch bucket %d, block-table width %d (%d tokens), "
                           "LoRA groups %s; that bucket runs eagerly: %s", b, w, w * self.block_size,
                           "all" if tier is None else sorted(tier), self.failed[key])
            return
        self._pool = graph.pool()
        self.graphs[key] = (graph, logits)
