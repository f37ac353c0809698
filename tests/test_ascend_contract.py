"""AscendBackend against reference CPU versions of sgl_kernel_npu's sgmv ops.

The reference ops are registered with torch.library under the kernels' own schemas and
enforce the kernels' conventions: fp16/bf16 x and fp32 y for shrink, fp32 x and fp16/bf16 y
for expand, int64 indices and segment lengths, and every tensor read as the kernel reads
device memory: densely, from its storage offset, whatever its strides say. So a backend that
passes int32 indices, model-dtype activations or a strided weight view fails here.
"""
from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

from lora.backends.ascend import AscendBackend
from lora.backends.torch_native import TorchNativeBackend
from lora.batch import make_batch_info
from lora_reference import make_lora_case

HALF = (torch.float16, torch.bfloat16)
CALLS: Counter[str] = Counter()
_LIBRARY: list[torch.library.Library] = []  # keeps the registration alive for the session


def _dense(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t`'s memory read as a dense array of `shape`, as a kernel given t.data_ptr() reads it."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return torch.as_strided(t, shape, strides, t.storage_offset())


def _segments(lora_indices: torch.Tensor, seq_len: torch.Tensor, num_tokens: int):
    assert lora_indices.dtype == torch.int64 and seq_len.dtype == torch.int64, "indices and seq_len must be int64"
    lens = seq_len.tolist()
    assert len(lens) == lora_indices.numel() and sum(lens) == num_tokens, (lens, num_tokens)
    start = 0
    for length, slot in zip(lens, lora_indices.tolist()):
        if slot >= 0:
            yield slice(start, start + length), slot
        start += length


def sgmv_shrink(x, weight, lora_indices, seq_len, y, scale) -> None:
    CALLS["sgmv_shrink"] += 1
    assert x.dtype in HALF and weight.dtype == x.dtype, f"x/weight must be fp16/bf16, got {x.dtype}/{weight.dtype}"
    assert y.dtype == torch.float32, f"sgmv_shrink writes fp32 y, got {y.dtype}"
    assert x.dim() == 2 and y.dim() == 2 and weight.dim() in (3, 4) and x.size(1) > y.size(1)
    T, H = x.shape
    rank = y.size(1)
    xs, ys = _dense(x, (T, H)), _dense(y, (T, rank))
    w = _dense(weight, (weight.size(0), rank, H))
    for rows, slot in _segments(lora_indices, seq_len, T):
        ys[rows] = scale * (xs[rows].float() @ w[slot].float().T)


def sgmv_expand(x, weight, lora_indices, seq_len, y, slice_offset, slice_size) -> torch.Tensor:
    CALLS["sgmv_expand"] += 1
    assert x.dtype == torch.float32, f"sgmv_expand reads fp32 x, got {x.dtype}"
    assert y.dtype in HALF and weight.dtype == y.dtype, f"y/weight must be fp16/bf16, got {y.dtype}/{weight.dtype}"
    assert x.dim() == 2 and y.dim() == 2 and weight.dim() in (3, 4)
    assert x.size(1) <= slice_size and slice_offset >= 0 and slice_offset + slice_size <= y.size(1)
    (T, R), full = x.shape, y.size(1)
    xs, ys = _dense(x, (T, R)), _dense(y, (T, full))
    w = _dense(weight, (weight.size(0), slice_size, R))  # slot l's block at l * R * slice_size
    for rows, slot in _segments(lora_indices, seq_len, T):
        delta = xs[rows] @ w[slot].float().T
        ys[rows, slice_offset:slice_offset + slice_size] += delta.to(y.dtype)
    return y


def _register_reference_ops() -> None:
    if _LIBRARY:  # registered once per session; a torch.library schema cannot be defined twice
        return
    if hasattr(torch.ops.npu, "sgmv_shrink"):
        pytest.skip("torch.ops.npu.sgmv_shrink is already registered (real kernels?): CPU-only contract test")
    lib = torch.library.Library("npu", "FRAGMENT")
    lib.define("sgmv_shrink(Tensor! x, Tensor! weight, Tensor! lora_indices, Tensor! seq_len, Tensor! y, "
               "float scale) -> ()")
    lib.define("sgmv_expand(Tensor! x, Tensor! weight, Tensor! lora_indices, Tensor! seq_len, Tensor! y, "
               "int slice_offset, int slice_size) -> Tensor")
    lib.impl("sgmv_shrink", sgmv_shrink, "CPU")
    lib.impl("sgmv_expand", sgmv_expand, "CPU")
    _LIBRARY.append(lib)


@pytest.fixture(scope="module")
def npu_ops() -> Counter[str]:
    _register_reference_ops()
    return CALLS


STACKS = {"single": (48,), "qkv": (32, 16, 16), "gate_up": (40, 40)}
SHAPES = {"prefill": [1, 40, 7, 23, 2, 15], "decode": [1] * 16}
PATTERNS = ("distinct", "zipf", "identical", "mixed_ranks", "base_mixed")


def _run(backend, case, use_graph: bool = False) -> torch.Tensor:
    info = make_batch_info(case.token_slots, case.ranks, case.max_rank, use_graph=use_graph)
    y = case.y.clone()
    backend.add_lora(y, case.x, case.a, case.b, case.offsets, info)
    return y


def _assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_ascend_matches_torch_native(npu_ops, pattern, stack, shape):
    case = make_lora_case(pattern, SHAPES[shape], STACKS[stack], dtype=torch.bfloat16, seed=len(pattern))
    before = Counter(npu_ops)
    y = _run(AscendBackend(), case)
    assert npu_ops["sgmv_shrink"] - before["sgmv_shrink"] == 1
    assert npu_ops["sgmv_expand"] - before["sgmv_expand"] == len(STACKS[stack])
    _assert_bf16_close(y, _run(TorchNativeBackend(), case))
    assert "sgl_kernel_npu" not in sys.modules


def test_ascend_fp16_with_graph_style_segments(npu_ops):
    # One segment per token (what a decode graph replays) gives the same result as merged runs.
    case = make_lora_case("uniform", SHAPES["decode"], STACKS["qkv"], dtype=torch.float16, seed=2)
    info = make_batch_info(case.token_slots, case.ranks, case.max_rank)
    T = len(case.token_slots)
    info.seg_lens, info.seg_slots = torch.ones(T, dtype=torch.int64), torch.tensor(case.token_slots)
    y = case.y.clone()
    AscendBackend().add_lora(y, case.x, case.a, case.b, case.offsets, info)
    _assert_bf16_close(y, _run(TorchNativeBackend(), case))


def test_ascend_falls_back_where_the_kernels_cannot_run(npu_ops):
    case = make_lora_case("zipf", SHAPES["prefill"], STACKS["qkv"], dtype=torch.float32, seed=4)
    before = Counter(npu_ops)
    y = _run(AscendBackend(), case)  # fp32: the kernels would silently do nothing
    assert npu_ops == before
    torch.testing.assert_close(y, _run(TorchNativeBackend(), case), rtol=1e-5, atol=1e-5)


def test_ascend_embedding_delegates_to_torch_native(npu_ops):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 30, 8, generator=gen), torch.randn(4, 16, 8, generator=gen)
    token_slots = [2, 2, -1, 0, 3, 3, 3]
    ids = torch.randint(0, 30, (len(token_slots),), generator=gen)
    info = make_batch_info(token_slots, [8] * 4, 8)
    y, expected = torch.zeros(len(token_slots), 16), torch.zeros(len(token_slots), 16)
    AscendBackend().add_embedding_lora(y, ids, a, b, info)
    TorchNativeBackend().add_embedding_lora(expected, ids, a, b, info)
    torch.testing.assert_close(y, expected)


# The contract test must have teeth: each known way of calling the kernels wrongly fails.

def _expand_each_slice(y, h, b, offsets, info, contiguous_h=True) -> None:
    R = info.max_rank
    for s, b_s in enumerate(b):
        h_s = h[:, s * R:(s + 1) * R]
        torch.ops.npu.sgmv_expand(h_s.contiguous() if contiguous_h else h_s, b_s, info.seg_slots,
                                  info.seg_lens, y, offsets[s], offsets[s + 1] - offsets[s])


class Int32IndicesBackend(AscendBackend):
    def shrink(self, h, x, a, info):
        h.zero_()
        torch.ops.npu.sgmv_shrink(x, a, info.seg_slots.int(), info.seg_lens.int(), h, 1.0)


class ModelDtypeBufferBackend(AscendBackend):
    def add_lora(self, y, x, a, b, offsets, info):
        h = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype)
        torch.ops.npu.sgmv_shrink(x, a, info.seg_slots, info.seg_lens, h, 1.0)
        _expand_each_slice(y, h, b, offsets, info)


class StridedActivationBackend(AscendBackend):
    def expand(self, y, h, b, offsets, info):
        _expand_each_slice(y, h, b, offsets, info, contiguous_h=False)


class PackedWeightBackend(AscendBackend):
    """Keeps B as one [L, out, stack*R] buffer and passes each slice as a column view."""

    def expand(self, y, h, b, offsets, info):
        R = info.max_rank
        packed = torch.zeros(b[0].shape[0], offsets[-1], len(b) * R, dtype=b[0].dtype)
        views = []
        for s, b_s in enumerate(b):
            packed[:, offsets[s]:offsets[s + 1], s * R:(s + 1) * R] = b_s
            views.append(packed[:, offsets[s]:offsets[s + 1], s * R:(s + 1) * R])
        _expand_each_slice(y, h, views, offsets, info)


@pytest.mark.parametrize("broken", [Int32IndicesBackend, ModelDtypeBufferBackend])
def test_contract_rejects_wrong_dtypes(npu_ops, broken):
    case = make_lora_case("uniform", SHAPES["prefill"], STACKS["qkv"], dtype=torch.bfloat16, seed=8)
    with pytest.raises(AssertionError, match="int64|fp32"):
        _run(broken(), case)


@pytest.mark.parametrize("broken", [StridedActivationBackend, PackedWeightBackend])
def test_contract_catches_strided_views(npu_ops, broken):
    case = make_lora_case("uniform", SHAPES["prefill"], STACKS["qkv"], dtype=torch.bfloat16, seed=9)
    expected = _run(TorchNativeBackend(), case)
    _assert_bf16_close(_run(AscendBackend(), case), expected)
    wrong = _run(broken(), case)
    assert not torch.allclose(wrong.float(), expected.float(), rtol=2e-2, atol=3e-2)


def test_ascend_backend_refuses_a_strided_weight(npu_ops):
    case = make_lora_case("uniform", SHAPES["decode"], STACKS["gate_up"], dtype=torch.bfloat16, seed=10)
    R = case.max_rank
    wide = [torch.zeros(b_s.shape[0], b_s.shape[1], 2 * R, dtype=b_s.dtype) for b_s in case.b]
    views = tuple(w[:, :, :R] for w in wide)
    info = make_batch_info(case.token_slots, case.ranks, R)
    h = torch.zeros(len(case.token_slots), 2 * R)
    with pytest.raises(AssertionError, match="densely"):
        AscendBackend().expand(case.y.clone(), h, views, case.offsets, info)
