"""Shared fixtures: tiny random checkpoints built once per session in a temp dir."""
from __future__ import annotations

import os

import pytest

# Before anything imports ray: every Ray process binds loopback only, no token auth, no usage stats.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from factories import load_hf, make_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(arch, **overrides) -> path of a tiny random checkpoint (cached per arguments)."""
    cache = {}

    def build(arch: str = "qwen3", **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_model(tmp_path_factory.mktemp(arch), arch, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) -> (transformers model, tokenizer), cached."""
    cache = {}

    def load(path):
        if path not in cache:
            cache[path] = load_hf(path)
        return cache[path]

    return load
