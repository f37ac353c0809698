"""LoRA compute backends: shrink / expand over the slot buffers (see registry.py)."""
from lora.backends.registry import default_backend_name, get_lora_backend, register_lora_backend

__all__ = ["default_backend_name", "get_lora_backend", "register_lora_backend"]
