"""A model's config as plain values, for the tensor-parallel ranks (Ray actors, each a process of its own).

Unpickling transformers' config object would make every rank import transformers and the model's package only
to read attributes: a rank of the tests' tiny Qwen3 / Llama took 2.9-4.3 s of a core to start with it, 1.4 s
with these plain values (torch's import is most of that). So the engine sends its `to_dict()` values, and the
rotary frequencies computed on its side: llama3 and yarn scaling take transformers' rope functions.
"""
from __future__ import annotations

from workers.models.llama import inverse_frequencies


class PlainConfig:
    def __init__(self, hf_config):
        self.__dict__.update(hf_config.to_dict())
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.rope_frequencies = (head_dim, *inverse_frequencies(hf_config, head_dim))

    def __repr__(self) -> str:
        return f"PlainConfig({self.__dict__.get('model_type')!r})"
