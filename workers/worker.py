"""Worker: one device's share of the model; executes StepPlans.

In-process when tensor_parallel_size == 1 (the engine calls it directly); the
same class runs as a Ray actor per device rank otherwise (worker_group.py).
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from lora.adapter import LoRAAdapter
from lora.ref import AdapterRef
from lora.transfer import allow_pinning
from workers.config import EngineConfig
from workers.device import Platform
from workers.parallel import TPGroup
from workers.plan import StepOutput, StepPlan
from workers.runner import ModelRunner, RuntimeInfo

CPU_THREADS_ENV = "LORASERVE_CPU_THREADS"   # the default cpu_threads of this process's engines (docs/cpu.md)


class Worker:
    def __init__(self, config: EngineConfig, runtime: RuntimeInfo, platform: Platform,
                 get_adapter: Callable[[AdapterRef], LoRAAdapter], tp: TPGroup = TPGroup(), device_index: int = 0):
        platform.set_device(device_index)
        allow_pinning(platform.name != "cpu")   # this process holds the device it copies to (lora/transfer.py)
        if platform.name == "cpu":
            torch.set_num_threads(config.cpu_threads or default_cpu_threads(config.tensor_parallel_size,
                                                                            config.cpu_reserved_cores))
        self.runner = ModelRunner(config, runtime, platform, tp, platform.torch_device(device_index), get_adapter)

    def execute(self, plan: StepPlan) -> StepOutput:
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


def default_cpu_threads(ranks: int, reserved: int = 0) -> int:
    """$LORASERVE_CPU_THREADS when set (as vLLM's CPU backend takes its OpenMP threads from the environment), else
    `cpu_threads_per_rank`."""
    value = os.environ.get(CPU_THREADS_ENV)
    if value is None:
        return cpu_threads_per_rank(ranks, reserved)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{CPU_THREADS_ENV} must be an integer >= 1, got {value!r}")
    return int(value)


def cpu_threads_per_rank(ranks: int, reserved: int = 0) -> int:
    """This process's CPUs but `reserved`, shared among the ranks (all on one node: the CPU placement packs
    them); at least one thread each."""
    return max(1, (len(os.sched_getaffinity(0)) - reserved) // ranks)
