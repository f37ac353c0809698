"""The CPU LoRA kernel (lora/backends/cpu_sgmv.c) against the float64 per-token reference.

Covers each code path of the kernel: bf16 with max rank 16 (two rows of b per dot) and
32/64 (one row per dot), bf16 with rank 8 and fp32 (the portable loops); adapters with one
token each (threads take whole adapters) and one adapter with more tokens than a chunk
(threads share its rows); output sizes and input widths that are not multiples of the
vector width; base tokens and empty slots; and the fallback when the kernel is off.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora.backends import cpu_sgmv
from lora_reference import make_linear_buffers, ref_add_lora

TOKEN_PATTERNS = {
    "singles": list(range(16)) + [-1, 3],                   # 15 adapters (5, 13 empty), one token each but 3
    "one_long": [5] * 70 + [-1] * 3 + [5] * 4,             # 74 tokens of one adapter: 3 chunks
    "mixed": [0, 0, 1, -1, 2, 2, 2, 7, 1, 0, -1, 6, 6, 6, 6, 6],
}
OUT_SIZES = (47, 32, 17)     # tails of 15, 0 and 1 past the blocks of 16
IN_DIM = 72                  # not a multiple of 16 or 32: masked loads


@pytest.fixture(autouse=True)
def two_threads():
    assert cpu_sgmv.available(), "the CPU LoRA kernel did not build (needs a C compiler)"
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _case(pattern: str, max_rank: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ranks = [max_rank, max(1, max_rank // 2), 1, 3, max_rank - 1, 0, max_rank, 2] * 2   # slots 5, 13 empty
    a, b, offsets = make_linear_buffers(ranks, max_rank, IN_DIM, OUT_SIZES, dtype, gen)
    token_slots = TOKEN_PATTERNS[pattern]
    x = torch.randn(len(token_slots), IN_DIM, generator=gen).to(dtype)
    y = torch.randn(len(token_slots), offsets[-1] + 5, generator=gen).to(dtype)   # wider than the LoRA outputs
    return ranks, a, b, offsets, token_slots, x, y


def _groups(token_slots, ranks):
    lens, slots = [], []
    for slot in token_slots:     # one segment per token: the plan merges them by slot
        lens.append(1)
        slots.append(slot)
    return cpu_sgmv.plan_groups(tuple(lens), tuple(slots), tuple(ranks), max(ranks)).kernel


@pytest.mark.parametrize("pattern", TOKEN_PATTERNS)
@pytest.mark.parametrize("max_rank", [8, 16, 32, 64])
def test_bf16_matches_reference(pattern, max_rank):
    ranks, a, b, offsets, token_slots, x, y = _case(pattern, max_rank, torch.bfloat16, seed=max_rank)
    if pattern == "one_long":
        ranks[5] = max_rank      # the long run's adapter must not be the empty slot
        a, b, offsets = make_linear_buffers(ranks, max_rank, IN_DIM, OUT_SIZES, torch.bfloat16,
                                            torch.Generator().manual_seed(1))
    groups = cpu_sgmv.groups_for(tuple(
        (slot, ranks[slot], tuple(t for t, s in enumerate(token_slots) if s == slot))
        for slot in sorted(set(token_slots) - {-1}) if ranks[slot] > 0))
    expected = ref_add_lora(y.double(), x, a, b, offsets, token_slots)
    out = y.clone()
    cpu_sgmv.sgmv_add(out, x, a, b, offsets, groups, max_rank)
    # bf16 out (one rounding of y + delta) and h rounded to bf16 as torch's bf16 GEMMs do.
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=6e-2)
    untouched = [t for t, s in enumerate(token_slots) if s < 0 or ranks[s] == 0]
    assert torch.equal(out[untouched], y[untouched])
    assert torch.equal(out[:, offsets[-1]:], y[:, offsets[-1]:])   # columns past the LoRA outputs


@pytest.mark.parametrize("pattern", TOKEN_PATTERNS)
@pytest.mark.parametrize("max_rank", [16, 64])
def test_fp32_matches_reference(pattern, max_rank):
    ranks, a, b, offsets, token_slots, x, y = _case(pattern, max_rank, torch.float32, seed=3)
    ranks[5] = 0
    groups = _groups(token_slots, ranks)
    expected = ref_add_lora(y.clone(), x, a, b, offsets, token_slots)
    out = y.clone()
    if groups is not None:
        cpu_sgmv.sgmv_add(out, x, a, b, offsets, groups, max_rank)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_plan_merges_segments_and_leaves_out_base_tokens_and_empty_slots():
    plan = cpu_sgmv.plan_groups((2, 1, 3, 2), (4, -1, 1, 4), (8, 0, 0, 0, 8), 8)
    assert plan.kernel.slot.tolist() == [4] and plan.kernel.rows.tolist() == [0, 1, 6, 7]  # slot 1 is empty
    assert plan.torch == ()
    assert cpu_sgmv.plan_groups((3,), (1,), (0, 0), 8) == cpu_sgmv.Plan(None, ())          # nothing to add
    assert cpu_sgmv.plan_groups((5, 2), (-1, -1), (8,), 8) == cpu_sgmv.Plan(None, ())      # base tokens only


def test_plan_gives_adapters_with_many_tokens_to_torch():
    many = cpu_sgmv.TORCH_MIN_TOKENS
    plan = cpu_sgmv.plan_groups((many, 3, 2, many - 2, 4), (0, 1, 2, 1, 2), (8, 8, 8), 8)
    assert plan.kernel.slot.tolist() == [2] and plan.kernel.rows.tolist() == [many + 3, many + 4] + list(
        range(2 * many + 3, 2 * many + 7))
    (slot0, run), (slot1, index) = plan.torch
    assert (slot0, run) == (0, slice(0, many))                                  # one run: a slice
    assert slot1 == 1 and index.tolist() == list(range(many, many + 3)) + list(range(many + 5, 2 * many + 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_split_between_torch_and_the_kernel_matches_reference(dtype):
    from lora.backends.torch_native import TorchNativeBackend
    from lora.batch import make_batch_info
    many = cpu_sgmv.TORCH_MIN_TOKENS
    ranks = [16, 8, 1, 3, 15, 16, 16, 2]
    a, b, offsets = make_linear_buffers(ranks, 16, IN_DIM, OUT_SIZES, dtype, torch.Generator().manual_seed(9))
    token_slots = [0] * many + [3, 5, 3] + [5] * (many - 1) + [-1, 7]        # slot 0 a run, 5 scattered
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(len(token_slots), IN_DIM, generator=gen).to(dtype)
    y = torch.randn(len(token_slots), offsets[-1], generator=gen).to(dtype)
    info = make_batch_info(token_slots, ranks, 16)
    plan = cpu_sgmv.plan_groups(info.seg_lens_host, info.seg_slots_host, info.slot_ranks_host, 16)
    assert [slot for slot, _ in plan.torch] == [0, 5] and plan.kernel.slot.tolist() == [3, 7]
    expected = ref_add_lora(y.double(), x, a, b, offsets, token_slots)
    TorchNativeBackend().add_lora(y, x, a, b, offsets, info)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)
    torch.testing.assert_close(y.double(), expected, **tol)


def test_bad_operands_are_refused_before_the_kernel_reads_them():
    ranks, a, b, offsets, token_slots, x, y = _case("mixed", 16, torch.bfloat16)
    groups = _groups(token_slots, ranks)
    with pytest.raises(ValueError, match="offsets"):
        cpu_sgmv.sgmv_add(y, x, a, b, (0, 47, 79, 99), groups, 16)
    with pytest.raises(ValueError, match="do not fit y"):
        cpu_sgmv.sgmv_add(y[:, :90], x, a, b, offsets, groups, 16)
    with pytest.raises(ValueError, match="LoRA buffers"):
        cpu_sgmv.sgmv_add(y, x, a, b, offsets, groups, 8)
    past_slots = cpu_sgmv.groups_for(((a.shape[0], 4, (0,)),))
    with pytest.raises(ValueError, match="past the batch, the slots or the rank"):
        cpu_sgmv.sgmv_add(y, x, a, b, offsets, past_slots, 16)
    past_rows = cpu_sgmv.groups_for(((0, 4, (x.shape[0],)),))
    with pytest.raises(ValueError, match="past the batch"):
        cpu_sgmv.sgmv_add(y, x, a, b, offsets, past_rows, 16)
    strided_b = tuple(b_s.transpose(1, 2).contiguous().transpose(1, 2) for b_s in b)
    assert not cpu_sgmv.sgmv_add(y, x, a, strided_b, offsets, groups, 16)        # not its layout: torch's
    assert not cpu_sgmv.sgmv_add(y.float(), x.float(), a, b, offsets, groups, 16)  # nor mixed dtypes


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], text=True,
                          capture_output=True, timeout=300, env={**os.environ, **env})


FALLBACK = """
import torch
from lora.backends import cpu_sgmv
from lora.backends.torch_native import TorchNativeBackend
from lora.batch import make_batch_info
from lora_reference import make_lora_case, ref_add_lora
assert not cpu_sgmv.available()
case = make_lora_case("uniform", [1] * 12, (24, 8, 8), seed=4)
expected = ref_add_lora(case.y.clone(), case.x, case.a, case.b, case.offsets, case.token_slots)
TorchNativeBackend().add_lora(case.y, case.x, case.a, case.b, case.offsets,
                              make_batch_info(case.token_slots, case.ranks, case.max_rank))
