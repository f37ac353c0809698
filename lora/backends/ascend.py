"""LoRA on Ascend NPUs through sgl_kernel_npu's kernels (`torch.ops.npu.*`), and their start-up probe.

Built against sgl-kernel-npu SGL_KERNEL_NPU_VERSION (the conventions below were checked against
its sources; an open upstream change, PR #676, would switch sgmv to int32 indices and
model-dtype buffers, hence `probe`). The kernels' conventions, all honoured here (buffer
layout: lora/ops.py):
- shrink(x, weight, indices.., y, scale): x fp16/bf16 [T, in], weight [L, rows, in], y fp32
  [T, rows] written where the token's index is >= 0 (so y is zeroed first); rows < in.
- expand(x, weight, indices.., y, slice_offset, slice_size): x fp32 [T, R] read densely; slot
  l's block read as the contiguous [slice_size, R] at element l * R * slice_size; y fp16/bf16
  updated in place with row stride y.size(1), so a strided y goes through a contiguous copy.
- sgmv_* take segments (info.seg_slots / seg_lens) and find a token's segment by walking from
  the first on every core; bgmv_* read indices[t] (info.token_slots) directly. All int64.
Where the kernels' results are undefined or their host checks raise, `eligible` says no and
the torch ops of the same phase run instead: fp32 (a TORCH_CHECK raises; nothing is skipped
silently), bf16 on 310P (its bf16 kernels are not built), R outside {8, 16, 32, 64} (the
expand has no reduction for it), and copies that are not whole 32-byte blocks (DataCopy, not
DataCopyPad): in % 16, every slice_size % 16 (the LM head shard is padded to 16 rows for
this) and fp32 shrink rows (stack * R) % 8, which R in {8, ..} already gives. T = 0 fails
their host check too: lora/ops.py returns before any implementation runs.
"""
from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Sequence

import torch

from lora import ops as torch_ops
from lora.backends.base import LayerLoRA, LoRABackend, torch_ops as torch_layer_ops
from lora.batch import LoRABatchInfo
from lora.transfer import to_device

SGL_KERNEL_NPU_VERSION = "2026.9.0"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_RANKS = (8, 16, 32, 64)
ALIGN = 16   # fp16 / bf16 elements per 32-byte block
_T, _F, _I = "Tensor", "float", "int"
SCHEMAS = {  # the argument types of the schemas we call
    "sgmv_shrink": (_T, _T, _T, _T, _T, _F), "sgmv_expand": (_T, _T, _T, _T, _T, _I, _I),
    "bgmv_shrink": (_T, _T, _T, _T, _F), "bgmv_expand": (_T, _T, _T, _T, _I, _I),
}


def kernel_dtypes(device_name: str) -> tuple[torch.dtype, ...]:
    """The dtypes the kernels are built for on this chip: the bf16 ones need __CCE_AICORE__ >= 220."""
    return (torch.float16,) if "310P" in device_name else KERNEL_DTYPES


@functools.cache   # per device index: a fact of the hardware, asked on every layer's call
def _device_dtypes(index: int) -> tuple[torch.dtype, ...]:
    return kernel_dtypes(torch.npu.get_device_name(index))


def device_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """On an NPU its chip's; elsewhere (the CPU emulator of the contract tests) both."""
    return _device_dtypes(device.index or 0) if device.type == "npu" else KERNEL_DTYPES


def eligible(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int],
             dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES) -> bool:
    """Whether the kernels compute y += x @ a.T @ b.T for these operands (see the module docstring)."""
    R, stack, in_dim = b[0].shape[2], len(b), x.shape[1]
    return (x.dtype in dtypes and y.dtype == x.dtype and a.dtype == x.dtype and all(b_s.dtype == x.dtype for b_s in b)
            and R in KERNEL_RANKS and in_dim % ALIGN == 0 and in_dim > stack * R
            and all((offsets[s + 1] - offsets[s]) % ALIGN == 0 and offsets[s + 1] - offsets[s] >= R
                    for s in range(stack)))


