"""Shared fixtures: tiny random checkpoints built once per session in a temp dir; the test tiers."""
from __future__ import annotations

import os

import pytest

# Before anything imports ray: every Ray process binds loopback only, no token auth, no usage stats.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch.compile's caches (tests/test_lora_ops.py, test_capture.py) in the repo's ignored cache dir, not /tmp
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(REPO, ".cache", "torchinductor"))
# torch's OpenMP threads (libgomp) spin ~300k iterations before they sleep; the suite's two workers and their
# processes share 2 cores, where that spinning takes the CPU from the process a waiting thread waits for.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")
# `make test`'s two workers share the 2 cores: one torch thread per process, engines included, or each parallel
# op waits for a thread that the other worker's processes preempted (clean clone: 370-380 s against 434 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("LORASERVE_CPU_THREADS", "1")

from factories import load_hf, make_model  # noqa: E402
# The test tiers: `ray` / `own_cluster` markers, the shared cluster's fixtures, the guard (tests/tiers.py).
# `make test`'s two xdist workers and which modules each takes (tests/parallel.py).
from parallel import pytest_configure, pytest_unconfigure, pytest_xdist_make_scheduler  # noqa: E402,F401
from tiers import (_own_cluster, pytest_collection_modifyitems, pytest_runtest_setup,  # noqa: E402,F401
                   pytest_runtest_teardown, pytest_sessionfinish, shared_ray, shared_serve)


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


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """LORASERVE_CACHE for the CLI tests' `--demo`: one for the session, xdist's workers included (ensure_demo
    locks it), so that the demo model is built once."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "demo-cache"
