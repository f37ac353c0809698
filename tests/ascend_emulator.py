"""A strict CPU emulator of sgl_kernel_npu's LoRA kernels, registered as torch.ops.npu.* under the
kernels' own schemas (tests/test_ascend_contract.py checks lora/backends/ascend.py against it).

The emulator does what the real kernels do, on the host and in device memory (REFERENCE.md):
- host checks raise (TORCH_CHECK: RuntimeError): fp16/bf16 only (fp32 raises), 2-D x and y,
  shrink x.size(1) > y.size(1), expand R <= slice_size, 0 <= slice_offset,
  slice_offset + slice_size <= y.size(1), and T > 0;
- what is undefined on the device fails here (AssertionError "undefined"): indices or seq_len
  not int64, a shrink y or an expand x not fp32, a weight of another dtype, copies that are not
  whole 32-byte blocks (in % 16, slice_size % 16, fp32 shrink rows % 8), R outside
  {8, 16, 32, 64}, an index past the weights, segments past the tokens;
- every tensor is read as the kernels read device memory: densely from its data pointer,
  whatever its strides say (a strided weight or y is read wrongly, not refused);
- tokens with a negative index, and tokens past the last segment, are left untouched.
`CONVENTION["now"]` picks the contract emulated, for the start-up probe's tests:
- TODAY ("2026.08.21", the tag lora/backends/ascend.py pins): the above;
- PR676 ("pr676", the open upstream change, for sgmv and bgmv alike): indices and seq_len must be
  int32, the shrink's y and the expand's x must have the model's dtype, and the rank (the shrink's y
  rows, the expand's R) a multiple of 16, all host checks (RuntimeError), so today's calls raise;
- RAISES ("raises"): every call fails as a kernel that cannot run on this device (RuntimeError).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch


HALF = (torch.float16, torch.bfloat16)
CALLS: Counter[str] = Counter()
TODAY, PR676, RAISES = "2026.08.21", "pr676", "raises"
CONVENTION = {"now": TODAY}
LIBRARIES: list[torch.library.Library] = []  # keeps the registrations alive for the session


def undefined(ok: bool, what: str) -> None:
    assert ok, f"undefined on the device: {what}"


def host_check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(what)


def dense(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t`'s memory read as a dense array of `shape`, as a kernel given t.data_ptr() reads it."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    undefined(t.storage_offset() + (shape[0] * strides[0] if shape else 0) <= t.untyped_storage().nbytes() // t.itemsize,
              "a read past the tensor's memory")
    return torch.as_strided(t, shape, strides, t.storage_offset())


def pr676() -> bool:
    return CONVENTION["now"] == PR676


def check_index(t: torch.Tensor, what: str) -> None:
    if pr676():
        host_check(t.dtype == torch.int32, f"{what} must be int32, got {t.dtype}")
    else:
        undefined(t.dtype == torch.int64, f"{what} read as int64, got {t.dtype}")


def per_segment(lora_indices, seq_len, T) -> list[int | None]:
    """Each token's index; None past the last segment (the kernel never reaches those tokens)."""
    check_index(lora_indices, "lora_indices")
    check_index(seq_len, "seq_len")
    lens, slots = seq_len.tolist(), lora_indices.tolist()
    undefined(len(lens) == len(slots) and min(lens, default=0) >= 0 and sum(lens) <= T, "segments past the tokens")
    return [slot for slot, n in zip(slots, lens) for _ in range(n)] + [None] * (T - sum(lens))


def per_token(indices, T) -> list[int]:
    check_index(indices, "indices")
    undefined(indices.dim() == 1 and indices.numel() == T, "one index per token")
    return indices.tolist()


def kernel_runs(name: str) -> None:
    CALLS[name] += 1
    host_check(CONVENTION["now"] != RAISES, f"{name}: EZ9999 the kernel failed to launch (emulated)")


