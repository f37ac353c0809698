"""The Llama-family decoder: Llama (untied), Qwen2 (qkv bias), Qwen3 (q/k RMSNorm, tied).

Works on packed tokens [T, hidden]; attention reads and writes the paged KV cache.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lora.modules import PACKED_MODULES_MAPPING
from workers import cpu_ops
from workers.forward_batch import ForwardBatch
from workers.kv_cache import paged_attention, write_kv
from workers.parallel import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                              TPGroup, VocabParallelEmbedding, linear_silu)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_ops.rms_norm(x, self.weight, self.eps)
        return self.reference(x) if out is None else out

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)): a decoder layer's residual add and the norm after it, one pass on the CPU."""
        fused = cpu_ops.add_rms_norm(x, delta, self.weight, self.eps)
        if fused is not None:
            return fused
        x = x + delta
        return x, self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch maths (other devices; the CPU kernel's definition, rounding included)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# ---- rotary position embedding: a precomputed cos/sin table indexed by position ------------------------------
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


class Attention(nn.Module):
    def __init__(self, cfg, layer_index: int, tp: TPGroup, rope: RotaryEmbedding):
        super().__init__()
        self.layer_index = layer_index
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bias = cfg.model_type == "qwen2" or getattr(cfg, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, False, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        qk_norm = cfg.model_type in ("qwen3", "qwen3_moe")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rope = rope
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]):
        qkv = self.qkv_proj(x, batch.lora)
        q, k, v = self.attention_inputs(qkv, batch, kv)
        out = paged_attention(q, k, v, kv[0], kv[1], batch, self.scale)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim), batch.lora)

    def attention_inputs(self, qkv: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]):
        """q, k, v [T, heads, head_dim] of the qkv projection: q/k normed (Qwen3) and rotated, k/v written
        to the cache; one kernel pass on the CPU (workers/cpu_ops.c)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        k_cache, v_cache = kv
        qk_norm = self.q_norm is not None
        fused = cpu_ops.qkv_rope(qkv, batch.positions, *self.rope.tables(qkv.dtype),
                                 self.q_norm.weight if qk_norm else None, self.k_norm.weight if qk_norm else None,
                                 self.q_norm.eps if qk_norm else 0.0, self.num_heads, self.num_kv_heads,
                                 k_cache, v_cache, batch.slot_mapping)
        if fused is not None:
            return (*fused, qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, self.head_dim))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(batch.positions, q, k)
        write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.lora is None:   # no adapter adds to gate_up's output: the activation can run in its GEMV's pass
            fused = linear_silu(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
            if fused is not None:
                return self.down_proj(fused, None)
        return self.down_proj(self.act(self.gate_up_proj(x, batch.lora)), batch.lora)

    @staticmethod
    def act(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, one pass on the CPU (workers/cpu_ops.c)."""
        out = cpu_ops.silu_and_mul(gate_up)
        if out is None:
            gate, up = gate_up.chunk(2, dim=-1)
            out = F.silu(gate) * up
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_index: int, tp: TPGroup, rope: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index, tp, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, kv):
        """(this layer's MLP output, the residual stream before it added): each residual add is done by the norm
        after it (the next layer's input norm adds this layer's MLP output), one pass on the CPU. x: the previous
        layer's MLP output, or the embedding with residual None."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_and_norm(residual, x)
        residual, h = self.post_attention_layernorm.add_and_norm(residual, self.self_attn(h, batch, kv))
        return self.mlp(h, batch), residual


class LlamaForCausalLM(nn.Module):
    # fused module -> the checkpoint modules stacked in it (qkv_proj, gate_up_proj), for the loader
    packed_modules_mapping = PACKED_MODULES_MAPPING
    model_types = SUPPORTED_MODEL_TYPES

    def __init__(self, cfg, tp: TPGroup, max_positions: int,
                 finish_layer: Callable[[int, nn.Module], object] | None = None):
        super().__init__()
        if cfg.model_type not in self.model_types:
            raise ValueError(f"model_type {cfg.model_type!r} is not supported ({self.model_types})")
        self.config = cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = RotaryEmbedding(cfg, head_dim, max_positions)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            layer = DecoderLayer(cfg, i, tp, rope, self.make_mlp(cfg, i, tp))
            if finish_layer is not None:   # W8A8: its linears swapped for int8 ones before the next is built
                finish_layer(i, layer)
            self.layers.append(layer)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_mlp(self, cfg, index: int, tp: TPGroup) -> nn.Module:
        """Layer `index`'s MLP (Qwen3-MoE: a sparse block in most layers, workers/models/qwen3_moe.py)."""
        return MLP(cfg, tp)

    def forward(self, batch: ForwardBatch, kv_cache) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in the model's dtype (the sampler widens them to fp32 only where
        its maths needs it: a greedy step without logprobs reads them as they are)."""
        x, residual = self.embed_tokens(batch.input_ids, batch.lora), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch, (kv_cache.k[i], kv_cache.v[i]))
        if batch.all_rows_logits:   # a decode step: the last residual add and norm as one kernel, no row gather
            return self.lm_head(self.norm.add_and_norm(residual, x)[1], batch.lm_lora)
        rows = batch.logits_indices
        return self.lm_head(self.norm(residual[rows] + x[rows]), batch.lm_lora)
