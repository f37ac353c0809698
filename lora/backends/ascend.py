"""LoRA on Ascend NPUs through sgl_kernel_npu's kernels (`torch.ops.npu.*`): their contracts and the backend.

Built against sgl-kernel-npu SGL_KERNEL_NPU_VERSION (tag 2026.08.21 = commit f425bdf1; the conventions
below were checked against its sources). Two contracts exist for the same four op schemas, and the
start-up probe (lora/backends/ascend_probe.py) tells which one the installed kernels follow:
- TODAY (the tag): indices and seq_len read as int64 (int32 is misread, silently); the rank buffer h
  is fp32 (shrink writes it, expand reads it); expand reductions for R in {8, 16, 32, 64}.
- PR676 (sgl-kernel-npu PR #676, open upstream): int32 indices and a model-dtype h for sgmv and bgmv
  alike, enforced by TORCH_CHECKs (so today's calls raise on it), and rank % 16 checks.
The conventions shared by both, honoured here (buffer layout: lora/ops.py):
- shrink(x, weight, indices.., h, scale): x fp16/bf16 [T, in], weight [L, rows, in], h [T, rows]
  written where the token's index is >= 0 (so h is zeroed first); rows < in.
- expand(h, weight, indices.., y, slice_offset, slice_size): h [T, R] read densely; slot l's block
  read as the contiguous [slice_size, R] at element l * R * slice_size; y fp16/bf16 updated in place
  with row stride y.size(1) (so a strided y goes through a contiguous copy, and y.size(1) % 16 == 0
  keeps every row's offset on a 32-byte block).
- sgmv_* take segments (info.seg_slots / seg_lens) and find a token's segment by walking from the
  first on every core; bgmv_* read indices[t] (info.token_slots) directly.
Where the kernels' results are undefined or their host checks raise, `eligible` says no and the torch
ops of the same phase run instead: fp32 (a TORCH_CHECK raises), R outside the contract's ranks (the
expand has no reduction for it), and copies that are not whole 32-byte blocks (DataCopy, not
DataCopyPad): in % 16, every slice_size % 16 and y's width % 16 (the LM head shard is padded to 16
rows for this), fp32 h rows (stack * R) % 8, which R in {8, ..} already gives. T = 0 fails their host
check too: LayerLoRA returns before any op runs. 310P chips have no sgl-kernel-npu build at all
(vllm-ascend runs torch ops there): `kernel_dtypes` is empty, so the ascend backend is never chosen
there (ascend_probe.unavailable_reason, which lora.backends.get_backend reads: one message, then torch_native).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lora.backends.base import LayerLoRA, LoRABackend, torch_ops
from lora.batch import LoRABatchInfo, segments
from lora.transfer import to_device

SGL_KERNEL_NPU_VERSION = "2026.08.21"   # the sgl-kernel-npu tag (its newest)
SGL_KERNEL_NPU_COMMIT = "f425bdf1"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_RANKS = (8, 16, 32, 64)
ALIGN = 16   # fp16 / bf16 elements per 32-byte block
_T, _F, _I = "Tensor", "float", "int"
SCHEMAS = {  # the argument types of the schemas we call (the same under both contracts)
    "sgmv_shrink": (_T, _T, _T, _T, _T, _F), "sgmv_expand": (_T, _T, _T, _T, _T, _I, _I),
    "bgmv_shrink": (_T, _T, _T, _T, _F), "bgmv_expand": (_T, _T, _T, _T, _I, _I),
}


@dataclass(frozen=True)
class Contract:
    """How the installed kernels read their operands (the module docstring)."""
    name: str
    index_dtype: torch.dtype                 # lora_indices / seq_len / indices
    fp32_h: bool                             # the rank buffer h: fp32, else the model's dtype
    ranks: tuple[int, ...]                   # the R the expand has a reduction for

    def h_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.fp32_h else dtype

    def __str__(self) -> str:
        h = "fp32" if self.fp32_h else "model-dtype"
        return f"{self.name} ({str(self.index_dtype).removeprefix('torch.')} indices, {h} rank buffer)"


TODAY = Contract(f"sgl-kernel-npu {SGL_KERNEL_NPU_VERSION}", torch.int64, True, KERNEL_RANKS)
PR676 = Contract("sgl-kernel-npu PR #676", torch.int32, False, (16, 32, 64))
CONTRACTS = (TODAY, PR676)   # tried in this order: today's call raises on PR #676's host checks


def kernel_dtypes(device_name: str) -> tuple[torch.dtype, ...]:
    """The dtypes sgl-kernel-npu has kernels for on this chip: none on 310P (no build target there)."""
    return () if "310P" in device_name else KERNEL_DTYPES


@functools.cache   # per device index: a fact of the hardware
def _device_name(index: int) -> str:
    return torch.npu.get_device_name(index)


def device_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """On an NPU its chip's; elsewhere (the CPU emulator of the contract tests) both."""
    return kernel_dtypes(_device_name(device.index or 0)) if device.type == "npu" else KERNEL_DTYPES


def eligible(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
             dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES, *, ranks: tuple[int, ...] = KERNEL_RANKS) -> bool:
    """Whether the kernels compute y += x @ a.T @ b.T for these operands (see the module docstring)."""
    R, stack, in_dim = b[0].shape[2], len(b), x.shape[1]
    return (x.dtype in dtypes and y.dtype == x.dtype and a.dtype == x.dtype and all(b_s.dtype == x.dtype for b_s in b)
            and R in ranks and in_dim % ALIGN == 0 and in_dim > stack * R and y.shape[1] % ALIGN == 0
            and all((offsets[s + 1] - offsets[s]) % ALIGN == 0 and offsets[s + 1] - offsets[s] >= R
                    for s in range(stack)))


