"""The fleet benchmark's adapters: FLEET.num_adapters PEFT adapters (rank FLEET.adapter_rank, every linear of the
demo model) with random A and B, generated once under .cache/fleet/.

Written directly in PEFT's format (deployments.demo_model.write_adapter: adapter_config.json +
adapter_model.safetensors with PEFT's keys) rather than through 200 PEFT models: a few seconds in all.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.checkpoint import ALL7
from benchmarks.fleet_workload import FleetSpec, adapter_names
from deployments.demo_model import default_cache_dir, ensure_demo, write_adapter

SEED = 1000   # adapter i gets seed SEED + i: every adapter has weights of its own


def ensure_fleet_adapters(spec: FleetSpec) -> tuple[Path, dict[str, str]]:
    """(the demo model's directory, {adapter name: adapter directory}), generated on first use."""
    from transformers import AutoConfig

    model_dir, _ = ensure_demo()
    root = default_cache_dir() / "fleet" / f"demo-r{spec.adapter_rank}-n{spec.num_adapters}"
    names = adapter_names(spec.num_adapters)
    if not (root / "COMPLETE").is_file():
        staging = root.with_name(root.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        hf_config = AutoConfig.from_pretrained(model_dir)
        for i, name in enumerate(names):
            write_adapter(staging / name, hf_config, spec.adapter_rank, 2 * spec.adapter_rank, ALL7, SEED + i)
        (staging / "COMPLETE").write_text("")
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    return model_dir, {name: str(root / name) for name in names}
