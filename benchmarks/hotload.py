"""Adapter hot-load latency: disk -> host (read + validate) -> device slot, for rank-16 adapters.

    .venv/bin/python -m benchmarks.hotload        (seconds)

Each sample loads a different adapter: `lora.adapter.load_adapter` (the host cache's
load function: safetensors read, validation, fp32 host copy) then `SlotPool.load`
(in-place copy into a slot of the device buffers, scaling folded in) into a pool shaped
like the engine's. The adapter files were written by this machine, so they are most
likely in the OS page cache: "disk" here is a warm-cache read.
"""
from __future__ import annotations

import json
import time

from benchmarks.checkpoint import ALL7, DTYPES, build_adapters, build_checkpoint
from benchmarks.common import (FULL, Sizes, bench_main, machine_info, set_threads, sizes_dict)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def make_slot_pool(shape, num_slots: int, max_rank: int, dtype: str):
    from lora.slots import GroupShape, SlotPool

    dims = shape.module_dims()
    q_out, kv_out = dims["q_proj"][1], dims["k_proj"][1]
    groups = {"qkv_proj": GroupShape(shape.hidden_size, (q_out, kv_out, kv_out)),
              "o_proj": GroupShape(q_out, (shape.hidden_size,)),
              "gate_up_proj": GroupShape(shape.hidden_size, (shape.intermediate_size,) * 2),
              "down_proj": GroupShape(shape.intermediate_size, (shape.hidden_size,))}
    return SlotPool(shape.num_hidden_layers, groups, num_slots, max_rank, DTYPES[dtype], "cpu")


def run(sizes: Sizes = FULL, dtype: str = "bfloat16", log=print) -> dict:
    from lora.adapter import load_adapter, model_spec_from_hf_config

    set_threads(sizes.threads)
    model_dir = build_checkpoint(dtype, sizes.shape)
    count = max(sizes.num_many, sizes.hotload_samples)
    # The least popular adapters of the paging workloads: read least recently.
    paths = build_adapters(count, sizes.shape, sizes.rank)[-sizes.hotload_samples:]
    spec = model_spec_from_hf_config(json.loads((model_dir / "config.json").read_text()), ALL7)
    pool = make_slot_pool(sizes.shape, sizes.max_loras_per_batch, sizes.rank, dtype)
    to_host, to_slot = [], []
    for i, path in enumerate(paths):
        start = time.perf_counter()
        adapter = load_adapter(f"hot-{i}", str(path), spec, max_lora_rank=sizes.rank)
        loaded = time.perf_counter()
        pool.load(i % pool.num_slots, adapter)
        to_host.append(loaded - start)
        to_slot.append(time.perf_counter() - loaded)
    total = [a + b for a, b in zip(to_host, to_slot)]
    stats = {name: {"p50_ms": percentile(v, 50) * 1e3, "p99_ms": percentile(v, 99) * 1e3,
                    "mean_ms": sum(v) / len(v) * 1e3}
             for name, v in (("disk_to_host", to_host), ("host_to_slot", to_slot), ("total", total))}
    log(f"[hotload {dtype}] total p50 {stats['total']['p50_ms']:.1f} ms, p99 {stats['total']['p99_ms']:.1f} ms "
        f"({len(total)} adapters)")
    return {"benchmark": "hotload", "dtype": dtype, "sizes": sizes_dict(sizes), "machine": machine_info(),
            "adapter_file_bytes": (paths[0] / "adapter_model.safetensors").stat().st_size,
            "samples": len(total), "latency": stats,
            "raw_ms": {"disk_to_host": [x * 1e3 for x in to_host], "host_to_slot": [x * 1e3 for x in to_slot]}}


def main(argv=None) -> dict:
    return bench_main("hotload", __doc__, run, argv)


if __name__ == "__main__":
    main()
