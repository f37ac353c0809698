"""PEFT LoRA adapters: the in-memory form and loading with validation.

Data classes below are the contract used by the cache, the slot pool and the
engine; `load_adapter` reads the PEFT format (safetensors only).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Per-layer linear modules, in the order the model stacks them (qkv, gate_up).
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Whole-model modules; their weights are stored under layer index -1.
GLOBAL_MODULES = ("embed_tokens", "lm_head")
SUPPORTED_MODULES = LINEAR_MODULES + GLOBAL_MODULES


@dataclass(frozen=True)
class LoRAModelSpec:
    """What validation needs to know of the base model (unsharded shapes).

    module_dims maps a module name to (in_features, out_features) of the base
    layer; for embed_tokens it is (vocab_size, hidden_size).
    """
    num_layers: int
    module_dims: dict[str, tuple[int, int]]


@dataclass
class LoRAWeights:
    """One module's LoRA pair (fp32, CPU), PEFT orientation.

    linear:       lora_a [r, in],    lora_b [out, r];   delta = x @ a.T @ b.T * scaling
    embed_tokens: lora_a [r, vocab], lora_b [hidden, r]; delta = a.T[ids] @ b.T * scaling
    """
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAAdapter:
    name: str
    source: str
    rank: int                                   # max rank over modules
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], LoRAWeights] = field(repr=False)  # (layer or -1, module)

    def nbytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.weights.values())
