"""Worker: one device's share of the model; executes StepPlans.

In-process when tensor_parallel_size == 1 (the engine calls it directly); the
same class runs as a Ray actor per device rank otherwise (worker_group.py).
"""
from __future__ import annotations

from typing import Callable

from lora.adapter import LoRAAdapter
from workers.config import EngineConfig
from workers.device import Platform
from workers.parallel import TPGroup
from workers.plan import StepPlan
from workers.runner import ModelRunner, RuntimeInfo


class Worker:
    def __init__(self, config: EngineConfig, runtime: RuntimeInfo, platform: Platform,
                 get_adapter: Callable[[str, str], LoRAAdapter], tp: TPGroup = TPGroup(), device_index: int = 0):
        platform.set_device(device_index)
        self.runner = ModelRunner(config, runtime, platform, tp, platform.torch_device(device_index), get_adapter)

    def execute(self, plan: StepPlan) -> tuple[list[int], list[float]]:
        return self.runner.execute(plan)

    def is_alive(self) -> bool:
        return True
