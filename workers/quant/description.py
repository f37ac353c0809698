"""What a checkpoint says about its quantization, and the refusal of anything we do not implement.

msModelSlim's AscendV1 layout (what vllm-ascend serves) ships `quant_model_description.json`
next to the safetensors: `{"model_quant_type": "W8A8_DYNAMIC", "<tensor name>": "<type>", ...}`.
We implement the types in SUPPORTED_TYPES on the decoder layers' seven projections; any other
type, a quantized embedding / LM head / norm, or a `quantization_config` in config.json (GPTQ, AWQ,
FP8, compressed-tensors, ...) is a start-up error naming it: never serve weights as garbage.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DESCRIPTION_FILE = "quant_model_description.json"
W8A8_DYNAMIC, FLOAT = "W8A8_DYNAMIC", "FLOAT"
SUPPORTED_TYPES = (W8A8_DYNAMIC, FLOAT)
# the tensors of one W8A8_DYNAMIC linear (Qwen2's qkv bias is described like its weight)
W8A8_DYNAMIC_SUFFIXES = ("weight", "weight_scale", "weight_offset", "bias")
QUANTIZABLE = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.(\w+)$")
# metadata keys (no dot) that change nothing we compute; any other is refused by name
HARMLESS_METADATA = {"version": None, "model_quant_type": None, "group_size": (0, None)}


class QuantizationError(ValueError):
    """A checkpoint quantized in a way loraserve does not implement."""


@dataclass(frozen=True)
class W8A8Spec:
    """The W8A8_DYNAMIC linears of a checkpoint, as (layer index, checkpoint module path) pairs,
    e.g. (0, "self_attn.q_proj"). Picklable: it travels to the workers with the RuntimeInfo."""
    modules: frozenset[tuple[int, str]]
    model_quant_type: str

    def quantized(self, layer: int, checkpoint_modules: list[str]) -> bool:
        """Whether a (possibly fused) module is W8A8; its checkpoint shards must agree."""
        flags = {(layer, m) in self.modules for m in checkpoint_modules}
        if len(flags) > 1:
            raise QuantizationError(f"layer {layer}: the shards {checkpoint_modules} fused into one linear are "
                                    f"not all {W8A8_DYNAMIC} (mixed with FLOAT); a fused linear needs one type")
        return flags.pop()


def read_quantization(path: Path, hf_config) -> W8A8Spec | None:
    """The checkpoint's W8A8 spec, None for a float checkpoint; QuantizationError for what we do not implement."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else type(qc).__name__
        raise QuantizationError(f"config.json quantization_config (quant_method={method!r}) is not implemented; "
                                f"loraserve serves 16/32-bit checkpoints and msModelSlim W8A8_DYNAMIC "
                                f"({DESCRIPTION_FILE}): `loraserve quantize` writes one from a float checkpoint")
    file = path / DESCRIPTION_FILE
    if not file.is_file():
        return None
    try:
        description = json.loads(file.read_text())
    except ValueError as exc:
        raise QuantizationError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(description, dict):
        raise QuantizationError(f"{file} must be a JSON object of tensor name -> type")
    return parse_description(description)


def parse_description(description: dict) -> W8A8Spec:
    modules: set[tuple[int, str]] = set()
    companions: dict[tuple[int, str], str] = {}   # scales, offsets, bias described W8A8_DYNAMIC
    for key, value in description.items():
        if "." not in key:
            _check_metadata(key, value)
            continue
        if value == FLOAT:
            continue
        if value != W8A8_DYNAMIC:
            hint = " (static W8A8: input_scale / deq_scale per tensor; use W8A8_DYNAMIC)" if value == "W8A8" else ""
            raise QuantizationError(f"{DESCRIPTION_FILE}: {key!r} is {value!r}, which is not implemented{hint}; "
                                    f"supported: {', '.join(SUPPORTED_TYPES)}")
        match = QUANTIZABLE.match(key)
        if not match or match.group(4) not in W8A8_DYNAMIC_SUFFIXES:
            raise QuantizationError(f"{DESCRIPTION_FILE}: {key!r} is {W8A8_DYNAMIC}, but only the decoder layers' "
                                    f"q/k/v/o/gate/up/down projections are implemented quantized (embeddings, "
                                    f"norms and the LM head stay FLOAT)")
        module = (int(match.group(1)), match.group(2))
        if match.group(4) == "weight":
            modules.add(module)
        else:
            companions[module] = key
    for module, key in companions.items():
        if module not in modules:
            raise QuantizationError(f"{DESCRIPTION_FILE}: {key!r} is {W8A8_DYNAMIC} but its module's weight is not")
    model_type = description.get("model_quant_type", W8A8_DYNAMIC if modules else FLOAT)
    return W8A8Spec(frozenset(modules), model_type)


def _check_metadata(key: str, value) -> None:
    if key == "model_quant_type" and value not in SUPPORTED_TYPES:
        raise QuantizationError(f"{DESCRIPTION_FILE}: model_quant_type {value!r} is not implemented; "
                                f"supported: {', '.join(SUPPORTED_TYPES)}")
    if key not in HARMLESS_METADATA:
        raise QuantizationError(f"{DESCRIPTION_FILE}: {key!r}={value!r} is not implemented (e.g. KV-cache or "
                                f"attention quantization); refusing rather than serving it unquantized")
    allowed = HARMLESS_METADATA[key]
    if allowed is not None and value not in allowed:
        raise QuantizationError(f"{DESCRIPTION_FILE}: {key}={value!r} (per-group scales) is not implemented; "
                                f"W8A8_DYNAMIC here is per-channel")