def shrink(kind: str, x, weight, slots: list[int | None], y, scale: float) -> None:
    kernel_runs(kind + "_shrink")
    host_check(x.dtype in HALF, f"x must be fp16/bf16, got {x.dtype}")
    host_check(x.dim() == 2 and y.dim() == 2 and weight.dim() in (3, 4), "x, y 2-D; weight 3-D or 4-D")
    host_check(x.size(0) > 0, "num_tokens_per_core != 0")
    host_check(x.size(1) > y.size(1), "x.size(1) > y.size(1)")
    if pr676():
        host_check(y.dtype == x.dtype, f"y must have x's dtype {x.dtype}, got {y.dtype}")
        host_check(y.size(1) % 16 == 0, f"rank {y.size(1)} must be a multiple of 16")
    else:
        undefined(y.dtype == torch.float32, f"y is written as fp32, got {y.dtype}")
    undefined(weight.dtype == x.dtype, f"weight read as {x.dtype}, got {weight.dtype}")
    (T, H), rows, L, rows_w = x.shape, y.size(1), weight.size(0), weight.size(-2)
    undefined(H % 16 == 0 and rows % 8 == 0, f"copies of whole 32-byte blocks: in {H}, y rows {rows}")
    undefined(rows <= rows_w, "y rows within the weight's")
    xs, ws, ys = dense(x, (T, H)), dense(weight, (L, rows_w, H)), dense(y, (T, rows))
    for t, slot in enumerate(slots):
        if slot is not None and slot >= 0:
            undefined(slot < L, f"index {slot} past {L} weights")
            ys[t] = (scale * (xs[t].float() @ ws[slot, :rows].float().T)).to(y.dtype)


def expand(kind: str, x, weight, slots: list[int | None], y, slice_offset: int, slice_size: int) -> torch.Tensor:
    kernel_runs(kind + "_expand")
    host_check(y.dtype in HALF, f"y must be fp16/bf16, got {y.dtype}")
    host_check(x.dim() == 2 and y.dim() == 2 and weight.dim() in (3, 4), "x, y 2-D; weight 3-D or 4-D")
    host_check(x.size(0) > 0, "num_tokens_per_core != 0")
    (T, R), L = x.shape, weight.size(0)
    host_check(R <= slice_size and slice_offset >= 0 and slice_offset + slice_size <= y.size(1),
               "R <= slice_size, 0 <= slice_offset, slice_offset + slice_size <= y.size(1)")
    if pr676():
        host_check(x.dtype == y.dtype, f"x must have y's dtype {y.dtype}, got {x.dtype}")
        host_check(R % 16 == 0, f"rank {R} must be a multiple of 16")
    else:
        undefined(x.dtype == torch.float32, f"x read as fp32, got {x.dtype}")
    undefined(weight.dtype == y.dtype, f"weight read as {y.dtype}, got {weight.dtype}")
    undefined(R in (8, 16, 32, 64), f"a reduction for R = {R}")
    undefined(slice_size % 16 == 0, f"copies of whole 32-byte blocks: slice_size {slice_size}")
    xs, ws, ys = dense(x, (T, R)), dense(weight, (L, slice_size, R)), dense(y, (T, y.size(1)))
    out = ys[:, slice_offset:slice_offset + slice_size]
    for t, slot in enumerate(slots):
        if slot is not None and slot >= 0:
            undefined(slot < L, f"index {slot} past {L} weights")
            out[t] = (out[t].float() + xs[t].float() @ ws[slot].float().T).to(y.dtype)
    return y


def register_emulator() -> None:
    if LIBRARIES:  # registered once per session; a torch.library schema cannot be defined twice
        return
    if hasattr(torch.ops.npu, "sgmv_shrink"):
        pytest.skip("torch.ops.npu.sgmv_shrink is already registered (real kernels?): CPU-only contract test")
    lib = torch.library.Library("npu", "FRAGMENT")
    lib.define("sgmv_shrink(Tensor! x, Tensor! weight, Tensor! lora_indices, Tensor! seq_len, Tensor! y, "
               "float scale) -> ()")
    lib.define("sgmv_expand(Tensor! x, Tensor! weight, Tensor! lora_indices, Tensor! seq_len, Tensor! y, "
               "int slice_offset, int slice_size) -> Tensor")
    lib.define("bgmv_shrink(Tensor! x, Tensor! weight, Tensor! indices, Tensor! y, float scale) -> ()")
    lib.define("bgmv_expand(Tensor! x, Tensor! weight, Tensor! indices, Tensor! y, int slice_offset, "
               "int slice_size) -> Tensor")
    lib.impl("sgmv_shrink", lambda x, w, li, sl, y, scale: shrink("sgmv", x, w, per_segment(li, sl, x.size(0)), y,
                                                                  scale), "CPU")
    lib.impl("sgmv_expand", lambda x, w, li, sl, y, off, size: expand("sgmv", x, w, per_segment(li, sl, x.size(0)), y,
                                                                      off, size), "CPU")
    lib.impl("bgmv_shrink", lambda x, w, i, y, scale: shrink("bgmv", x, w, per_token(i, x.size(0)), y, scale), "CPU")
    lib.impl("bgmv_expand", lambda x, w, i, y, off, size: expand("bgmv", x, w, per_token(i, x.size(0)), y, off, size),
             "CPU")
    LIBRARIES.append(lib)
