"""Rotary position embedding as a precomputed cos/sin table indexed by position."""
from __future__ import annotations

import torch
from torch import nn

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    shipped = getattr(hf_config, "rope_frequencies", None)   # computed by the engine (models/plain_config.py)
    if shipped is not None and shipped[0] == head_dim:
        return shipped[1], shipped[2]
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {STATIC_ROPE_TYPES})")
    if rope_type == "default":
        base = params.get("rope_theta", 10000.0)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, attention_scaling = inverse_frequencies(hf_config, head_dim)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)
        self._rounded: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_positions, head_dim] in `dtype`: what forward's per-row .to(dtype) gives, rounded once
        (the CPU kernel reads them so, workers/cpu_ops.c)."""
        if dtype == self.cos.dtype:
            return self.cos, self.sin
        if dtype not in self._rounded:
            self._rounded[dtype] = self.cos.to(dtype), self.sin.to(dtype)
        return self._rounded[dtype]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KVH, D] rotated at `positions` [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
