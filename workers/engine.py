"""LLMEngine: the synchronous engine. One step = schedule -> execute -> postprocess."""
from __future__ import annotations

import itertools
import random
import time
from typing import Sequence as Seq

from transformers import AutoConfig, AutoTokenizer

from lora.adapter import model_spec_from_hf_config
from workers.adapters import AdapterManager
from workers.config import EngineConfig, SamplingParams
from workers.controller import Controller
from workers.device import get_platform
from workers.kv_cache import KVCache, blocks_needed
from workers.models.loader import resolve_model_path
from workers.runner import TORCH_DTYPES, RuntimeInfo
from workers.sequence import RequestOutput, Sequence
from workers.worker import Worker

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.platform = get_platform(config.device, config.device_resource)
        path = resolve_model_path(config.model)
        hf_config = AutoConfig.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.runtime = self._runtime(path, hf_config)
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(self.runtime.max_model_len, 2048)
        if self.max_num_batched_tokens < self.runtime.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_model_len ({self.runtime.max_model_len})")
        self.adapters = None
        if config.enable_lora:
            spec = model_spec_from_hf_config(hf_config.to_dict(), config.lora_target_modules)
            self.adapters = AdapterManager(spec, max_lora_rank=config.max_lora_rank,
                                           max_loaded_loras=config.max_loaded_loras,
                                           max_loras_per_batch=config.max_loras_per_batch,
                                           adapter_roots=config.adapter_roots,
                                           allow_hub=config.hub_adapters_allowed,
                                           pin_memory=self.platform.name != "cpu")
        self.executor = self._make_executor()
        self.controller = Controller(config, self.runtime.num_kv_blocks, self.runtime.max_model_len,
                                     self.max_num_batched_tokens, self.adapters)
        self.eos_token_ids = _eos_ids(hf_config, self.tokenizer)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}

    def _make_executor(self):
        """In-process Worker for TP=1, else a WorkerGroup of Ray actors (Ray must be running: see worker_group.py)."""
        cfg = self.config
        if cfg.tensor_parallel_size == 1 and cfg.distributed_executor != "ray":
            return Worker(cfg, self.runtime, self.platform, self._resident_adapter)
        if cfg.distributed_executor == "inproc":
            raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} needs one process per rank; "
                             "use distributed_executor='auto' or 'ray'")
        from workers.worker_group import WorkerGroup  # imports Ray only when actors are asked for
        return WorkerGroup(cfg, self.runtime, self.platform)

    def is_healthy(self) -> bool:
        """False once a worker died or failed: Serve's check_health replaces the replica."""
        return self.executor.is_healthy()

    def _runtime(self, path, hf_config) -> RuntimeInfo:
        cfg = self.config
        dtype = cfg.dtype if cfg.dtype != "auto" else ("float32" if self.platform.name == "cpu" else "bfloat16")
        max_model_len = cfg.max_model_len or min(getattr(hf_config, "max_position_embeddings", 4096), 4096)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        kv_heads = max(1, hf_config.num_key_value_heads // cfg.tensor_parallel_size)
        per_block = KVCache.bytes_per_block(hf_config.num_hidden_layers, cfg.kv_block_size, kv_heads, head_dim,
                                            TORCH_DTYPES[dtype])
        per_seq = blocks_needed(max_model_len, cfg.kv_block_size)
        num_blocks = cfg.num_kv_blocks or 1 + min(int(cfg.kv_cache_memory_gb * 2**30) // per_block,
                                                  cfg.max_num_seqs * per_seq)
        if (num_blocks - 1) < per_seq:
            raise ValueError(f"the KV cache ({num_blocks - 1} usable blocks of {cfg.kv_block_size} tokens) cannot "
                             f"hold one sequence of max_model_len={max_model_len}; raise num_kv_blocks / "
                             f"kv_cache_memory_gb or lower max_model_len")
        return RuntimeInfo(path, hf_config, dtype, max_model_len, num_blocks)

    # ---- requests ----------------------------------------------------------
    def _make_sequence(self, prompt: Prompt, params: SamplingParams, adapter: str | None,
                       request_id: str | None) -> Sequence:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer(prompt).input_ids
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.runtime.hf_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                 f"[0, {self.runtime.hf_config.vocab_size})")
        if not token_ids:
            raise ValueError("prompt is empty")
        limit = self.runtime.max_model_len
        if len(token_ids) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({limit})")
        if adapter is not None:
            if self.adapters is None:
                raise ValueError(f"adapter {adapter!r} requested but LoRA is disabled (enable_lora=False)")
            self.adapters.check_known(adapter)
        seed = params.seed if params.seed is not None else self._rng.randrange(2**32)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return Sequence(request_id, token_ids, params, seed, adapter)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, adapter: str | None = None,
                    request_id: str | None = None) -> str:
        seq = self._make_sequence(prompt, params or SamplingParams(), adapter, request_id)
        self._seqs[seq.request_id] = seq
        self.controller.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.controller.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.controller.has_work() or bool(self.controller.errored)

    # ---- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of every request that progressed or ended."""
        touched = self.controller.errored
        self.controller.errored = []
        scheduled = self.controller.schedule()
        if scheduled is not None:
            plan, seqs = scheduled
            try:
                tokens, logprobs = self.executor.execute(plan)
            except Exception as exc:   # nothing is lost: the step's requests end with the error
                for seq in seqs:
                    self.controller.finish(seq, "error", error=f"step failed: {exc!r}")
                    self._seqs.pop(seq.request_id, None)
                raise
            self.controller.append_tokens(seqs, tokens, logprobs, self.eos_token_ids)
            for seq in seqs:
                self._detokenize(seq)
            touched = touched + seqs
        for seq in touched:
            if seq.is_finished:
                self._seqs.pop(seq.request_id, None)
        return [RequestOutput.of(seq) for seq in touched]

    def _detokenize(self, seq: Sequence) -> None:
        seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        stops = seq.params.stop
        if not stops or seq.finish_reason == "stop":
            return
        hits = [i for i in (seq.text.find(s) for s in stops) if i >= 0]
        if hits:
            seq.text = seq.text[:min(hits)]
            self.controller.finish(seq, "stop")

    def generate(self, prompts: Seq[Prompt] | Prompt, params: SamplingParams | Seq[SamplingParams] | None = None,
                 adapters: Seq[str | None] | None = None) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
        params = params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        adapters = list(adapters) if adapters is not None else [None] * len(prompts)
        if not len(prompts) == len(params) == len(adapters):
            raise ValueError(f"got {len(prompts)} prompts, {len(params)} sampling params, {len(adapters)} adapters")
        seqs = [self._make_sequence(p, sp, a, None) for p, sp, a in zip(prompts, params, adapters)]
        for seq in seqs:
            self._seqs[seq.request_id] = seq
            self.controller.add(seq)
        while not all(seq.is_finished for seq in seqs):
            if not self.step():
                time.sleep(0.001)   # waiting on a background adapter load
        return [RequestOutput.of(seq) for seq in seqs]

    # ---- adapters ------------------------------------------------------------
    def _resident_adapter(self, name: str, source: str, load_id: int):
        adapter = self.adapters.cache.get(name)
        assert adapter is not None, f"adapter {name!r} scheduled but not resident"
        return adapter

    def _need_lora(self) -> AdapterManager:
        if self.adapters is None:
            raise ValueError("LoRA is disabled (enable_lora=False)")
        return self.adapters

    def load_adapter(self, name: str, source: str, pinned: bool = False) -> None:
        self._need_lora().load(name, source, pinned)

    def unload_adapter(self, name: str) -> None:
        self._need_lora().unload(name)

    def list_adapters(self) -> dict[str, str]:
        return self._need_lora().list() if self.adapters else {}

    def stats(self) -> dict:
        c = self.controller
        out = {"step": c.step_count, "num_preemptions": c.num_preemptions, "waiting": len(c.waiting),
               "running": len(c.running), "free_kv_blocks": c.allocator.num_free,
               "total_kv_blocks": c.allocator.num_usable}
        if self.adapters:
            out["lora"] = self.adapters.stats()
        return out

    def close(self) -> None:
        if self.adapters:
            self.adapters.close()
        self.executor.close()


def _eos_ids(hf_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return ids
