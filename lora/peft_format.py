"""The PEFT LoRA format on disk: its config and its tensors (lora/sources.py finds the directory).

Knows nothing of the base model; `lora.adapter.load_adapter` validates what is
read here against a `LoRAModelSpec`. Every error names the adapter.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from lora.errors import AdapterConfigError, AdapterUnsupportedError, AdapterWeightsError
from lora.expert_format import EXPERT_PARAMETERS, ROUTER_REFUSAL
from lora.sources import (CONFIG_NAME, PICKLED_NAME, SAFETENSORS_NAME, check_inside_roots, read_small_file,
                          regular_file)

MAX_CONFIG_BYTES = 1 << 20     # a PEFT config is a few hundred bytes; this bounds what a load reads into memory

# PEFT's LoraConfig default, used when a config omits lora_alpha.
DEFAULT_LORA_ALPHA = 8

# Config fields that change what an adapter computes at inference. The kernels
# do plain LoRA only, so an adapter using any of these is refused, not served wrong.
UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "fully trained module copies",
    "trainable_token_indices": "trainable token embeddings",
    "layer_replication": "replicated layers",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
}

# PEFT saves `base_model.model.<module path>.<parameter>` with the adapter name stripped.
_TENSOR_KEY = re.compile(
    r"base_model\.model\.(?P<path>.+)\.(?P<param>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)")
_LAYER_INDEX = re.compile(r"(?:.*\.)?layers\.(\d+)\..+")


@dataclass(frozen=True)
class LoraSettings:
    """The parts of adapter_config.json that determine ranks and scalings."""
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def rank_and_scaling(self, module_path: str) -> tuple[int, float]:
        """PEFT's per-module rank and scaling for e.g. `model.layers.0.self_attn.q_proj`."""
        r = _pattern_value(self.rank_pattern, module_path, self.r)
        alpha = _pattern_value(self.alpha_pattern, module_path, self.lora_alpha)
        return r, alpha / (math.sqrt(r) if self.use_rslora else r)


