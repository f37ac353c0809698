"""Tensor-parallel linear and embedding layers and the process-group helpers.

Each layer owns only its rank's shard and knows how to cut that shard out of a
full checkpoint tensor (`weight_loader` reads a safetensors slice, so a rank
never materialises the whole tensor). Column-parallel layers split output
rows; row-parallel layers split input columns and all-reduce once.
The `lora` argument of `forward` is the step's LoRA batch info; base layers
ignore it, the LoRA wrappers that replace them (lora/layers.py) use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers import cpu_gemv


# gloo's all-reduce of a small tensor costs two message rounds (reduce-scatter, then all-gather: ~1.1 ms and
# ~0.7 ms of CPU per rank at TP=2 on the 2-core machine, whatever the size up to ~0.5 MiB); one all-gather and
# a local sum costs one round (~0.6 ms, 0.4 ms of CPU). Up to this size per rank, the gather wins at every
# size measured (benchmarks/results/tp_all_reduce.md); beyond it, moving world x the data loses.
GATHER_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None                      # torch.distributed process group when size > 1
    gather_small: bool = False                # gloo (CPU ranks): small all-reduces as one all-gather + sum
    shm: object = None                        # CPU ranks of one node: a ShmCommunicator (shm_collectives.py)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        if self.gather_small and x.numel() * x.element_size() <= GATHER_MAX_BYTES:
            # every rank sums the same gathered rows in rank order: the ranks' results stay identical
            parts = x.new_empty(self.size * x.numel())
            dist.all_gather_into_tensor(parts, x.contiguous().view(-1), group=self.group)
            return parts.view(self.size, *x.shape).sum(0)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather_last(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias). A weight prepacked for oneDNN (`prepack_linears`) runs through its kernel, but for
    a few rows of bf16 where cpu_gemv.c reads the same packed weight faster."""
    if weight.is_mkldnn:
        if (hasattr(weight, "gemv") and x.dtype == torch.bfloat16 and cpu_gemv.ENABLED
                and x.numel() <= cpu_gemv.max_rows() * x.shape[-1]):
            return cpu_gemv.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu(gate) * up of linear(x, weight, bias) = [gate | up] in one pass where cpu_gemv.c runs it (see
    `linear`), else None (the caller runs the linear and the activation)."""
    if (weight.is_mkldnn and hasattr(weight, "gemv") and x.dtype == torch.bfloat16 and cpu_gemv.ENABLED
            and x.numel() <= cpu_gemv.max_rows() * x.shape[-1] and cpu_gemv.takes_silu(weight)):
        return cpu_gemv.linear(x, weight, bias, cpu_gemv.SILU_AND_MUL)
    return None


PACK_BATCH_HINT = 32   # measured (bench shape, 2 cores): the best layout for M = 1 .. 256 alike


def prepack_linears(model: nn.Module, batch_hint: int = PACK_BATCH_HINT) -> int:
    """Reorder every linear weight once into oneDNN's blocked layout (CPU), as vLLM's CPU build does.

    torch's F.linear on the CPU re-lays the weight out on every call and streams a decode step's
    weights at ~10 GB/s here; packed, ~13 GB/s at M <= 16 and 1.4-1.8x the speed at M = 64-256
    (prefill chunks). The dense weights are dropped (an LM head tied to the embedding keeps the
    embedding's dense copy: the lookup needs it). Returns the number of layers packed.
    """
    return sum(prepack(module, batch_hint) for module in model.modules()
               if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)))


def prepack(module: nn.Module, batch_hint: int = PACK_BATCH_HINT) -> bool:
    """module.weight (a linear's [out, in], read through `linear`) reordered for oneDNN; whether it was."""
    if module.weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False   # oneDNN's bf16 reorder refuses a CPU without bf16 instructions: F.linear then
    weight = module.weight.detach()
    module.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint), requires_grad=False)
    cpu_gemv.adopt(module.weight, weight)   # its few-row calls on cpu_gemv.c where it reads the layout
    return True


def _narrow(tensor_slice, dim: int, start: int, size: int) -> torch.Tensor:
    """Read rows/cols [start, start+size) of dim 0/1 from a safetensors slice or a tensor."""
    index = (slice(start, start + size),) if dim == 0 else (slice(None), slice(start, start + size))
    return tensor_slice[index]


def _divide(n: int, d: int, what: str) -> int:
    assert n % d == 0, f"{what} ({n}) must be divisible by tensor_parallel_size ({d})"
    return n // d


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W[rows of this rank].T (+ b); outputs stay sharded."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_sizes = [_divide(n, tp.size, "output features") for n in out_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.out_sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(self.out_sizes)), requires_grad=False) if bias else None

    @property
    def out_offsets(self) -> list[int]:
        offs = [0]
        for n in self.out_sizes:
            offs.append(offs[-1] + n)
        return offs

    def shard_range(self, shard: int) -> tuple[int, int]:
        """(start, size) of this rank's rows within full checkpoint tensor `shard`."""
        n = self.out_sizes[shard]
        return self.tp.rank * n, n

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard: int = 0) -> None:
        start, size = self.shard_range(shard)
        off = self.out_offsets[shard]
        param.data[off:off + size].copy_(_narrow(tensor_slice, 0, start, size))

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v; kv heads are replicated when there are fewer than ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup):
        self.num_heads = _divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(num_kv_heads, tp.size, "num_key_value_heads")
        else:
            assert tp.size % num_kv_heads == 0, "tp size must be a multiple of num_key_value_heads"
            self.num_kv_heads = 1
        self.total_kv_heads = num_kv_heads
        self.head_dim = head_dim
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden, [q * tp.size, kv * tp.size, kv * tp.size], bias, tp)

    def shard_range(self, shard: int) -> tuple[int, int]:
        size = self.out_sizes[shard]
        if shard == 0:
            return self.tp.rank * size, size
        kv_head = self.tp.rank * self.total_kv_heads // self.tp.size if self.total_kv_heads < self.tp.size \
            else self.tp.rank * self.num_kv_heads
        return kv_head * self.head_dim, size


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W[:, cols of this rank].T) + b."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.in_features = _divide(in_features, tp.size, "input features")
        self.out_sizes = [out_features]
        self.out_offsets = [0, out_features]
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard: int = 0) -> None:
        if param.dim() == 1:  # bias: added once, after the reduction
            param.data.copy_(tensor_slice[:])
        else:
            param.data.copy_(_narrow(tensor_slice, 1, self.tp.rank * self.in_features, self.in_features))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        return self.reduce(self.partial(x))


# Vocabulary rows per shard are rounded up to this (zero rows, sliced off the logits): the NPU
# LoRA kernels copy the LM head's outputs in whole 32-byte blocks (lora/backends/ascend.py).
VOCAB_SHARD_MULTIPLE = 16


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split across ranks; out-of-shard ids contribute zero."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // (tp.size * VOCAB_SHARD_MULTIPLE)) * VOCAB_SHARD_MULTIPLE
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard: int = 0) -> None:
        size = max(0, min(self.shard_size, self.vocab_size - self.vocab_start))
        param.data[:size].copy_(_narrow(tensor_slice, 0, self.vocab_start, size))

    def forward(self, ids: torch.Tensor, lora=None) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary shard, gathered to the full vocabulary."""

    def partial(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(logits)[..., :self.vocab_size]

    def forward(self, hidden: torch.Tensor, lora=None) -> torch.Tensor:
        return self.gather(self.partial(hidden))
