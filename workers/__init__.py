"""The engine: config, controller, workers, model runner, models, TP layers, KV cache, graphs, devices.

The names below are imported on first use (PEP 562): importing a light module of the package (workers.config,
workers.errors) must not load the engine and torch (the ingress imports those; tests/test_ingress_imports.py).
"""
from __future__ import annotations

import importlib

_EXPORTS = {"EngineConfig": "workers.config", "SamplingParams": "workers.config", "LLMEngine": "workers.engine",
            "RequestOutput": "workers.sequence"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'workers' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
