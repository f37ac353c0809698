"""ModelRunner: one device's model shard, KV cache, LoRA slots; executes StepPlans.

A pure decode step goes through the GraphRunner (captured on CUDA / NPU; on the CPU its kernel program); every
other step (prefill chunks, with or without decodes beside them) runs eagerly.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from lora.adapter import LoRAAdapter
from lora.backends import get_backend
from lora.expert_layers import wrap_experts
from lora.expert_memory import check_expert_slots, free_memory
from lora.layers import layers_with, lora_shard, wrap_model
from lora.modules import EXPERT_GROUPS, MODULE_GROUPS, PACKED_MODULES
from lora.native import huge_page_copy
from lora.ref import AdapterRef
from lora.slots import GroupShape, SlotPool
from lora.transfer import to_device
from workers.config import MAX_LOGIT_BIAS, EngineConfig
from workers.device import Platform
from workers.forward_batch import ForwardBatch, PrefillChunk
from workers.graph_runner import GraphRunner
from workers.kv_cache import KVCache, attend_as_rows, blocks_needed, row_tables
from workers.models.loader import load_weights
from workers.models.moe_kernels import moe_kernel
from workers.models.registry import model_class
from workers.parallel import TPGroup, prepack_linears
from workers.plan import StepOutput, StepPlan
from workers.quant.description import W8A8Spec
from workers.quant.kernels import w8a8_kernel
from workers.quant.w8a8_linear import check_described, finish_loading, quantize_layer
from workers.sampler import SamplerState, sample

log = logging.getLogger(__name__)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RuntimeInfo:
    """Values the engine computes at start-up (never written back into the config)."""
    model_path: Path
    hf_config: object
    dtype: str
    max_model_len: int
    num_kv_blocks: int
    quantization: W8A8Spec | None = None   # the checkpoint's W8A8 linears (workers/quant/description.py)


class ModelRunner:
    def __init__(self, config: EngineConfig, runtime: RuntimeInfo, platform: Platform, tp: TPGroup,
                 device: torch.device, get_adapter: Callable[[AdapterRef], LoRAAdapter] | None = None):
        self.config, self.runtime, self.platform, self.tp, self.device = config, runtime, platform, tp, device
        self.dtype = TORCH_DTYPES[runtime.dtype]
        cfg = runtime.hf_config
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        quantize = None
        if runtime.quantization is not None:
            check_described(runtime.quantization, cfg.num_hidden_layers)
            quantize = partial(quantize_layer, runtime.quantization, w8a8_kernel(platform.name, self.dtype))
        try:
            with torch.device(device):
                self.model = model_class(cfg)(cfg, tp, runtime.max_model_len, finish_layer=quantize).eval()
        finally:
            torch.set_default_dtype(previous)
        load_weights(self.model, runtime.model_path)
        finish_loading(self.model)
        if hasattr(self.model, "use_moe_kernel") and (kernel := moe_kernel(platform.name, self.dtype)) is not None:
            self.model.use_moe_kernel(kernel)   # the NPU's grouped-matmul / MoE routing ops (torch_npu)
        if platform.name == "cpu" and config.prepack_weights is not False:
            prepack_linears(self.model)
            if hasattr(self.model, "prepack_experts"):
                self.model.prepack_experts()
        attn = self.model.layers[0].self_attn
        self.kv_cache = KVCache(cfg.num_hidden_layers, runtime.num_kv_blocks, config.kv_block_size,
                                attn.num_kv_heads, attn.head_dim, self.dtype, device)
        # The CPU cache on transparent huge pages: a decode step writes each sequence's new K/V rows into blocks
        # far apart and attention reads them all back, a 4 KiB page walk for every few rows otherwise (batch-32
        # bench decode, one process alternating: attention 637 -> 593 us a layer, q/k rope + KV write 137 -> 130).
        self.kv_cache.k, self.kv_cache.v = huge_page_copy(self.kv_cache.k), huge_page_copy(self.kv_cache.v)
        self.vocab_size = cfg.vocab_size
        self.sampler_state = SamplerState(config.max_num_seqs, cfg.vocab_size, MAX_LOGIT_BIAS, device)
        self.get_adapter = get_adapter
        self.lora_backend = None
        self.slot_pool = self._init_lora() if config.enable_lora else None
        capture, graph_safe = platform.supports_graphs and not config.enforce_eager, config.graph_safe_decode
        self.graph_runner = GraphRunner(self.model, self.kv_cache, platform, device, config, runtime.max_model_len,
                                        capture=capture, graph_safe=capture if graph_safe is None else graph_safe,
                                        lora_backend=self.lora_backend,
                                        lora_groups=frozenset(self.slot_pool.groups) if self.slot_pool else None,
                                        tp_size=self.tp.size)

    def is_healthy(self) -> bool:   # the executor's interface (WorkerGroup's): in this process, alive if asked
        return True

    def close(self) -> None:
        pass

    def resident_bytes(self) -> dict:
        """What this rank holds: bytes per model parameter (tied ones once), LoRA slot buffers, KV cache."""
        return {"params": {name: p.nbytes for name, p in self.model.named_parameters()},
                "lora_slots": self.slot_pool.nbytes() if self.slot_pool is not None else 0,
                "kv_cache": self.kv_cache.k.nbytes + self.kv_cache.v.nbytes}

    def _init_lora(self) -> SlotPool:
        cfg = self.runtime.hf_config
        wanted = {MODULE_GROUPS[module][0] for module in self.config.lora_target_modules}
        groups = {}
        for group in PACKED_MODULES:
            if group.name not in wanted:
                continue
            if group.parallel == "embedding":      # A and B replicated
                groups[group.name] = GroupShape(cfg.vocab_size, (cfg.hidden_size,))
            elif group.parallel == "lm_head":
                groups[group.name] = GroupShape(cfg.hidden_size, (self.model.lm_head.shard_size,))
            elif layers := layers_with(self.model, group.path):   # this rank's in_features / out_sizes
                base = self.model.layers[layers[0]].get_submodule(group.path)
                experts = base.num_experts if group.name in EXPERT_GROUPS else 0
                groups[group.name] = GroupShape(base.in_features, tuple(base.out_sizes), tuple(layers), experts)
        self._check_expert_slots(groups)
        pool = SlotPool(cfg.num_hidden_layers, groups, self.config.max_loras_per_batch, self.config.max_lora_rank,
                        self.dtype, self.device, shard=lora_shard(self.model),
                        num_expert_slots=self.config.num_expert_loras)
        # chosen once (the Ascend kernels' probe runs here); each layer's ops are bound by it below
        self.lora_backend = get_backend(self.config.lora_backend, self.device, self.dtype, self.config.max_lora_rank)
        wrap_model(self.model, pool.buffers, self.lora_backend)
        wrap_experts(self.model, self.lora_backend, pool)
        return pool

    def _check_expert_slots(self, groups: dict) -> None:
        """MoE: the expert slots' memory, said once at start-up (rank 0); refused before allocation if too big."""
        gb = self.config.expert_lora_memory_gb
        budget, source = ((lambda: int(gb * 2 ** 30)), "expert_lora_memory_gb") if gb is not None else \
            ((lambda: free_memory(self.device)), f"free on {self.device.type}")
        report = check_expert_slots(groups, self.runtime.hf_config.num_hidden_layers, self.config.num_expert_loras,
                                    self.config.max_lora_rank, self.dtype, budget, source)
        if report and self.tp.rank == 0:
            log.info(report)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        failed = self._load_slots(plan)
        self.sampler_state.admit(plan.sampler_inits)
        logits = self._decode(plan) if plan.is_decode else self._mixed(plan)
        num_sampled = plan.num_sampled
        out = StepOutput([], [], failed_adapters=failed)
        if plan.wants_prompt_logprobs:
            out.prompt_logprobs = prompt_logprobs(logits[num_sampled:], plan)
        if num_sampled:   # else: only chunks of longer prompts, nothing to sample
            if plan.grammar_rows:
                self.sampler_state.load_bitmask(num_sampled, plan.grammar_rows, plan.token_bitmask)
            tensors = self.sampler_state.tensors(plan.sampler_slots, plan.steps, bool(plan.grammar_rows))
            result = sample(logits[:num_sampled], tensors, self.sampler_state)
            out.tokens = result.tokens.tolist()
            # NaN: no row of the step asked for logprobs (sampler.sample computed none)
            out.logprobs = [math.nan] * num_sampled if result.logprobs is None else result.logprobs.tolist()
            if result.top_ids is not None:
                out.top_logprobs = [list(zip(ids, lps)) for ids, lps in zip(result.top_ids.tolist(),
                                                                           result.top_logprobs.tolist())]
        return out

    def _load_slots(self, plan: StepPlan) -> dict[str, str]:
        """The plan's slot loads; an adapter that cannot be installed leaves its slot empty (zero delta) and
        is reported, so that only its requests fail: no per-adapter fault is an engine fault. The step
        still runs on every rank (the ranks meet in its collectives)."""
        failed = {}
        for slot, ref in plan.lora_loads:
            try:
                self.slot_pool.load(slot, self.get_adapter(ref), plan.lora_expert_slots.get(slot))
            except Exception as exc:  # noqa: BLE001  (reported per adapter, the engine carries on)
                self.slot_pool.clear(slot)
                failed[ref] = f"adapter {ref.name!r} could not be installed on rank {self.tp.rank}: {exc}"
        return failed

    def _decode(self, plan: StepPlan) -> torch.Tensor:
        # The graph-safe path reads its own static slot buffer; only the eager path needs host segments.
        host_lora = partial(self._lora_info, plan.lora_slots, "decode")
        groups = None if self.slot_pool is None else self.slot_pool.groups_of(plan.lora_slots)
        return self.graph_runner.decode(plan, None if self.graph_runner.graph_safe else host_lora, groups)

    def _lora_info(self, token_slots: list[int], phase: str = "prefill"):
        """Only the groups that the step's adapters target run (the others would add zeros)."""
        if self.slot_pool is None:
            return None
        return self.lora_backend.batch_info(token_slots, self.slot_pool.slot_ranks, phase,
                                            self.slot_pool.groups_of(token_slots))

    def _mixed(self, plan: StepPlan) -> torch.Tensor:
        """Any step that is not a pure decode, eagerly: decode rows first, then prefill chunks."""
        bs = self.config.kv_block_size
        as_tensor = lambda xs: to_device(xs, self.device, torch.int64)  # noqa: E731
        d = plan.num_decode_rows
        if attend_as_rows(self.device, self.dtype, plan.seq_lens[d:]):   # on the CPU: every row as a decode row
            d = len(plan.query_lens)
        slot_mapping, token_slots, logits_indices, chunks = [], [], [], []
        prompt_rows, prompt_slots = [], []   # rows scored for prompt logprobs: after the sampled ones
        row = 0
        for i, (n, total, table, slot) in enumerate(zip(plan.query_lens, plan.seq_lens, plan.block_tables,
                                                        plan.lora_slots)):
            start = total - n
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, total)]
            token_slots += [slot] * n
            if i >= d:
                blocks = as_tensor(table[:blocks_needed(total, bs)]) if start else None
                chunks.append(PrefillChunk(row, n, start, blocks))
            targets = plan.prompt_logprob_targets[i] if plan.prompt_logprob_targets else None
            if targets:
                prompt_rows += range(row, row + len(targets))
                prompt_slots += [slot] * len(targets)
            row += n
            if plan.samples[i]:
                logits_indices.append(row - 1)
        # the leading d sequences' rows attend through the decode kernel
        block_tables, context_lens, table_rows = row_tables(plan.query_lens[:d], plan.seq_lens[:d],
                                                            plan.block_tables[:d], as_tensor) if d else (None,) * 3
        lm_slots = [slot for slot, samples in zip(plan.lora_slots, plan.samples) if samples] + prompt_slots
        batch = ForwardBatch(input_ids=as_tensor(plan.input_ids), positions=as_tensor(plan.positions),
                             slot_mapping=as_tensor(slot_mapping),
                             logits_indices=as_tensor(logits_indices + prompt_rows),
                             num_decode_tokens=sum(plan.query_lens[:d]), block_tables=block_tables,
                             context_lens=context_lens, table_rows=table_rows, chunks=tuple(chunks),
                             lora=self._lora_info(token_slots), lm_lora=self._lora_info(lm_slots))
        return self.model(batch, self.kv_cache)


def prompt_logprobs(logits: torch.Tensor, plan: StepPlan) -> list:
    """Per sequence (None where not asked): (logprob, top alternatives) of each prompt token scored in this
    step; `logits` holds their rows, sequence after sequence. Raw distribution, as for sampled tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = [t for t in plan.prompt_logprob_targets if t]
    chosen = logprobs.gather(-1, torch.tensor([x for t in targets for x in t], dtype=torch.int64,
                                              device=logits.device)[:, None]).squeeze(-1).tolist()
    k = plan.num_prompt_logprobs
    top = [[] for _ in chosen]
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    out, row = [], 0
    for t in plan.prompt_logprob_targets:
        if t is None:
            out.append(None)
            continue
        out.append(list(zip(chosen[row:row + len(t)], top[row:row + len(t)])))
        row += len(t)
    return out