def _pattern_value(pattern: dict, module_path: str, default):
    # As peft.utils.other.get_pattern_key: the first key, in file order, that
    # matches the end of the module path at a `.` boundary.
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def read_settings(name: str, directory: Path, roots: Sequence[str]) -> LoraSettings:
    path = directory / CONFIG_NAME
    check_inside_roots(name, path, roots)
    try:
        config = json.loads(read_small_file(name, path, MAX_CONFIG_BYTES).decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise AdapterConfigError(f"adapter {name!r}: {CONFIG_NAME} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise AdapterConfigError(f"adapter {name!r}: {CONFIG_NAME} must hold a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterConfigError(f"adapter {name!r}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
    for field, feature in UNSUPPORTED_FIELDS.items():
        if config.get(field):
            raise AdapterUnsupportedError(
                f"adapter {name!r}: {field}={config[field]!r} ({feature}) is not supported; expected unset")
    _check_target_parameters(name, config.get("target_parameters"))
    if config.get("bias", "none") != "none":
        raise AdapterUnsupportedError(f"adapter {name!r}: bias={config['bias']!r} is not supported; expected 'none'")
    if "r" not in config:
        raise AdapterConfigError(f"adapter {name!r}: 'r' missing in {CONFIG_NAME}")
    rank_pattern = _pattern(name, config, "rank_pattern", int)
    alpha_pattern = _pattern(name, config, "alpha_pattern", (int, float))
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterConfigError(f"adapter {name!r}: use_rslora={use_rslora!r}, expected true or false")
    return LoraSettings(r=_number(name, "r", config["r"], int),
                        lora_alpha=_number(name, "lora_alpha", config.get("lora_alpha", DEFAULT_LORA_ALPHA),
                                           (int, float)),
                        use_rslora=use_rslora, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)


def _check_target_parameters(name: str, targets) -> None:
    """PEFT's LoRA on parameters: served for the MoE experts' fused weights only (lora/expert_format.py)."""
    if not targets:
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterConfigError(f"adapter {name!r}: target_parameters must be a list of parameter names")
    for target in targets:
        if target.removesuffix(".weight").endswith("mlp.gate"):
            raise AdapterUnsupportedError(f"adapter {name!r}: target_parameters {target!r}: {ROUTER_REFUSAL}")
        # PEFT matches a name against the end of the parameter's path (it writes bare `gate_up_proj` itself
        # when it turns target_modules gate/up/down_proj into target_parameters for fused experts)
        if not any(target == p or p.endswith("." + target) or target.endswith("." + p) for p in EXPERT_PARAMETERS):
            raise AdapterUnsupportedError(f"adapter {name!r}: target_parameters {target!r} (LoRA on a parameter) is "
                                          f"not supported; expected parameters ending in {list(EXPERT_PARAMETERS)}")


def _number(name: str, field: str, value, kind):
    # bool is an int in Python; `"r": true` is still a malformed config.
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise AdapterConfigError(f"adapter {name!r}: {field}={value!r}, expected a positive number"
                                 + (" (integer)" if kind is int else ""))
    return value


def _pattern(name: str, config: dict, field: str, kind) -> dict:
    pattern = config.get(field) or {}
    if not isinstance(pattern, dict):
        raise AdapterConfigError(f"adapter {name!r}: {field} must be an object of module pattern -> value")
    for key, value in pattern.items():
        _number(name, f"{field}[{key!r}]", value, kind)
        try:
            re.compile(key)
        except re.error as error:
            raise AdapterConfigError(f"adapter {name!r}: {field} key {key!r} is not a regex: {error}") from error
    return pattern


@dataclass
class LoraTensorPair:
    """lora_A / lora_B (or lora_embedding_A / _B) of one module, as stored."""
    module_path: str            # e.g. model.layers.0.self_attn.q_proj
    layer: int                  # -1 outside the decoder layers (embed_tokens, lm_head)
    module: str                 # e.g. q_proj
    embedding: bool             # stored as lora_embedding_A / lora_embedding_B
    a_key: str
    a: torch.Tensor
    b_key: str
    b: torch.Tensor


def read_tensor_pairs(name: str, directory: Path, roots: Sequence[str]) -> list[LoraTensorPair]:
    path = directory / SAFETENSORS_NAME
    if not path.exists() and (directory / PICKLED_NAME).exists():
        raise AdapterUnsupportedError(f"adapter {name!r}: only {PICKLED_NAME} found; pickled weights are "
                                      f"refused, expected {SAFETENSORS_NAME}")
    check_inside_roots(name, path, roots)
    regular_file(name, path)
    try:
        # Read into memory once, not mmap (load_file's way): a host copy backed by the file's pages raises
        # SIGBUS and kills the process when the file is truncated later (a trainer re-saving into it).
        tensors = load(path.read_bytes())
    except (OSError, SafetensorError) as error:
        raise AdapterWeightsError(f"adapter {name!r}: cannot read {SAFETENSORS_NAME}: {error}") from error

    halves: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    kinds: dict[str, bool] = {}
    for key, tensor in sorted(tensors.items()):   # a deterministic first error
        if key.endswith(".base_layer.weight"):  # a copy of the base weight, not part of the delta
            continue
        match = _TENSOR_KEY.fullmatch(key)
        if match is None:
            raise AdapterUnsupportedError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight; expected "
                                          "base_model.model.<module>.lora_A.weight / lora_B.weight / "
                                          "lora_embedding_A / lora_embedding_B")
        module_path, param = match["path"], match["param"]
        embedding = param.startswith("lora_embedding")
        if kinds.setdefault(module_path, embedding) != embedding:
            raise AdapterWeightsError(f"adapter {name!r}: module {module_path!r} mixes lora_A/lora_B and "
                                      "lora_embedding_A/lora_embedding_B tensors")
        halves.setdefault(module_path, {})["A" if "_A" in param else "B"] = (key, tensor)

    pairs = []
    for module_path, half in halves.items():
        missing = {"A", "B"} - half.keys()
        if missing:
            present_key = next(iter(half.values()))[0]
            raise AdapterWeightsError(f"adapter {name!r}: {present_key!r} has no matching lora_{missing.pop()} "
                                      "tensor; expected both A and B")
        layer = _LAYER_INDEX.fullmatch(module_path)
        pairs.append(LoraTensorPair(module_path=module_path, layer=int(layer[1]) if layer else -1,
                                    module=module_path.rsplit(".", 1)[-1], embedding=kinds[module_path],
                                    a_key=half["A"][0], a=half["A"][1], b_key=half["B"][0], b=half["B"][1]))
    if not pairs:
        raise AdapterWeightsError(f"adapter {name!r}: {SAFETENSORS_NAME} holds no LoRA tensors; expected at least "
                                  "one lora_A/lora_B pair")
    return pairs
