"""The serving load against the engine alone (benchmarks/serving_engine.py) on a tiny model: the same
requests as the HTTP benchmark's, every one served in full (seconds, no timing asserted)."""
from __future__ import annotations

from dataclasses import replace


def test_engine_alone_serves_the_http_benchmarks_requests(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_BENCH_CACHE", str(tmp_path / "cache"))
    from benchmarks import serving, serving_engine
    from benchmarks.common import TINY_SIZES

    sizes = replace(TINY_SIZES, threads=1)
    load = replace(serving.ServingLoad(), num_requests=5, num_adapters=2, input_range=(4, 8),
                   output_range=(3, 6))
    data = serving_engine.run(sizes, load, rates=(50.0, 100.0), log=lambda *_: None)
    assert [r["rate"] for r in data["runs"]] == [50.0, 100.0]
    for run, timed in zip(data["runs"], serving.loads_at(load, (50.0, 100.0))):
        summary = run["summary"]
        expected = sum(r["max_tokens"] for r in serving.make_requests(timed, sizes.shape.vocab_size))
        assert summary["failed"] == 0 and summary["output_tokens"] == expected   # ignore_eos: every token
        # a stream whose consumer lagged the engine (a loaded CI machine) gets its remaining tokens in one delta, 0 ms
        # apart: the median stream may read 0 (a clean clone did), but not every stream
        assert summary["tpot_ms"]["p99"] > 0 and summary["tpot_ms"]["p50"] >= 0
        assert summary["ttft_ms"]["p99"] >= summary["ttft_ms"]["p50"]
    # each rate has its own prompts (no prefix-cache hits from the run before), the same for both modes
    first, second = (serving.make_requests(t, sizes.shape.vocab_size) for t in serving.loads_at(load, (50.0, 100.0)))
    assert [r["prompt"] for r in first] != [r["prompt"] for r in second]
