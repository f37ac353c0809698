"""workers/heap.py: the start-up heap frozen after a collection (its garbage reclaimed, not frozen), what is made
later still collected, and a configured adapter unloaded after the freeze freed (by reference counting: no cycle
holds it, or a serving process would keep its weights for good)."""
from __future__ import annotations

import gc
import weakref

import pytest

from factories import make_adapter
from lora.adapter import LoRAAdapter
from workers import EngineConfig
from workers.engine_process import build_engine
from workers.heap import freeze_startup_heap


class _Node:
    def __init__(self):
        self.me = self   # a cycle: only the collector reclaims it


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()   # this test process's heap back to the collector


def test_the_heap_is_frozen_after_its_garbage_is_collected(unfrozen):
    garbage, live = _Node(), _Node()
    dead = weakref.ref(garbage)
    del garbage
    before = gc.get_freeze_count()
    frozen = freeze_startup_heap()
    assert dead() is None, "garbage made before the freeze was frozen instead of collected"
    assert frozen == gc.get_freeze_count() > before and live.me is live
    later = _Node()
    gone = weakref.ref(later)
    del later
    gc.collect()
    assert gone() is None, "an object made after the freeze was not collected"


def test_a_configured_adapter_unloaded_after_the_freeze_is_freed(model_dir, tmp_path, unfrozen):
    model = model_dir("qwen3")
    engine = build_engine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_loras_per_batch=2,
                                       max_loaded_loras=2, max_lora_rank=8),
                          {"heap-test-configured": str(make_adapter(model, tmp_path / "a"))})
    try:
        adapters = [o for o in gc.get_objects() if isinstance(o, LoRAAdapter) and o.name == "heap-test-configured"]
        refs = [weakref.ref(x) for a in adapters for x in (a, *(w.lora_a for w in a.weights.values()))]
        assert len(refs) > 1
        del adapters
        freeze_startup_heap()
        gc.disable()   # reference counting alone must free it
        try:
            engine.unload_adapter("heap-test-configured")
            alive = sum(ref() is not None for ref in refs)
        finally:
            gc.enable()
        assert alive == 0, f"{alive} of the unloaded adapter's objects outlived it: a reference cycle holds them"
    finally:
        engine.close()
