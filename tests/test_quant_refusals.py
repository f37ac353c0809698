"""Issue 23, item 0: a checkpoint we do not understand is never served. What we do not implement is a start-up
error naming it: quantization_config, other description types, quantized embeddings / LM head, metadata, mixed
fused shards, offsets, unconsumed tensors, int8 tensors without a description. (The served W8A8 path:
tests/test_quant.py.)"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers import EngineConfig, LLMEngine
from workers.quant.description import DESCRIPTION_FILE, QuantizationError
from workers.quant.writer import quantize_checkpoint

pytestmark = pytest.mark.slow   # as tests/test_quant.py: make test-fast skips the W8A8 checkpoints


@pytest.fixture(scope="module")
def w8a8(model_dir, tmp_path_factory):
    """A W8A8_DYNAMIC checkpoint of the tiny Qwen3, as `loraserve quantize` writes it."""
    path = tmp_path_factory.mktemp("w8a8-refusals") / "model"
    quantize_checkpoint(model_dir("qwen3"), path)
    return path


def start(path):
    LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", enable_lora=False)).close()


def copy_of(path, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(path, target)
    return target


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", "compressed-tensors", "bitsandbytes"])
def test_quantization_config_refused_by_name(model_dir, tmp_path, method):
    path = copy_of(model_dir("qwen3"), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match=f"quant_method='{method}'"):
        start(path)


@pytest.mark.parametrize("key,value,match", [
    ("model.layers.0.self_attn.q_proj.weight", "W8A8", "static W8A8"),
    ("model.layers.0.mlp.up_proj.weight", "W4A8_DYNAMIC", "W4A8_DYNAMIC"),
    ("lm_head.weight", "W8A8_DYNAMIC", "LM head stay FLOAT"),
    ("model.embed_tokens.weight", "W8A8_DYNAMIC", "embeddings"),
    ("kv_quant_type", "C8", "kv_quant_type"),
    ("group_size", 128, "per-group"),
    ("model_quant_type", "W8A16", "model_quant_type"),
    ("model.layers.0.self_attn.k_proj.weight", "FLOAT", r"k_proj.weight_\w+' is W8A8_DYNAMIC but its module's"),
    ("model.layers.0.self_attn.k_proj.*", "FLOAT", r"self_attn.q_proj.*fused into one linear are not all"),
])
def test_description_types_refused_by_name(w8a8, tmp_path, key, value, match):
    path = copy_of(w8a8, tmp_path)
    description = json.loads((path / DESCRIPTION_FILE).read_text())
    for name in [k for k in description if k.startswith(key[:-1])] if key.endswith("*") else [key]:
        description[name] = value
    (path / DESCRIPTION_FILE).write_text(json.dumps(description))
    with pytest.raises(QuantizationError, match=match):
        start(path)


def rewrite(path, edit):
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        index.write_text(json.dumps({"metadata": {}, "weight_map": {k: file.name for k in tensors}}))


def test_unconsumed_tensors_refused_by_name_inv_freq_tolerated(model_dir, tmp_path):
    path = copy_of(model_dir("qwen3"), tmp_path)
    rewrite(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}))
    start(path)
    rewrite(path, lambda t: t.update({"model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(4, 4)}))
    with pytest.raises(ValueError, match=r"does not use.*mlp\.experts\.0\.up_proj\.weight"):
        start(path)


def test_int8_weights_without_a_description_refused(w8a8, tmp_path):
    path = copy_of(w8a8, tmp_path)
    (path / DESCRIPTION_FILE).unlink()
    with pytest.raises(ValueError, match=r"is I8, but the model reads it as float|weight_scale"):
        start(path)


def test_asymmetric_offsets_refused(w8a8, tmp_path):
    path = copy_of(w8a8, tmp_path)
    rewrite(path, lambda t: t["model.layers.1.mlp.down_proj.weight_offset"].fill_(3.0))
    with pytest.raises(QuantizationError, match=r"layers\.1\.mlp\.down_proj: non-zero weight_offset"):
        start(path)
