"""Reproducible benchmarks of loraserve; `python -m benchmarks.run_all` runs the engine-level set.

Everything here builds its own random checkpoint and adapters (benchmarks/checkpoint.py) in
an ignored cache directory, measures ratios within one run (systems interleaved), and
writes benchmarks/results/*.json, benchmarks/RESULTS.md and PNG plots.
"""