torch.testing.assert_close(case.y, expected, rtol=1e-5, atol=1e-5)
"""


def test_switched_off_the_torch_ops_do_the_work():
    done = _run_python(FALLBACK, LORASERVE_CPU_KERNEL="0", PYTHONPATH="tests")
    assert done.returncode == 0, done.stderr


def test_without_a_compiler_the_torch_ops_do_the_work_and_a_warning_says_why(tmp_path):
    done = _run_python(FALLBACK, CC=str(tmp_path / "no-such-cc"), LORASERVE_KERNEL_DIR=str(tmp_path / "kernels"),
                       PYTHONPATH="tests")
    assert done.returncode == 0, done.stderr
    assert "CPU kernel cpu_sgmv.c unavailable" in done.stderr



def test_more_stacked_slices_than_the_fast_path_holds():
    """The bf16-dot path keeps per-slice tables for up to 8 slices; more go to the generic loops."""
    gen = torch.Generator().manual_seed(5)
    ranks = [16, 7, 16, 3]
    outs = (16,) * 9 + (20,)
    a, b, offsets = make_linear_buffers(ranks, 16, IN_DIM, outs, torch.bfloat16, gen)
    token_slots = [0, 1, 2, 3, 0, -1]
    x = torch.randn(len(token_slots), IN_DIM, generator=gen).to(torch.bfloat16)
    y = torch.randn(len(token_slots), offsets[-1], generator=gen).to(torch.bfloat16)
    expected = ref_add_lora(y.double(), x, a, b, offsets, token_slots)
    assert cpu_sgmv.sgmv_add(y, x, a, b, offsets, _groups(token_slots, ranks), 16)
    torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=6e-2)


def test_negative_rows_slots_or_ranks_are_refused():
    for runs in (((0, 8, (-1,)),), ((-1, 8, (0,)),), ((0, -2, (0,)),)):
        with pytest.raises(ValueError, match=">= 0"):
            cpu_sgmv.groups_for(runs)
