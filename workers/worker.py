"""One device's share of the model, set up: `make_runner` builds the ModelRunner that executes StepPlans on it.

In the engine's process when tensor_parallel_size == 1 (the engine core steps the runner directly); in a
RayWorker per device rank otherwise (rank_actor.py, worker_group.py).
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
from workers.runner import ModelRunner, RuntimeInfo

CPU_THREADS_ENV = "LORASERVE_CPU_THREADS"   # the default cpu_threads of this process's engines (docs/cpu.md)


def make_runner(config: EngineConfig, runtime: RuntimeInfo, platform: Platform,
                get_adapter: Callable[[AdapterRef], LoRAAdapter], tp: TPGroup = TPGroup(),
                device_index: int = 0) -> ModelRunner:
    """The ModelRunner of this process's device: the device set, host pinning allowed where it has one, the CPU's
    threads; the engine core steps it directly (TP 1), a RayWorker per rank otherwise."""
    platform.set_device(device_index)
    allow_pinning(platform.name != "cpu")   # this process holds the device it copies to (lora/transfer.py)
    if platform.name == "cpu":
        torch.set_num_threads(config.cpu_threads or default_cpu_threads(config.tensor_parallel_size,
                                                                        config.cpu_reserved_cores))
    return ModelRunner(config, runtime, platform, tp, platform.torch_device(device_index), get_adapter)


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