def _add_lora(y, x, a, b, offsets, info: LoRABatchInfo, by_token: bool, ops) -> None:
    R = b[0].shape[2]
    assert a.is_contiguous() and all(b_s.is_contiguous() for b_s in b), "the kernels read the slot buffers densely"
    assert a.shape[1] == len(b) * R and offsets[-1] <= y.shape[1], (a.shape, R, offsets, y.shape)
    index = (info.token_slots,) if by_token else (info.seg_slots, info.seg_lens)
    shrink, expand = (ops.bgmv_shrink, ops.bgmv_expand) if by_token else (ops.sgmv_shrink, ops.sgmv_expand)
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)   # base rows stay 0
    shrink(x.contiguous(), a, *index, h, 1.0)   # scaling is folded into b
    out = y if y.is_contiguous() else y.contiguous()
    for s, b_s in enumerate(b):
        expand(h[:, s * R:(s + 1) * R].contiguous(), b_s, *index, out, offsets[s], offsets[s + 1] - offsets[s])
    if out is not y:
        y.copy_(out)


def add_lora_sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                  offsets: Sequence[int], info: LoRABatchInfo) -> None:
    """Prefill: sgmv over the step's segments; where the kernels do not apply, the torch segments."""
    if not eligible(y, x, a, b, offsets, device_dtypes(x.device)):
        return torch_ops.add_lora_segments(y, x, a, b, offsets, info)
    _add_lora(y, x, a, b, offsets, info, False, torch.ops.npu)


def add_lora_bgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
                  offsets: Sequence[int], info: LoRABatchInfo) -> None:
    """Decode and graph replay: bgmv over info.token_slots (fixed size); else the masked torch ops."""
    if not eligible(y, x, a, b, offsets, device_dtypes(x.device)):
        return torch_ops.add_lora_masked(y, x, a, b, offsets, info)
    _add_lora(y, x, a, b, offsets, info, True, torch.ops.npu)


def _installed_version() -> str:
    try:   # the package's own metadata has lagged its releases: the probe checks behaviour instead
        return importlib.metadata.version("sgl_kernel_npu")
    except importlib.metadata.PackageNotFoundError:
        return "(no package metadata)"


def _known_answer(ops, device: torch.device, dtype: torch.dtype, by_token: bool) -> str | None:
    """One tiny call against torch's result (small integers: exact in every dtype); None if equal."""
    T, in_dim, R, out = 3, 32, 16, 16
    small = lambda n, shape: ((torch.arange(n) % 3) - 1).reshape(shape)  # noqa: E731
    x, a, b = small(T * in_dim, (T, in_dim)), small(2 * R * in_dim, (2, R, in_dim)), small(2 * out * R, (2, out, R))
    slots = [1, -1, 0]
    y0 = torch.ones(T, out)
    expected = y0.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[t] += b[slot] @ (a[slot] @ x[t])
    i64 = dict(dtype=torch.int64, device=device)
    info = LoRABatchInfo(token_slots=to_device(slots, device, torch.int64), seg_lens=torch.ones(T, **i64),
                         seg_slots=to_device(slots, device, torch.int64), seg_lens_host=(1,) * T, seg_slots_host=tuple(slots),
                         slot_ranks_host=(R, R), max_rank=R, phase="decode")
    y = y0.to(device, dtype)
    try:
        _add_lora(y, x.to(device, dtype), a.to(device, dtype), (b.to(device, dtype),), (0, out), info, by_token, ops)
    except Exception as exc:  # a kernel's host check: exactly what a changed convention looks like
        return f"{exc.__class__.__name__}: {exc}"
    got = y.float().cpu()
    return None if torch.equal(got, expected) else f"wrong result {got.tolist()}, expected {expected.tolist()}"


