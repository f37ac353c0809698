"""The LoRA op API, punica style: output first, updated in place.

With R = max rank, l = info.token_slots[t] (-1: the base model, zero delta) and the slot
pool's buffers (layout in lora/backends/torch_native.py):

    add_lora:            y[t, offsets[s]:offsets[s+1]] += x[t] @ a[l, s*R:(s+1)*R].T @ b[s][l].T
                         y [T, >= offsets[-1]], x [T, in], a [L, stack*R, in], b[s] [L, out_s, R]
    add_embedding_lora:  y[t] += a[l, ids[t]] @ b[l].T
                         y [T, hidden], ids [T], a [L, vocab, R], b [L, hidden, R]

The scaling is folded into b by the slot pool; rows of a and columns of b past a slot's rank
are zero, so every implementation may compute all R ranks. `choose_impl` is the one place
that picks how an op runs; `impl=` runs a given implementation (tests reach each that way).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from lora.backends import ascend, cpu_sgmv, torch_native
from lora.batch import LoRABatchInfo

LORA_BACKENDS = ("torch_native", "ascend")   # EngineConfig.lora_backend


class Impl(NamedTuple):
    add_lora: Callable[..., None]             # (y, x, a, b, offsets, info)
    add_embedding_lora: Callable[..., None]   # (y, ids, a, b, info)


# The kernels' entries fall back to the torch ops of the same phase for operands they do not
# take (a dtype, an alignment or a rank they have no code for); embeddings are a gather.
IMPLS = {
    "torch_segments": Impl(torch_native.add_lora_segments, torch_native.add_embedding_segments),
    "torch_masked": Impl(torch_native.add_lora_masked, torch_native.add_embedding_masked),
    "cpu_sgmv": Impl(cpu_sgmv.add_lora, torch_native.add_embedding_segments),
    "cpu_bgmv": Impl(cpu_sgmv.add_lora_by_token, torch_native.add_embedding_masked),
    "ascend_sgmv": Impl(ascend.add_lora_sgmv, torch_native.add_embedding_segments),
    "ascend_bgmv": Impl(ascend.add_lora_bgmv, torch_native.add_embedding_masked),
}
GRAPH_SAFE = ("torch_masked", "cpu_bgmv", "ascend_bgmv")   # read only info.token_slots


def choose_impl(backend: str, device_type: str, phase: str) -> str:
    """The implementation for a LoRA backend on a device in a phase (prefill / decode / graph)."""
    if backend == "ascend" and device_type == "npu":
        # sgmv walks the segments from the first on every core: right for a few long prompt
        # segments, O(T) per token for one segment per token. bgmv reads each token's index
        # directly from fixed-size inputs: decode and graph replay (as vllm-ascend does).
        return "ascend_sgmv" if phase == "prefill" else "ascend_bgmv"
    if device_type == "cpu" and cpu_sgmv.available():
        # One C call per layer reads each adapter's weights once, where torch runs a small GEMM
        # per adapter and slice at ~10 us of dispatch each; the graph phase's entry groups the
        # tokens inside the kernel, so it reads only token_slots and stays traceable.
        return "cpu_bgmv" if phase == "graph" else "cpu_sgmv"
    if phase == "prefill":
        # Many tokens per adapter: one GEMM pair per adapter, exactly the size of its rows.
        return "torch_segments"
    # Decode / graph: a few tokens; fixed shapes with no host sync (capturable), and computing
    # against every slot costs little next to a kernel launch per adapter and slice.
    return "torch_masked"


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
             info: LoRABatchInfo, backend: str = "torch_native", impl: str | None = None,
             prepared: cpu_sgmv.Prepared | None = None) -> None:
    """y[t, offsets[s]:offsets[s+1]] += x[t] @ a[l, s*R:(s+1)*R].T @ b[s][l].T with l = info.token_slots[t].

    prepared: the layer's own kernel call (`prepare`), used where the CPU kernel runs eagerly."""
    if x.shape[0] == 0:   # nothing to add (and the NPU kernels' host checks refuse T = 0)
        return
    name = impl or choose_impl(backend, x.device.type, info.phase)
    if name == "cpu_sgmv":
        return cpu_sgmv.add_lora(y, x, a, b, offsets, info, prepared)
    IMPLS[name].add_lora(y, x, a, b, offsets, info)


def prepare(backend: str, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int]):
    """A LoRA layer's fixed kernel operands, bound once when it is wrapped (None where no kernel uses them)."""
    return cpu_sgmv.prepare(a, b, offsets) if a.device.type == "cpu" and backend == "torch_native" else None


def add_embedding_lora(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor, info: LoRABatchInfo,
                       backend: str = "torch_native", impl: str | None = None) -> None:
    """y[t] += a[l, ids[t]] @ b[l].T with l = info.token_slots[t]; a [L, vocab, R], b [L, hidden, R]."""
    if ids.shape[0] == 0:
        return
    IMPLS[impl or choose_impl(backend, y.device.type, info.phase)].add_embedding_lora(y, ids, a, b, info)


def prepare_backend(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """At start-up: refuse an unknown backend; for ascend, probe the installed kernels (RuntimeError)."""
    if backend not in LORA_BACKENDS:
        raise ValueError(f"unknown LoRA backend {backend!r}; known backends: {', '.join(LORA_BACKENDS)}")
    if backend == "ascend":
        if torch.device(device).type != "npu":
            raise ValueError(f"lora_backend 'ascend' runs on NPUs only, not on {torch.device(device).type}; "
                             "use torch_native")
        ascend.probe(device, dtype)
