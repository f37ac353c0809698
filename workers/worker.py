"""Worker: one device's share of the model; executes StepPlans.

In-process when tensor_parallel_size == 1 (the engine calls it directly); the
same class runs as a Ray actor per device rank otherwise (worker_group.py).
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

from lora.adapter import LoRAAdapter, load_adapter, model_spec_from_hf_config
from lora.transfer import allow_pinning
from workers.config import EngineConfig
from workers.device import Platform
from workers.parallel import TPGroup
from workers.plan import StepPlan
from workers.runner import ModelRunner, RuntimeInfo


class Worker:
    def __init__(self, config: EngineConfig, runtime: RuntimeInfo, platform: Platform,
                 get_adapter: Callable[[str, str, int], LoRAAdapter], tp: TPGroup = TPGroup(), device_index: int = 0):
        platform.set_device(device_index)
        allow_pinning(platform.name != "cpu")   # this process holds the device it copies to (lora/transfer.py)
        if platform.name == "cpu":
            torch.set_num_threads(config.cpu_threads or cpu_threads_per_rank(config.tensor_parallel_size))
        self.runner = ModelRunner(config, runtime, platform, tp, platform.torch_device(device_index), get_adapter)

    def execute(self, plan: StepPlan) -> tuple[list[int], list[float]]:
        return self.runner.execute(plan)

    def is_alive(self) -> bool:
        return True

    def is_healthy(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def resident_bytes(self) -> dict:
        """What this rank holds: bytes per model parameter (tied ones once), LoRA slot buffers, KV cache."""
        runner = self.runner
        return {"params": {name: p.nbytes for name, p in runner.model.named_parameters()},
                "lora_slots": runner.slot_pool.nbytes() if runner.slot_pool is not None else 0,
                "kv_cache": runner.kv_cache.k.nbytes + runner.kv_cache.v.nbytes}


def adapter_loader(config: EngineConfig, hf_config) -> Callable[[str, str, int], LoRAAdapter]:
    """A remote rank's own host copy of adapters: plans name (slot, adapter, source, load id), never ship tensors.

    LRU of `max_loaded_loras`, keyed by (name, source, load id): the controller's host cache gives
    every read of an adapter's files a new id, so when it reads them again (the adapter reloaded,
    or evicted and paged back in) every rank does too, instead of keeping weights from before.
    """
    spec = model_spec_from_hf_config(hf_config.to_dict(), config.lora_target_modules)

    @functools.lru_cache(maxsize=config.max_loaded_loras)
    def get_adapter(name: str, source: str, load_id: int) -> LoRAAdapter:
        return load_adapter(name, source, spec, max_lora_rank=config.max_lora_rank,
                            adapter_roots=config.adapter_roots or None, allow_hub=config.hub_adapters_allowed)

    return get_adapter


def cpu_threads_per_rank(ranks: int) -> int:
    """This process's CPUs shared among the ranks (all on one node: the CPU placement packs them)."""
    return max(1, len(os.sched_getaffinity(0)) // ranks)
