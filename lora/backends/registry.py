"""Name → LoRA backend class.

Built-in backends are imported on first request, so importing this module
never imports the Ascend backend (and through it, possibly, sgl_kernel_npu).
"""
from __future__ import annotations

import importlib

_BACKENDS: dict[str, type] = {}
_BUILTIN_MODULES = {
    "torch_native": "lora.backends.torch_native",
    "ascend": "lora.backends.ascend",
}


def register_lora_backend(name: str):
    """Class decorator: make `cls` available as `get_lora_backend(name)`."""
    def register(cls: type) -> type:
        existing = _BACKENDS.get(name)
        # A module reload re-creates the same class; a different class under a taken name is a bug.
        if existing is not None and (existing.__module__, existing.__qualname__) != (
                cls.__module__, cls.__qualname__):
            raise ValueError(f"LoRA backend {name!r} is already registered as "
                             f"{existing.__module__}.{existing.__qualname__}")
        _BACKENDS[name] = cls
        return cls
    return register


def known_backend_names() -> list[str]:
    return sorted(set(_BACKENDS) | set(_BUILTIN_MODULES))


def get_lora_backend(name: str) -> type:
    """The backend class registered as `name`; built-ins are imported lazily."""
    if name not in _BACKENDS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown LoRA backend {name!r}; known backends: "
                         f"{', '.join(known_backend_names())}") from None


def default_backend_name(device_type: str) -> str:
    """Ascend NPUs use the sgmv kernels; every other device the portable torch ops."""
    return "ascend" if device_type == "npu" else "torch_native"
