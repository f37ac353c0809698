"""The Ascend implementations (lora/backends/ascend.py) against a strict CPU emulator of
sgl_kernel_npu's LoRA kernels (tests/ascend_emulator.py: what it checks and how it reads memory), and the
emulator's teeth. The start-up probe and the fallbacks: tests/test_ascend_probe.py."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

# npu_ops (registers the emulator) and today_s_convention (autouse) are fixtures: pytest finds them here
from ascend_cases import (PATTERNS, PHASES, SHAPES, STACKS, assert_half_close, info_for, kernel_calls,  # noqa: F401
                          native, npu_ops, run, today_s_convention)
from lora.backends import ascend
from lora_impls import add_embedding_lora, add_lora, make_batch_info
from lora_reference import make_embedding_buffers, make_lora_case
from workers.parallel import ParallelLMHead, TPGroup


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_torch_native(npu_ops, pattern, stack, shape, phase):
    case = make_lora_case(pattern, SHAPES[shape], STACKS[stack], dtype=torch.bfloat16, seed=len(pattern))
    before = Counter(npu_ops)
    y = run(case, phase)
    kind = "sgmv" if phase == "prefill" else "bgmv"
    assert kernel_calls(before) == {f"{kind}_shrink": 1, f"{kind}_expand": len(STACKS[stack])}
    assert_half_close(y, native(case, phase))


def test_fp16_and_graph_style_padded_rows(npu_ops):
    """A decode bucket: real rows, then padding rows with slot -1 that must stay untouched."""
    case = make_lora_case("uniform", [1] * 12, STACKS["qkv"], dtype=torch.float16, seed=2)
    case = dataclasses.replace(case, token_slots=case.token_slots[:9] + [-1, -1, -1])
    y = run(case, "graph")
    assert torch.equal(y[9:], case.y[9:])
    assert_half_close(y, native(case))


@pytest.mark.parametrize("phase", PHASES)
def test_non_contiguous_y_goes_through_a_copy(npu_ops, phase):
    case = make_lora_case("zipf", SHAPES["decode"], STACKS["qkv"], dtype=torch.bfloat16, seed=5)
    wide = torch.zeros(case.y.shape[0], case.y.shape[1] + 16, dtype=case.y.dtype)
    wide[:, 8:8 + case.y.shape[1]] = case.y
    y = run(case, phase, y=wide[:, 8:8 + case.y.shape[1]])
    assert not y.is_contiguous()
    assert_half_close(y, native(case, phase))
    assert (wide[:, :8] == 0).all() and (wide[:, -8:] == 0).all()


@pytest.mark.parametrize("phase", PHASES)
def test_no_tokens_reach_no_kernel(npu_ops, phase):
    case = make_lora_case("uniform", [0], STACKS["plain"], dtype=torch.bfloat16, seed=1)
    before = Counter(npu_ops)
    assert run(case, phase).shape == (0, 48) and kernel_calls(before) == {}
    with pytest.raises(RuntimeError, match="num_tokens_per_core"):   # what a T = 0 call would meet
        torch.ops.npu.bgmv_shrink(case.x, case.a, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 8), 1.0)


@pytest.mark.parametrize("why,stack,in_dim,dtype", [
    ("slice_size 40 % 16", (40, 40), 64, torch.bfloat16),
    ("in 72 % 16", (48,), 72, torch.bfloat16),
    ("in <= stack * R", (32, 16, 16), 16, torch.bfloat16),
    ("fp32: the host check raises", (48,), 64, torch.float32),
])
@pytest.mark.parametrize("phase", PHASES)
def test_operands_the_kernels_cannot_take_go_to_the_torch_ops(npu_ops, phase, why, stack, in_dim, dtype):
    case = make_lora_case("zipf", SHAPES["prefill"], stack, in_dim=in_dim, dtype=dtype, seed=4)
    before = Counter(npu_ops)
    y = run(case, phase)
    assert kernel_calls(before) == {}, why
    torch.testing.assert_close(y, native(case, phase), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_rank", range(1, 65))
def test_every_max_rank_matches_torch_native(npu_ops, max_rank):
    """Kernels for R in {8, 16, 32, 64} (adapters of lower ranks zero-padded), the torch ops otherwise."""
    case = make_lora_case("mixed_ranks", [3, 9, 1, 4], (64,), max_rank=max_rank, in_dim=80, dtype=torch.bfloat16,
                          num_slots=4, seed=max_rank)
    before = Counter(npu_ops)
    y = run(case, "prefill")
    assert bool(kernel_calls(before)) == (max_rank in ascend.KERNEL_RANKS)
    assert_half_close(y, native(case))


def test_lm_head_shard_padded_to_16_rows_takes_the_kernels(npu_ops):
    vocab, hidden, tp = 1001, 64, 2
    shard = ParallelLMHead(vocab, hidden, TPGroup(1, tp)).shard_size
    assert shard % 16 == 0 and shard * tp >= vocab and -(-vocab // tp) % 16 != 0   # 501 rows unpadded
    for rows, kernels in ((shard, True), (-(-vocab // tp), False)):
        case = make_lora_case("zipf", [1] * 8, (rows,), num_slots=3, in_dim=hidden, dtype=torch.bfloat16, seed=1)
        before = Counter(npu_ops)
        y = run(case, "decode")
        assert bool(kernel_calls(before)) == kernels
        assert_half_close(y, native(case, "decode"))


@pytest.mark.parametrize("impl", ["ascend_sgmv", "ascend_bgmv"])
def test_embedding_is_a_gather_in_torch(npu_ops, impl):
    gen = torch.Generator().manual_seed(0)
    a, b = make_embedding_buffers([8, 3, 8, 5], 8, 30, 16, torch.bfloat16, gen)
    token_slots = [2, 2, -1, 0, 3, 3, 3]
    ids = torch.randint(0, 30, (len(token_slots),), generator=gen)
    info = make_batch_info(token_slots, [8, 3, 8, 5], 8, use_graph=impl == "ascend_bgmv")
    y, expected = torch.zeros(len(token_slots), 16, dtype=torch.bfloat16), torch.zeros(len(token_slots), 16,
                                                                                        dtype=torch.bfloat16)
    before = Counter(npu_ops)
    add_embedding_lora(y, ids, a, b, info, impl=impl)
    add_embedding_lora(expected, ids, a, b, info, impl="torch_segments" if impl == "ascend_sgmv" else "torch_masked")
    assert kernel_calls(before) == {}
    torch.testing.assert_close(y, expected)


# The emulator must have teeth: each known way of calling the kernels wrongly fails.

def test_emulator_semantics(npu_ops):
    x, w = torch.ones(4, 32, dtype=torch.bfloat16), torch.ones(2, 8, 32, dtype=torch.bfloat16)
    y = torch.full((4, 8), -1.0)
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    torch.ops.npu.sgmv_shrink(x, w, i64([1, -1]), i64([1, 2]), y, 0.5)   # token 3 is past the last segment
    assert y[0].tolist() == [16.0] * 8 and (y[1:] == -1).all()
    with pytest.raises(AssertionError, match="int64"):
        torch.ops.npu.sgmv_shrink(x, w, i64([0]).int(), i64([4]).int(), y, 1.0)
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        torch.ops.npu.bgmv_shrink(x.float(), w.float(), i64([0] * 4), y, 1.0)
    with pytest.raises(AssertionError, match="R = 12"):
        torch.ops.npu.bgmv_expand(torch.zeros(4, 12), torch.zeros(2, 16, 12, dtype=torch.bfloat16), i64([0] * 4),
                                  torch.zeros(4, 16, dtype=torch.bfloat16), 0, 16)
    with pytest.raises(AssertionError, match="32-byte"):
        torch.ops.npu.bgmv_expand(torch.zeros(4, 8), torch.zeros(2, 24, 8, dtype=torch.bfloat16), i64([0] * 4),
                                  torch.zeros(4, 24, dtype=torch.bfloat16), 0, 24)


def _expand_each_slice(y, h, b, offsets, index, R, contiguous_h=True) -> None:
    for s, b_s in enumerate(b):
        h_s = h[:, s * R:(s + 1) * R]
        torch.ops.npu.sgmv_expand(h_s.contiguous() if contiguous_h else h_s, b_s, *index, y, offsets[s],
                                  offsets[s + 1] - offsets[s])


def int32_indices(y, x, a, b, offsets, info):
    h = torch.zeros(x.shape[0], a.shape[1])
    torch.ops.npu.sgmv_shrink(x, a, info.seg_slots.int(), info.seg_lens.int(), h, 1.0)


def model_dtype_buffer(y, x, a, b, offsets, info):
    h = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype)
    torch.ops.npu.sgmv_shrink(x, a, info.seg_slots, info.seg_lens, h, 1.0)
    _expand_each_slice(y, h, b, offsets, (info.seg_slots, info.seg_lens), info.max_rank)


def strided_activation(y, x, a, b, offsets, info):
    h = torch.zeros(x.shape[0], a.shape[1])
    torch.ops.npu.sgmv_shrink(x, a, info.seg_slots, info.seg_lens, h, 1.0)
    _expand_each_slice(y, h, b, offsets, (info.seg_slots, info.seg_lens), info.max_rank, contiguous_h=False)


def packed_weight_views(y, x, a, b, offsets, info):
    """Keeps B as one [L, out, stack*R] buffer and passes each slice as a column view."""
    R = info.max_rank
    packed = torch.zeros(b[0].shape[0], offsets[-1], len(b) * R, dtype=b[0].dtype)
    for s, b_s in enumerate(b):
        packed[:, offsets[s]:offsets[s + 1], s * R:(s + 1) * R] = b_s
    views = [packed[:, offsets[s]:offsets[s + 1], s * R:(s + 1) * R] for s in range(len(b))]
    h = torch.zeros(x.shape[0], a.shape[1])
    torch.ops.npu.sgmv_shrink(x, a, info.seg_slots, info.seg_lens, h, 1.0)
    _expand_each_slice(y, h, views, offsets, (info.seg_slots, info.seg_lens), R)


@pytest.mark.parametrize("broken", [int32_indices, model_dtype_buffer])
def test_contract_rejects_wrong_dtypes(npu_ops, broken):
    case = make_lora_case("uniform", SHAPES["prefill"], STACKS["qkv"], dtype=torch.bfloat16, seed=8)
    info = make_batch_info(case.token_slots, case.ranks, case.max_rank)
    with pytest.raises(AssertionError, match="int64|fp32"):
        broken(case.y.clone(), case.x, case.a, case.b, case.offsets, info)


@pytest.mark.parametrize("broken", [strided_activation, packed_weight_views])
def test_contract_catches_strided_views(npu_ops, broken):
    case = make_lora_case("uniform", SHAPES["prefill"], STACKS["qkv"], dtype=torch.bfloat16, seed=9)
    expected = native(case)
    assert_half_close(run(case, "prefill"), expected)
    wrong = case.y.clone()
    broken(wrong, case.x, case.a, case.b, case.offsets, make_batch_info(case.token_slots, case.ranks, case.max_rank))
    assert not torch.allclose(wrong.float(), expected.float(), rtol=2e-2, atol=3e-2)


def test_contract_catches_a_strided_y(npu_ops):
    case = make_lora_case("uniform", SHAPES["decode"], STACKS["qkv"], dtype=torch.bfloat16, seed=9)
    info = make_batch_info(case.token_slots, case.ranks, case.max_rank)
    wide = torch.zeros(case.y.shape[0], case.y.shape[1] + 16, dtype=case.y.dtype)
    view = wide[:, :case.y.shape[1]]
    view.copy_(case.y)
    h = torch.zeros(case.x.shape[0], case.a.shape[1])
    torch.ops.npu.sgmv_shrink(case.x, case.a, info.seg_slots, info.seg_lens, h, 1.0)
    _expand_each_slice(view, h, case.b, case.offsets, (info.seg_slots, info.seg_lens), case.max_rank)
    assert not torch.allclose(view.float(), native(case).float(), rtol=2e-2, atol=3e-2)


def test_backend_refuses_a_strided_weight(npu_ops):
    case = make_lora_case("uniform", SHAPES["decode"], STACKS["gate_up"], dtype=torch.bfloat16, seed=10)
    R = case.max_rank
    views = tuple(torch.zeros(b_s.shape[0], b_s.shape[1], 2 * R, dtype=b_s.dtype)[:, :, :R] for b_s in case.b)
    with pytest.raises(AssertionError, match="densely"):
        add_lora(case.y.clone(), case.x, case.a, views, case.offsets, info_for(case, "decode"), impl="ascend_bgmv")
