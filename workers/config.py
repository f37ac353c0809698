"""The engine's configuration (frozen) and per-request sampling parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SUPPORTED_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj", "embed_tokens", "lm_head")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str                                  # local HF directory or Hub id
    dtype: str = "auto"                         # auto: float32 on cpu, bfloat16 elsewhere
    device: str = "auto"                        # auto | cpu | cuda | npu
    tensor_parallel_size: int = 1
    distributed_executor: str = "auto"          # auto (in-process when TP=1) | inproc | ray
    device_resource: str | None = None          # Ray resource a worker reserves one of; default the device's
    seed: int = 0
    # scheduling
    max_num_seqs: int = 64
    max_model_len: int | None = None            # default: min(model's max positions, 4096)
    max_num_batched_tokens: int | None = None   # default: max(max_model_len, 2048)
    # KV cache
    kv_block_size: int = 16
    num_kv_blocks: int | None = None            # default: sized by kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    # LoRA
    enable_lora: bool = True
    max_loras_per_batch: int = 4
    max_loaded_loras: int = 16
    max_lora_rank: int = 64
    lora_target_modules: tuple[str, ...] = SUPPORTED_LORA_MODULES
    lora_backend: str | None = None             # default: the platform's (ascend on npu)
    adapter_roots: tuple[str, ...] = ()         # allowed local adapter dirs; empty = any
    allow_hub_adapters: bool | None = None      # Hub ids as sources; default: only without adapter_roots
    lora_max_wait_steps: int = 16               # fairness bound before strict FCFS on the LoRA budget
    # decode graphs
    enforce_eager: bool = False
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    graph_safe_decode: bool | None = None       # LoRA/attention graph-safe ops in decode; default: when capturing

    @property
    def hub_adapters_allowed(self) -> bool:
        """Hub ids bypass adapter_roots (their files live in the HF cache), so roots alone forbid them."""
        return self.allow_hub_adapters if self.allow_hub_adapters is not None else not self.adapter_roots

    def __post_init__(self):
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(f"EngineConfig: {msg}")

        need(isinstance(self.model, str) and self.model != "", "model must be a non-empty path or Hub id")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        need(self.distributed_executor in ("auto", "inproc", "ray"),
             "distributed_executor must be auto, inproc or ray")
        need(self.device_resource is None or (isinstance(self.device_resource, str) and self.device_resource != ""),
             f"device_resource must be a Ray resource name or None, got {self.device_resource!r}")
        need(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        need(self.kv_block_size >= 1, "kv_block_size must be >= 1")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks must be >= 2")
        need(self.max_loras_per_batch >= 1, "max_loras_per_batch must be >= 1")
        need(self.max_loaded_loras >= self.max_loras_per_batch,
             f"max_loaded_loras ({self.max_loaded_loras}) must be >= max_loras_per_batch "
             f"({self.max_loras_per_batch})")
        need(self.max_lora_rank >= 1, "max_lora_rank must be >= 1")
        bad = set(self.lora_target_modules) - set(SUPPORTED_LORA_MODULES)
        need(not bad, f"lora_target_modules {sorted(bad)} not supported; use {SUPPORTED_LORA_MODULES}")
        need(all(b >= 1 for b in self.graph_batch_sizes), "graph_batch_sizes must be positive")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0                    # 0 = greedy
    top_k: int = -1                             # -1 / 0 = off
    top_p: float = 1.0
    seed: int | None = None                     # per request: same seed, same samples, whatever the batch
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
