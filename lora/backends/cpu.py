"""The cpu backend: the C kernel of cpu_sgmv.c for the LoRA of every linear layer.

Eager phases: the step's adapters with few tokens in one kernel call per layer (each reads its
adapter's weights once, where torch runs a small GEMM per adapter and slice at ~10 us of dispatch
each), adapters with many tokens by torch's GEMMs; the graph phase: the kernel's per-token entry,
a registered op with a fake (traceable, reads only the static slot buffer).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from lora.backends import cpu_sgmv
from lora.backends.base import LayerLoRA, LoRABackend, torch_ops

# An adapter with this many tokens in the step (a prompt, say) goes to torch's GEMMs on CPU:
# blocked and multi-threaded, they beat the C kernel there (1024 tokens of one adapter: 2.8
# against 8.7 ms a layer); with fewer, the kernel wins (32 decode tokens: ~60 against ~130 us).
GEMM_MIN_TOKENS = 64


class CpuBackend(LoRABackend):
    name = "cpu"
    plan_split = GEMM_MIN_TOKENS

    def bind(self, layer: str, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
             a_shared: torch.Tensor | None = None) -> LayerLoRA:
        if not cpu_sgmv.supports(torch.empty(0, dtype=self.dtype), torch.empty(0, dtype=self.dtype), a, b):
            self.fallback(layer, f"the C kernel has no {self.dtype} code")
            return torch_ops(a, b, offsets)
        prepared = cpu_sgmv.prepare(a, b, offsets, a_shared)
        if prepared is None:
            self.fallback(layer, "the C kernel does not read this buffer layout")
            return torch_ops(a, b, offsets)

        def eager(y, x, info):
            cpu_sgmv.add_lora(y, x, a, b, offsets, info, prepared)

        def graph(y, x, info):
            cpu_sgmv.add_lora_by_token(y, x, a, b, offsets, info)

        return LayerLoRA(eager, eager, graph)
