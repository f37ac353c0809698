"""The model class for a Hugging Face config's model_type."""
from __future__ import annotations

from workers.models.llama import LlamaForCausalLM
from workers.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES = {model_type: cls for cls in (LlamaForCausalLM, Qwen3MoeForCausalLM) for model_type in cls.model_types}


def model_class(hf_config) -> type[LlamaForCausalLM]:
    cls = MODEL_CLASSES.get(hf_config.model_type)
    if cls is None:
        raise ValueError(f"model_type {hf_config.model_type!r} is not supported ({tuple(MODEL_CLASSES)})")
    return cls
