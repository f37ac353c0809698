"""EngineCore: the engine itself. One step = schedule -> execute -> postprocess.

It takes `EngineRequest`s (token ids, sampling parameters, adapter: built and checked by an edge,
workers/request.py) and gives `TokenDelta`s (token ids, logprobs, finish reasons): no strings cross it. Its
tokenizer is read once, for the ids it needs (EOS, the reasoning parser's think tokens, the tokenizer class its
fronts load). Fronts: the asynchronous one (workers/async_engine.py) holds it through a client
(workers/core_client.py); the synchronous Python API, LLMEngine (workers/engine.py), is a front over it.
"""
from __future__ import annotations

import collections
import itertools
import random

from transformers import AutoConfig, AutoTokenizer

from lora.adapter import LoRAAdapter, model_spec_from_hf_config
from lora.ref import AdapterRef
from workers.adapters import AdapterManager
from workers.config import EngineConfig
from workers.controller import Controller
from workers.device import DEFAULT_MAX_NUM_BATCHED_TOKENS, get_platform
from workers.grammar import GrammarCompiler, GrammarMatcher
from workers.kv_cache import KVCache, blocks_needed
from workers.models.loader import resolve_model_path
from workers.plan import PlanBuilder
from workers.reasoning import ReasoningGate, think_tokens
from workers.quant.description import read_quantization
from workers.runner import TORCH_DTYPES, RuntimeInfo
from workers.sequence import Sequence, TokenDelta
from workers.request import EngineRequest
from workers.worker import make_runner


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.platform = get_platform(config.device, config.device_resource)
        path = resolve_model_path(config.model)
        hf_config = AutoConfig.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.runtime = self._runtime(path, hf_config)
        self.max_num_batched_tokens = self._token_budget()
        self.adapters = None
        if config.enable_lora:
            spec = model_spec_from_hf_config(hf_config.to_dict(), config.lora_target_modules)
            self.adapters = AdapterManager(spec, max_lora_rank=config.max_lora_rank,
                                           max_loaded_loras=config.max_loaded_loras,
                                           max_loras_per_batch=config.max_loras_per_batch,
                                           max_expert_loras=config.num_expert_loras,
                                           adapter_roots=config.adapter_roots,
                                           allow_hub=config.hub_adapters_allowed,
                                           pin_memory=self._copies_to_its_device(),
                                           load_timeout_s=config.adapter_load_timeout_s)
        self.executor = self._make_executor()
        eos_ids = _eos_ids(hf_config, self.tokenizer)
        self.controller = Controller(config, self.runtime.num_kv_blocks, self.runtime.max_model_len,
                                     self.max_num_batched_tokens, self.adapters, eos_ids)
        self.planner = PlanBuilder(config.max_num_seqs, hf_config.vocab_size)
        self.grammars = GrammarCompiler(path, hf_config.vocab_size, eos_ids)   # compiles on a thread of its own
        self.think = think_tokens(config.reasoning_parser, self.tokenizer)   # a grammar waits for the reasoning
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self.last_step = (0, 0)   # (decode tokens, prefill tokens) of the last step that ran: benchmarks, stats
        # Requests whose adapter was in host memory when they arrived (the host-cache hit rate per request; the
        # cache's own hits count every step a waiting request asks), and distinct adapters summed over steps
        self.adapter_counts = dict(arrived_resident=0, arrived_not_resident=0, steps=0, step_adapters=0)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.controller.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.controller.eos_token_ids = frozenset(ids)

    def _token_budget(self) -> int:
        """Tokens per step: the config's, or the device's default (see device.py); without chunked prefill
        a whole prompt must fit one step."""
        cfg, max_len = self.config, self.runtime.max_model_len
        budget = cfg.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS[self.platform.name],
                                                   cfg.max_num_seqs)
        if not cfg.enable_chunked_prefill:
            budget = cfg.max_num_batched_tokens or max(budget, max_len)
            if budget < max_len:
                raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_len}) "
                                 f"when enable_chunked_prefill is off")
        return budget

    def _copies_to_its_device(self) -> bool:
        """Whether this process itself copies adapters to a device it holds (its in-process worker): only
        then is pinning host memory worth anything, and only then is it safe. A replica with remote
        workers holds no device (Ray hides every NPU from it, and torch_npu's pinned allocator then
        fails); its adapters travel to the workers through Ray anyway."""
        return self.platform.name != "cpu" and self.config.runs_in_process

    def _make_executor(self):
        """This process's ModelRunner for TP=1, else a WorkerGroup of Ray actors (Ray must be running: see
        worker_group.py)."""
        cfg = self.config
        if cfg.runs_in_process:
            return make_runner(cfg, self.runtime, self.platform, self._resident_adapter)
        from workers.worker_group import WorkerGroup  # imports Ray only when actors are asked for
        return WorkerGroup(cfg, self.runtime, self.platform, self._resident_adapter)

    def is_healthy(self) -> bool:
        """False once a worker died or failed: Serve's check_health replaces the replica."""
        return self.executor.is_healthy()

    def _runtime(self, path, hf_config) -> RuntimeInfo:
        cfg = self.config
        dtype = cfg.dtype if cfg.dtype != "auto" else self.platform.default_dtype(checkpoint_dtype(hf_config))
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
        return RuntimeInfo(path, hf_config, dtype, max_model_len, num_blocks, read_quantization(path, hf_config))

    # ---- requests ----------------------------------------------------------
    def add(self, request: EngineRequest, grammar=None) -> str:
        """The core's entry: a request built by an edge (LLMEngine.make_request, AsyncLLMEngine.make_request),
        trusted. `grammar`: params.structured compiled already (`self.grammars.compile`), else compiled now."""
        return self._queue(self._sequence(request, grammar))

    def _sequence(self, request: EngineRequest, grammar=None) -> Sequence:
        """What only the core can check: the adapter registered here, the request id free."""
        adapter, params = request.adapter, request.params
        if adapter is not None:
            if self.adapters is None:
                raise ValueError(f"adapter {adapter!r} requested but LoRA is disabled (enable_lora=False)")
            self.adapters.check_known(adapter)
        seed = params.seed if params.seed is not None else self._rng.randrange(2**32)
        request_id = request.request_id or f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(request_id, request.prompt_token_ids, params, seed, adapter)
        if params.structured is not None:   # compiled here unless the caller compiled it off this thread
            seq.matcher = GrammarMatcher(grammar or self.grammars.compile_now(params.structured))
            if self.think is not None:
                seq.matcher = ReasoningGate(seq.matcher, self.think.end_id,
                                            self.think.reasoning_ended(request.prompt_token_ids))
        return seq

    def _queue(self, seq: Sequence) -> str:
        self._seqs[seq.request_id] = seq
        if seq.adapter is not None:
            resident = self.adapters.cache.is_resident(self.adapters.current(seq.adapter))
            self.adapter_counts["arrived_resident" if resident else "arrived_not_resident"] += 1
        self.controller.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.controller.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.controller.has_work() or bool(self.controller.errored)

    # ---- the step ----------------------------------------------------------
    def step_deltas(self) -> list[TokenDelta]:
        """Run one step; the new tokens (or the end) of every request that progressed or ended."""
        touched = self.controller.errored
        self.controller.errored = []
        batch = self.controller.schedule()
        if batch is not None:
            plan, items = self.planner.build(batch, self.controller.eos_token_ids), batch.items
            decodes = sum(1 for n, s in zip(plan.query_lens, plan.samples) if n == 1 and s)
            self.last_step = (decodes, len(plan.input_ids) - decodes)
            try:
                out = self.executor.execute(plan)
            except Exception as exc:   # nothing is lost: the step's requests end with the error
                for seq, _ in items:
                    self.controller.finish(seq, "error", error=f"step failed: {exc!r}")
                    self._seqs.pop(seq.request_id, None)
                raise
            touched = touched + self.controller.complete(items, out)
            self.adapter_counts["steps"] += 1
            self.adapter_counts["step_adapters"] += len({seq.adapter_ref for seq, _ in items if seq.adapter_ref})
            touched, self.controller.errored = touched + self.controller.errored, []   # e.g. an adapter failed
        for seq in touched:
            if seq.is_finished:
                self._seqs.pop(seq.request_id, None)
        return [TokenDelta.of(seq) for seq in touched]

    # ---- adapters ------------------------------------------------------------
    def _resident_adapter(self, ref: AdapterRef):
        """The validated host copy the controller scheduled: what every rank installs (never its files)."""
        adapter = self.adapters.cache.get(ref)
        if adapter is None:
            raise RuntimeError(f"adapter {ref.name!r} scheduled but not resident in the host cache")
        return adapter

    def _need_lora(self) -> AdapterManager:
        if self.adapters is None:
            raise ValueError("LoRA is disabled (enable_lora=False)")
        return self.adapters

    def load_adapter(self, name: str, source: str, pinned: bool = False,
                     preloaded: tuple[LoRAAdapter, float] | None = None) -> str:
        """Register a version of `name`, its files read now (or what `AdapterManager.read` read already):
        "loaded", "replaced" (new requests get the new version, running ones keep theirs) or "unchanged"."""
        return self._need_lora().load(name, source, pinned, preloaded)

    def unload_adapter(self, name: str) -> None:
        self._need_lora().unload(name)

    def list_adapters(self) -> dict[str, str]:
        return self._need_lora().list() if self.adapters else {}

    def prefetch_adapters(self, names: list[str], replace: list[str] = ()) -> list[str]:
        """Start reading these registered adapters into host memory (background loads, as a request's would);
        returns those started. A full cache makes room only by evicting one of `replace` (AdapterManager)."""
        return self._need_lora().prefetch(names, replace) if self.adapters else []

    def stats(self) -> dict:
        c = self.controller
        out = {"step": c.step_count, "num_preemptions": c.num_preemptions, "waiting": len(c.waiting),
               "running": len(c.running), "free_kv_blocks": c.blocks.num_free,
               "total_kv_blocks": c.blocks.num_usable, "prefix_cache": c.blocks.stats()}
        if self.adapters:
            out["lora"] = self.adapters.stats()
            out["lora"]["residency"] = self.adapters.residency()
            out["lora"]["counts"] = dict(self.adapter_counts)
            out["lora"]["requests"] = {"running": _count_by_adapter(c.running),
                                       "waiting": _count_by_adapter(c.waiting)}
        return out

    def close(self) -> None:
        self.grammars.close()
        if self.adapters:
            self.adapters.close()
        self.executor.close()


def _count_by_adapter(seqs) -> dict[str, int]:
    return dict(collections.Counter(s.adapter for s in seqs if s.adapter))


def _eos_ids(hf_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return ids


def checkpoint_dtype(hf_config) -> str | None:
    """The dtype the checkpoint's config declares ("bfloat16", ...), None when it declares none."""
    declared = getattr(hf_config, "dtype", None)
    if declared is None:
        return None
    return str(declared).removeprefix("torch.")