def run_kernels(y, x, a, b, offsets, index: tuple[torch.Tensor, ...], by_token: bool, ops, contract: Contract) -> None:
    """y += x @ a.T @ b.T through `ops`' shrink and expand under `contract`; `index`: bgmv's (token_slots,) or
    sgmv's (seg_slots, seg_lens). The operands are ones `eligible` accepts."""
    R = b[0].shape[2]
    assert a.is_contiguous() and all(b_s.is_contiguous() for b_s in b), "the kernels read the slot buffers densely"
    assert a.shape[1] == len(b) * R and offsets[-1] <= y.shape[1], (a.shape, R, offsets, y.shape)
    index = tuple(t if t.dtype == contract.index_dtype else t.to(contract.index_dtype) for t in index)
    shrink, expand = (ops.bgmv_shrink, ops.bgmv_expand) if by_token else (ops.sgmv_shrink, ops.sgmv_expand)
    h = torch.zeros(x.shape[0], a.shape[1], dtype=contract.h_dtype(x.dtype), device=x.device)   # base rows stay 0
    shrink(x.contiguous(), a, *index, h, 1.0)   # scaling is folded into b
    out = y if y.is_contiguous() else y.contiguous()
    # the expand's row t starts at element t * y.size(1): whole 32-byte blocks only (eligible checks it)
    assert out.size(1) % ALIGN == 0, f"y row stride {out.size(1)} is not a multiple of {ALIGN} elements"
    for s, b_s in enumerate(b):
        expand(h[:, s * R:(s + 1) * R].contiguous(), b_s, *index, out, offsets[s], offsets[s + 1] - offsets[s])
    if out is not y:
        y.copy_(out)


def _add_lora(y, x, a, b, offsets, info: LoRABatchInfo, by_token: bool, ops, contract: Contract = TODAY) -> None:
    index = (info.token_slots,) if by_token else (info.seg_slots, info.seg_lens)
    run_kernels(y, x, a, b, offsets, index, by_token, ops, contract)


class AscendBackend(LoRABackend):
    """sgmv over the step's segments for prefill, bgmv over the per-token slots for decode and graph
    replay, called under the installed kernels' contract; layers the kernels do not take (see `eligible`)
    run the torch maths, decided at wrap time."""

    name = "ascend"

    def __init__(self, device: torch.device | str, dtype: torch.dtype, max_rank: int, ops=None,
                 contract: Contract | None = None):
        super().__init__(device, dtype, max_rank)
        self.ops = ops if ops is not None else torch.ops.npu
        self.contract = contract or TODAY   # the probe's answer (ascend_probe.installed_contract: get_backend's)
        self.needs_plan = False   # a layer on the torch maths (or an embedding) reads the grouped plan

    def batch_info(self, token_slots: list[int], slot_ranks: Sequence[int], phase: str,
                   groups: frozenset[str] | None = None) -> LoRABatchInfo:
        plan = super().batch_info(token_slots, slot_ranks, phase).plan if self.needs_plan else None
        any_lora = any(s >= 0 and slot_ranks[s] > 0 for s in token_slots)
        if phase == "prefill":   # three views of one transfer, in the contract's index dtype
            lens, slots = segments(token_slots)
            T, S = len(token_slots), len(lens)
            packed = to_device([*token_slots, *lens, *slots], self.device, self.contract.index_dtype)
            fields = dict(token_slots=packed[:T], seg_lens=packed[T:T + S], seg_slots=packed[T + S:])
        else:                    # bgmv reads only the per-token slots
            fields = dict(token_slots=to_device(token_slots, self.device, self.contract.index_dtype))
        return LoRABatchInfo(phase=phase, plan=plan, any_lora=any_lora, max_rank=self.max_rank,
                             token_slots_host=tuple(token_slots), groups=groups, **fields)

    def row_batch_info(self, index: torch.Tensor, ranks: torch.Tensor, phase: str) -> LoRABatchInfo:
        return self.batch_info(index.tolist(), ranks.tolist(), phase)   # the kernels read segments / per-row indices

    def bind(self, layer: str, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
             a_shared: torch.Tensor | None = None) -> LayerLoRA:
        y, x = torch.empty(0, offsets[-1], dtype=self.dtype), torch.empty(0, a.shape[2], dtype=self.dtype)
        contract = self.contract
        if not eligible(y, x, a, b, offsets, device_dtypes(self.device), ranks=contract.ranks):
            self.fallback(layer, f"sgl_kernel_npu does not take {self.dtype}, in {a.shape[2]}, rank {b[0].shape[2]}, "
                                 f"slices {[offsets[s + 1] - offsets[s] for s in range(len(b))]}")
            self.needs_plan = True
            return torch_ops(a, b, offsets)
        kernels = self.ops

        def sgmv(y, x, info):
            _add_lora(y, x, a, b, offsets, info, False, kernels, contract)

        def bgmv(y, x, info):
            _add_lora(y, x, a, b, offsets, info, True, kernels, contract)

        return LayerLoRA(sgmv, bgmv, bgmv)

    def bind_embedding(self, layer: str, a: torch.Tensor, b: torch.Tensor) -> LayerLoRA:
        self.needs_plan = True
        return super().bind_embedding(layer, a, b)
