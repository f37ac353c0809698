"""Write msModelSlim's AscendV1 W8A8_DYNAMIC layout from a 16/32-bit checkpoint (`loraserve quantize`).

Each of the decoder layers' seven projections becomes `weight` int8 [out, in], `weight_scale` fp32
[out, 1] and `weight_offset` fp32 [out, 1] (zeros): per output channel, symmetric,
    weight_scale[n] = max_k |W[n, k]| / 127,   weight[n, k] = round(W[n, k] / weight_scale[n]).
Everything else (embeddings, norms, the LM head, a qkv bias) is copied unchanged and described FLOAT
in quant_model_description.json, so real msModelSlim checkpoints and ours load through the same code.
One output shard per input shard, so memory stays at one shard.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.models.loader import safetensors_files
from workers.quant.description import DESCRIPTION_FILE, FLOAT, QUANTIZABLE, W8A8_DYNAMIC, read_quantization

TINY = torch.finfo(torch.float32).tiny


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8: (q int8 [out, in], scale fp32 [out, 1]) with weight ~= q * scale."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).div(127.0).clamp_min(TINY)
    return torch.round(w / scale).clamp_(-127, 127).to(torch.int8), scale


def quantize_checkpoint(src: Path, dst: Path) -> dict:
    """Write the W8A8_DYNAMIC form of the checkpoint at `src` into the new directory `dst`; returns the description."""
    from transformers import AutoConfig

    src, dst = Path(src), Path(dst)
    if read_quantization(src, AutoConfig.from_pretrained(src)) is not None:
        raise ValueError(f"{src} is already quantized ({DESCRIPTION_FILE})")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():   # config, tokenizer, generation config; weights are rewritten below
        if item.is_file() and not item.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(item, dst / item.name)
    description: dict[str, str] = {"model_quant_type": W8A8_DYNAMIC, "version": "1.0.0"}
    files = safetensors_files(src)
    weight_map: dict[str, str] = {}
    for i, file in enumerate(files):
        out_name = f"quant_model_weight_w8a8_dynamic-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(os.fspath(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                match = QUANTIZABLE.match(name)
                if match and match.group(4) == "weight":
                    prefix = name.removesuffix(".weight")
                    q, scale = quantize_weight(tensor)
                    tensors.update({name: q, f"{prefix}.weight_scale": scale,
                                    f"{prefix}.weight_offset": torch.zeros_like(scale)})
                    description.update({k: W8A8_DYNAMIC for k in (name, f"{prefix}.weight_scale",
                                                                  f"{prefix}.weight_offset")})
                else:
                    tensors[name] = tensor.contiguous()
                    description[name] = W8A8_DYNAMIC if match and match.group(4) == "bias" else FLOAT
        save_file(tensors, os.fspath(dst / out_name), metadata={"format": "pt"})
        weight_map.update({name: out_name for name in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (dst / DESCRIPTION_FILE).write_text(json.dumps(description, indent=1))
    return description
