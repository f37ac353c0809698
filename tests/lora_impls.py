"""Every LoRA op implementation by name, and a batch info with every field, for the tests that hold each
implementation against the references (tests/lora_reference.py). The product never picks an op by name: a
backend binds its layers' ops once (lora/backends/base.py `bind`) and builds only the batch info fields they read.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from lora import ops
from lora.backends import ascend, cpu_sgmv
from lora.batch import LoRABatchInfo, plan_step, segments
from lora.transfer import to_device


def ascend_sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                offsets: Sequence[int], info: LoRABatchInfo) -> None:
    """Prefill as AscendBackend.bind decides it: sgmv over the step's segments (torch.ops.npu: the emulator of
    tests/ascend_emulator.py) where the kernels take the operands, else the torch segments."""
    if not ascend.eligible(y, x, a, b, offsets, ascend.device_dtypes(x.device)):
        return ops.add_lora_segments(y, x, a, b, offsets, info)
    ascend._add_lora(y, x, a, b, offsets, info, False, torch.ops.npu)


def ascend_bgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                offsets: Sequence[int], info: LoRABatchInfo) -> None:
    """Decode and graph replay: bgmv over info.token_slots where the kernels take the operands, else the
    masked torch ops."""
    if not ascend.eligible(y, x, a, b, offsets, ascend.device_dtypes(x.device)):
        return ops.add_lora_masked(y, x, a, b, offsets, info)
    ascend._add_lora(y, x, a, b, offsets, info, True, torch.ops.npu)


class Impl(NamedTuple):
    add_lora: Callable[..., None]             # (y, x, a, b, offsets, info)
    add_embedding_lora: Callable[..., None]   # (y, ids, a, b, info)


IMPLEMENTATIONS = {
    "torch_segments": Impl(ops.add_lora_segments, ops.add_embedding_segments),
    "torch_masked": Impl(ops.add_lora_masked, ops.add_embedding_masked),
    "cpu_sgmv": Impl(cpu_sgmv.add_lora, ops.add_embedding_segments),
    "cpu_bgmv": Impl(cpu_sgmv.add_lora_by_token, ops.add_embedding_masked),
    "ascend_sgmv": Impl(ascend_sgmv, ops.add_embedding_segments),
    "ascend_bgmv": Impl(ascend_bgmv, ops.add_embedding_masked),
}


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
             info: LoRABatchInfo, impl: str | None = None) -> None:
    """y += the LoRA delta by the implementation named `impl`; None: the torch maths of info's phase
    (segments eager, masked in graphs), as lora.backends.base.torch_ops binds them."""
    if x.shape[0] == 0:   # as LayerLoRA: nothing to add (and the NPU kernels' host checks refuse T = 0)
        return
    if impl is None:
        impl = "torch_masked" if info.use_graph else "torch_segments"
    IMPLEMENTATIONS[impl].add_lora(y, x, a, b, offsets, info)


def add_embedding_lora(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor, info: LoRABatchInfo,
                       impl: str | None = None) -> None:
    """y[t] += a[l, ids[t]] @ b[l].T by the implementation named `impl` (None: as add_lora picks)."""
    if ids.shape[0] == 0:
        return
    if impl is None:
        impl = "torch_masked" if info.use_graph else "torch_segments"
    IMPLEMENTATIONS[impl].add_embedding_lora(y, ids, a, b, info)


def make_batch_info(token_slots: list[int], slot_ranks: list[int], max_rank: int,
                    device: torch.device | str = "cpu", use_graph: bool = False,
                    phase: str | None = None, gemm_min_tokens: int | None = None) -> LoRABatchInfo:
    """Every field of the batch info from host data (backends build only the fields their ops read).

    phase: "prefill" (the default; also right for a step mixing prompts and decodes) or
    "decode" (one token per sequence); use_graph=True is the graph phase.
    """
    lens, slots = segments(token_slots)
    T, S = len(token_slots), len(lens)
    packed = to_device([*token_slots, *lens, *slots], device, torch.int64)   # one transfer, three views
    plan = None if use_graph else plan_step(tuple(lens), tuple(slots), tuple(slot_ranks), max_rank, device,
                                            gemm_min_tokens)
    return LoRABatchInfo(
        token_slots=packed[:T], seg_lens=packed[T:T + S], seg_slots=packed[T + S:],
        seg_lens_host=tuple(lens), seg_slots_host=tuple(slots), token_slots_host=tuple(token_slots),
        slot_ranks_host=tuple(slot_ranks), max_rank=max_rank, use_graph=use_graph,
        phase="graph" if use_graph else phase or "prefill", plan=plan)
