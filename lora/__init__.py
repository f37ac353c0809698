"""LoRA adapters: format, validation, host cache, device slots, backends, layers.

Imports nothing from `workers/` or `deployments/`.
"""
from lora.adapter import LoRAAdapter, LoRAModelSpec, LoRAWeights, load_adapter
from lora.errors import AdapterError

__all__ = ["AdapterError", "LoRAAdapter", "LoRAModelSpec", "LoRAWeights", "load_adapter"]
