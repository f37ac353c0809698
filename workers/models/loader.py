"""Resolve a model directory and load its safetensors weights shard by shard.

Each parameter's `weight_loader` reads only its rank's slice of a checkpoint
tensor (safetensors slices are lazy), so TP ranks never load whole tensors.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def resolve_model_path(model: str) -> Path:
    """A local directory with config.json, or a Hub id resolved through huggingface_hub (offline cache ok)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model path {str(path)!r} has no config.json")
        return path
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ValueError(f"model path {model!r} does not exist")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as exc:
        raise ValueError(f"model {model!r} is neither a local directory nor a reachable Hub id: {exc}") from exc


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(path)!r} (pickled .bin weights are not loaded)")
    return files


def _target(name: str, packed: dict[str, list[str]]) -> tuple[str, int]:
    """Checkpoint tensor name -> (our parameter name, shard index), by the model's packed_modules_mapping."""
    name = name.removeprefix("model.")
    for fused, subs in packed.items():
        for shard, sub in enumerate(subs):
            if f".{sub}." in name:
                return name.replace(sub, fused), shard
    return name, 0


# Checkpoint tensors that are safe to leave unread (recomputed here); any other unconsumed tensor is an error.
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
# what a float parameter may be read from (an int8 or fp8 tensor cast to float is garbage, not weights)
FLOAT_STORAGE = ("F16", "BF16", "F32", "F64")


def load_weights(model: nn.Module, path: Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = model.packed_modules_mapping
    loaded: set[str] = set()
    unconsumed: list[str] = []
    for file in safetensors_files(path):
        with safe_open(os.fspath(file), framework="pt") as f:
            for name in f.keys():
                # a model with its own checkpoint layout (Qwen3-MoE's experts) maps its names itself
                target, shard = model.checkpoint_target(name) if hasattr(model, "checkpoint_target") \
                    else _target(name, packed)
                if target not in params:
                    if not name.endswith(HARMLESS_SUFFIXES):
                        unconsumed.append(name)
                    continue
                param = params[target]
                owner = model.get_submodule(target.rsplit(".", 1)[0])
                tensor_slice = f.get_slice(name)
                if param.is_floating_point() and tensor_slice.get_dtype() not in FLOAT_STORAGE:
                    raise ValueError(f"checkpoint tensor {name!r} is {tensor_slice.get_dtype()}, but the model "
                                     f"reads it as float: a quantized checkpoint needs its description "
                                     f"(docs/w8a8.md)")
                with torch.no_grad():
                    if hasattr(owner, "weight_loader"):
                        owner.weight_loader(param, tensor_slice, shard)
                    else:
                        param.data.copy_(tensor_slice[:])
                loaded.add(target)
    if unconsumed:
        raise ValueError(f"checkpoint {str(path)!r} has tensors the model does not use (a quantization or a "
                         f"module loraserve does not implement): {unconsumed[:8]}"
                         + (f" and {len(unconsumed) - 8} more" if len(unconsumed) > 8 else ""))
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = set(params) - loaded - tied
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is missing weights: {sorted(missing)[:8]}")
    if hasattr(model, "check_loaded"):   # pieces of one parameter (per-expert keys) the set above cannot see
        model.check_loaded(path)