def probe(device: torch.device | str, dtype: torch.dtype, ops=None) -> None:
    """At start-up: the installed kernels have our schemas and give the known answer, or RuntimeError
    naming the version we build against. `ops`: the op namespace (default torch.ops.npu)."""
    device = torch.device(device)
    if dtype not in device_dtypes(device):
        return   # every call falls back to the torch ops: nothing of the kernels is used
    advice = (f"install sgl-kernel-npu {SGL_KERNEL_NPU_VERSION} built for your CANN toolkit, or set "
              f"lora_backend: torch_native")
    if ops is None:
        if not hasattr(torch.ops.npu, "sgmv_shrink"):
            try:
                import sgl_kernel_npu  # noqa: F401  registers torch.ops.npu.* (needs torch_npu and CANN)
            except ImportError as exc:
                raise RuntimeError(f"lora_backend 'ascend' needs sgl_kernel_npu ({exc}); {advice}") from exc
        ops = torch.ops.npu
    for name, types in SCHEMAS.items():
        packet = getattr(ops, name, None)
        got = tuple(str(arg.type) for arg in packet.default._schema.arguments) if packet is not None else None
        if got != types:
            found = "is missing" if got is None else f"takes {got}, expected {types}"
            raise RuntimeError(f"sgl_kernel_npu {_installed_version()}: op {name} {found}; {advice}")
    for by_token, kind in ((False, "sgmv"), (True, "bgmv")):
        wrong = _known_answer(ops, device, dtype, by_token)
        if wrong:
            raise RuntimeError(f"sgl_kernel_npu {_installed_version()}: {kind} with the conventions of "
                               f"{SGL_KERNEL_NPU_VERSION} (int64 indices, fp32 shrink output) failed: {wrong}; {advice}")


def unavailable_reason(device: torch.device | str, dtype: torch.dtype, ops=None) -> str | None:
    """Why the kernels cannot serve `dtype` on `device` (None: they can; the probe passed)."""
    device = torch.device(device)
    if dtype not in device_dtypes(device):
        return f"sgl_kernel_npu has no {dtype} kernels for this chip (has {list(device_dtypes(device))})"
    try:
        probe(device, dtype, ops=ops)
    except RuntimeError as exc:
        return str(exc)
    return None


class AscendBackend(LoRABackend):
    """sgmv over the step's segments for prefill, bgmv over the per-token slots for decode and graph
    replay; layers the kernels do not take (see `eligible`) run the torch maths, decided at wrap time."""

    name = "ascend"

    def __init__(self, device: torch.device | str, dtype: torch.dtype, max_rank: int, ops=None):
        super().__init__(device, dtype, max_rank)
        self.ops = ops if ops is not None else torch.ops.npu
        self.needs_plan = False   # a layer on the torch maths (or an embedding) reads the grouped plan

    def batch_info(self, token_slots: list[int], slot_ranks: Sequence[int], phase: str) -> LoRABatchInfo:
        plan = super().batch_info(token_slots, slot_ranks, phase).plan if self.needs_plan else None
        any_lora = any(s >= 0 and slot_ranks[s] > 0 for s in token_slots)
        fields = self._segment_tensors(token_slots)
        if phase != "prefill":   # bgmv reads only the per-token slots
            fields = {"token_slots": fields["token_slots"]}
        return LoRABatchInfo(phase=phase, plan=plan, any_lora=any_lora, max_rank=self.max_rank, **fields)

    def bind(self, layer: str, a: torch.Tensor, b: Sequence[torch.Tensor], offsets: Sequence[int]) -> LayerLoRA:
        y, x = torch.empty(0, offsets[-1], dtype=self.dtype), torch.empty(0, a.shape[2], dtype=self.dtype)
        if not eligible(y, x, a, b, offsets, device_dtypes(self.device)):
            self.fallback(layer, f"sgl_kernel_npu does not take {self.dtype}, in {a.shape[2]}, rank {b[0].shape[2]}, "
                                 f"slices {[offsets[s + 1] - offsets[s] for s in range(len(b))]}")
            self.needs_plan = True
            return torch_layer_ops(a, b, offsets)
        kernels = self.ops

        def sgmv(y, x, info):
            _add_lora(y, x, a, b, offsets, info, False, kernels)

        def bgmv(y, x, info):
            _add_lora(y, x, a, b, offsets, info, True, kernels)

        return LayerLoRA(sgmv, bgmv, bgmv)

    def bind_embedding(self, layer: str, a: torch.Tensor, b: torch.Tensor) -> LayerLoRA:
        self.needs_plan = True
        return super().bind_embedding(layer, a, b)
