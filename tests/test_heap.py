"""workers/heap.py: the start-up heap frozen after a collection (its garbage reclaimed, not frozen), and what is made
later still collected."""
from __future__ import annotations

import gc
import weakref

import pytest

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
