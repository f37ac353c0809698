"""The start-up heap frozen out of the garbage collector's reach in the processes that serve (the engine process,
a Serve replica, the ingress), as vLLM freezes its engine core's and API server's after start-up (`freeze_gc_heap`).

Why: a served engine holds ~200,000 tracked objects after start-up (torch modules, the tokenizer, transformers'
configs); a full collection walks them all, ~40-60 ms of this machine's time (benchmarks/RESULTS.md, twelfth
session), and Python runs one whenever enough new objects have survived: a pause of every stream of the replica at
a moment nobody chose. Frozen, they are skipped (a full collection of the rest: under 1 ms). Objects made later
are collected as before. The price, vLLM's too: a start-up object that later becomes part of an unreachable cycle
stays (reference counting still frees everything else: tests/test_heap.py unloads a configured adapter after
the freeze and finds its weights freed).
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze what lives (garbage frozen now would never be reclaimed); the number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
