"""The LoRA backends' names (EngineConfig.lora_backend) and each device type's default, apart from
lora/backends/ (which imports torch and the kernels) so that validating a config imports neither."""
from __future__ import annotations

BACKENDS = ("torch_native", "cpu", "ascend")
DEFAULTS = {"cpu": "cpu", "cuda": "torch_native", "npu": "ascend"}   # by device type
