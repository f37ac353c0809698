"""PEFT LoRA adapters: the in-memory form and loading with validation.

Data classes below are the contract used by the cache, the slot pool and the
engine; `load_adapter` reads the PEFT format (safetensors only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from lora.errors import AdapterRankError, AdapterShapeError, AdapterTargetError, AdapterWeightsError
from lora.expert_format import split_expert_pairs
from lora.modules import GLOBAL_MODULES, LINEAR_MODULES, SUPPORTED_MODULES
from lora.peft_format import LoraSettings, LoraTensorPair, read_settings, read_tensor_pairs
from lora.sources import resolve_source

__all__ = ["GLOBAL_MODULES", "LINEAR_MODULES", "SUPPORTED_MODULES", "LoRAAdapter", "LoRAModelSpec", "LoRAWeights",
           "load_adapter", "model_spec_from_hf_config"]

@dataclass(frozen=True)
class LoRAModelSpec:
    """What validation needs to know of the base model (unsharded shapes).

    module_dims maps a module name to (in_features, out_features) of the base
    layer; for embed_tokens it is (vocab_size, hidden_size); for an expert module
    (experts.gate_proj, ...) one expert's. A mixture-of-experts model has its
    experts in `sparse_layers` and dense MLPs in the others.
    """
    num_layers: int
    module_dims: dict[str, tuple[int, int]]
    num_experts: int = 0
    sparse_layers: frozenset[int] = frozenset()


@dataclass
class LoRAWeights:
    """One module's LoRA pair (fp32, CPU), PEFT orientation.

    linear:       lora_a [r, in],    lora_b [out, r];   delta = x @ a.T @ b.T * scaling
    embed_tokens: lora_a [r, vocab], lora_b [hidden, r]; delta = a.T[ids] @ b.T * scaling
    experts:      lora_a [E, r, in], lora_b [E, out, r]; expert e's rows: x @ a[e].T @ b[e].T * scaling
    """
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-2]


@dataclass
class LoRAAdapter:
    name: str
    source: str
    rank: int                                   # max rank over modules
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], LoRAWeights] = field(repr=False)  # (layer or -1, module)

    def nbytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.weights.values())


def model_spec_from_hf_config(cfg_dict: dict, modules: Iterable[str] = SUPPORTED_MODULES) -> LoRAModelSpec:
    """The spec of a Llama / Qwen2 / Qwen3 checkpoint from its config.json, for `modules` only."""
    hidden = cfg_dict["hidden_size"]
    heads = cfg_dict["num_attention_heads"]
    kv_heads = cfg_dict.get("num_key_value_heads") or heads  # absent in multi-head (pre-GQA) configs
    head_dim = cfg_dict.get("head_dim") or hidden // heads   # Qwen3 sets it apart from hidden / heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    intermediate, vocab = cfg_dict["intermediate_size"], cfg_dict["vocab_size"]
    num_experts = cfg_dict.get("num_experts") or cfg_dict.get("num_local_experts") or 0
    sparse = frozenset(i for i in range(cfg_dict["num_hidden_layers"]) if num_experts
                       and i not in (cfg_dict.get("mlp_only_layers") or [])
                       and (i + 1) % cfg_dict.get("decoder_sparse_step", 1) == 0)
    moe = cfg_dict.get("moe_intermediate_size")
    expert_dims = {"experts.gate_proj": (hidden, moe), "experts.up_proj": (hidden, moe),
                   "experts.down_proj": (moe, hidden)} if sparse else {}
    dims = {**expert_dims,
        "q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden), "embed_tokens": (vocab, hidden), "lm_head": (hidden, vocab),
    }
    modules = list(modules)
    unknown = sorted(set(modules) - set(SUPPORTED_MODULES))
    if unknown:
        raise ValueError(f"modules {unknown} are not LoRA targets; expected a subset of {list(SUPPORTED_MODULES)}")
    # a dense model has no expert modules: targets it lacks are left out (an adapter naming them is refused)
    return LoRAModelSpec(num_layers=cfg_dict["num_hidden_layers"],
                         module_dims={m: dims[m] for m in modules if m in dims},
                         num_experts=num_experts if sparse else 0, sparse_layers=sparse)


def load_adapter(name: str, source: str, spec: LoRAModelSpec, *, max_lora_rank: int,
                 adapter_roots: Sequence[str] | None = None, allow_hub: bool = True) -> LoRAAdapter:
    """Read and validate the PEFT adapter at `source` (local directory or Hub `org/name[@revision]`).

    Raises an `AdapterError` subclass naming the adapter, the field and the limit.
    """
    directory, roots = resolve_source(name, source, adapter_roots, allow_hub)
    settings = read_settings(name, directory, roots)
    pairs, experts = split_expert_pairs(name, read_tensor_pairs(name, directory, roots), settings, spec, max_lora_rank,
                                        lambda key, tensor: _fp32(name, key, tensor))
    weights = {}
    for (layer, module), (a, b, scaling) in experts.items():
        if module not in spec.module_dims:
            raise AdapterTargetError(f"adapter {name!r}: layer {layer} {module} is not among the LoRA targets served "
                                     f"({sorted(spec.module_dims)})")
        weights[layer, module] = LoRAWeights(lora_a=a, lora_b=b, scaling=scaling)
    for pair in pairs:
        if (pair.layer, pair.module) in weights:  # two module paths naming the same base module
            raise AdapterTargetError(f"adapter {name!r}: {pair.module_path!r} is a second {pair.module!r} in "
                                     f"layer {pair.layer}; expected one per layer")
        weights[pair.layer, pair.module] = _validated_weights(name, pair, spec, settings, max_lora_rank)
    return LoRAAdapter(name=name, source=source, rank=max(w.rank for w in weights.values()),
                       target_modules=frozenset(module for _, module in weights), weights=weights)


def _validated_weights(name: str, pair: LoraTensorPair, spec: LoRAModelSpec, settings: LoraSettings,
                       max_lora_rank: int) -> LoRAWeights:
    _check_target(name, pair, spec)
    for key, tensor in ((pair.a_key, pair.a), (pair.b_key, pair.b)):
        if tensor.ndim != 2:
            raise AdapterShapeError(f"adapter {name!r}: tensor {key!r} has shape {list(tensor.shape)}, "
                                    "expected 2 dimensions")
    rank = pair.a.shape[0]
    if not 1 <= rank <= max_lora_rank:
        raise AdapterRankError(f"adapter {name!r}: module {pair.module_path!r} has rank {rank}, "
                               f"expected 1 to max_lora_rank {max_lora_rank}")
    # The config's rank must agree with the tensors, or the scaling below is wrong.
    config_rank, scaling = settings.rank_and_scaling(pair.module_path)
    in_dim, out_dim = spec.module_dims[pair.module]
    for key, tensor, expected in ((pair.a_key, pair.a, [config_rank, in_dim]),
                                  (pair.b_key, pair.b, [out_dim, config_rank])):
        if list(tensor.shape) != expected:
            raise AdapterShapeError(
                f"adapter {name!r}: tensor {key!r} has shape {list(tensor.shape)}, expected {expected} "
                f"(rank {config_rank} from r / rank_pattern, {pair.module} dims {in_dim} -> {out_dim})")
    return LoRAWeights(lora_a=_fp32(name, pair.a_key, pair.a), lora_b=_fp32(name, pair.b_key, pair.b),
                       scaling=scaling)


def _check_target(name: str, pair: LoraTensorPair, spec: LoRAModelSpec) -> None:
    if pair.module not in spec.module_dims:
        raise AdapterTargetError(f"adapter {name!r}: target module {pair.module!r} ({pair.module_path!r}) is "
                                 f"not supported; expected one of {sorted(spec.module_dims)}")
    is_global = pair.module in GLOBAL_MODULES
    if (pair.layer == -1) != is_global:
        raise AdapterTargetError(f"adapter {name!r}: module {pair.module_path!r} is misplaced; expected "
                                 f"{pair.module!r} {'outside' if is_global else 'inside'} the decoder layers")
    if pair.layer >= spec.num_layers:
        raise AdapterTargetError(f"adapter {name!r}: module {pair.module_path!r} is in layer {pair.layer}, "
                                 f"expected a layer below num_layers {spec.num_layers}")
    if pair.module in ("gate_proj", "up_proj", "down_proj") and pair.layer in spec.sparse_layers:
        raise AdapterTargetError(f"adapter {name!r}: module {pair.module_path!r}: layer {pair.layer} is a sparse "
                                 "(mixture-of-experts) layer with no dense MLP; its experts are targeted as "
                                 "mlp.experts.gate_up_proj / down_proj or mlp.experts.<e>.gate_proj")
    # PEFT wraps embeddings in lora.Embedding (lora_embedding_A/B) and linears in lora.Linear (lora_A/B).
    is_embedding = pair.module == "embed_tokens"
    if pair.embedding != is_embedding:
        expected = "lora_embedding_A/B" if is_embedding else "lora_A/B.weight"
        raise AdapterWeightsError(f"adapter {name!r}: {pair.a_key!r} is the wrong kind of LoRA tensor for "
                                  f"{pair.module!r}; expected {expected}")


def _fp32(name: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise AdapterWeightsError(f"adapter {name!r}: tensor {key!r} has dtype {tensor.dtype}, expected floating point")
    tensor = tensor.to(torch.float32).contiguous()
    # min and max are NaN if any value is, +-inf if any value is; one op, where isfinite(...).all()
    # cost ~60 us a tensor on CPU (an adapter has 2 per module and layer: hot-load time).
    low, high = torch.aminmax(tensor)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise AdapterWeightsError(f"adapter {name!r}: tensor {key!r} has non-finite values (nan/inf), "
                                  "expected all finite")
    return tensor

