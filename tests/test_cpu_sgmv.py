"""The CPU LoRA kernel (lora/backends/cpu_sgmv.c, torch ops loraserve::sgmv_add / bgmv_add)
against the float64 per-token reference.

Covers each code path of the kernel: bf16 with max rank 16 (two rows of b per dot) and
32/64 (one row per dot), bf16 with rank 8 and fp32 (the portable loops); adapters with one
token each (threads take whole adapters) and one adapter with more tokens than a chunk
(threads share its rows); output sizes and input widths that are not multiples of the
vector width; base tokens and empty slots; the per-token entry (graph phase); and the
fallback when the kernel is off.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora import native
from lora.backends import cpu_sgmv
from lora.batch import KernelGroups
from lora_reference import OpLog, make_linear_buffers, ref_add_lora

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


def _groups(token_slots, ranks) -> KernelGroups:
    """One group per adapter present with rank > 0, its tokens in order (what plan_step builds)."""
    slots = [slot for slot in dict.fromkeys(token_slots) if slot >= 0 and ranks[slot] > 0]
    rows = [[t for t, s in enumerate(token_slots) if s == slot] for slot in slots]
    return KernelGroups.of(slots, [ranks[slot] for slot in slots], rows)


def sgmv_add(y, x, a, b, offsets, groups: KernelGroups) -> None:
    torch.ops.loraserve.sgmv_add(y, x, a, b, offsets, groups.packed, groups.num_groups)


@pytest.mark.parametrize("pattern", TOKEN_PATTERNS)
@pytest.mark.parametrize("max_rank", [8, 16, 32, 64])
def test_bf16_matches_reference(pattern, max_rank):
    ranks, a, b, offsets, token_slots, x, y = _case(pattern, max_rank, torch.bfloat16, seed=max_rank)
    if pattern == "one_long":
        ranks[5] = max_rank      # the long run's adapter must not be the empty slot
        a, b, offsets = make_linear_buffers(ranks, max_rank, IN_DIM, OUT_SIZES, torch.bfloat16,
                                            torch.Generator().manual_seed(1))
    expected = ref_add_lora(y.double(), x, a, b, offsets, token_slots)
    out = y.clone()
    sgmv_add(out, x, a, b, offsets, _groups(token_slots, ranks))
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
    expected = ref_add_lora(y.clone(), x, a, b, offsets, token_slots)
    out = y.clone()
    sgmv_add(out, x, a, b, offsets, _groups(token_slots, ranks))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", TOKEN_PATTERNS)
def test_per_token_entry_matches_reference(pattern, dtype):
    """bgmv_add groups the tokens itself, every slot at the full rank (zero past each slot's rank)."""
    ranks, a, b, offsets, token_slots, x, y = _case(pattern, 16, dtype, seed=5)
    expected = ref_add_lora(y.double(), x, a, b, offsets, token_slots)
    out = y.clone()
    torch.ops.loraserve.bgmv_add(out, x, a, b, offsets, torch.tensor(token_slots))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)
    torch.testing.assert_close(out.double(), expected, **tol)
    base = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(out[base], y[base])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_split_between_torch_and_the_kernel_matches_reference(dtype):
    from lora.backends.cpu_sgmv import GEMM_MIN_TOKENS, CpuBackend
    many = GEMM_MIN_TOKENS
    ranks = [16, 8, 1, 3, 15, 16, 16, 2]
    a, b, offsets = make_linear_buffers(ranks, 16, IN_DIM, OUT_SIZES, dtype, torch.Generator().manual_seed(9))
    token_slots = [0] * many + [3, 5, 3] + [5] * (many - 1) + [-1, 7]        # slot 0 a run, 5 scattered
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(len(token_slots), IN_DIM, generator=gen).to(dtype)
    y = torch.randn(len(token_slots), offsets[-1], generator=gen).to(dtype)
    backend = CpuBackend("cpu", dtype, 16)
    info = backend.batch_info(token_slots, ranks, "prefill")
    assert [g.slot for g in info.plan.gemm] == [0, 5] and info.plan.kernel.slot.tolist() == [3, 7]
    assert info.plan.gemm[0].rows == slice(0, many)
    expected = ref_add_lora(y.double(), x, a, b, offsets, token_slots)
    with OpLog() as log:
        backend.bind("0.qkv_proj", a, b, offsets)(y, x, info)
    assert "aten::addmm_" in log.names and not backend.fallbacks   # the GEMM groups; the kernel by its prepared call
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)
    torch.testing.assert_close(y.double(), expected, **tol)


def test_bad_operands_are_refused_before_the_kernel_reads_them():
    ranks, a, b, offsets, token_slots, x, y = _case("mixed", 16, torch.bfloat16)
    groups = _groups(token_slots, ranks)
    with pytest.raises(ValueError, match="does not take these operands"):
        sgmv_add(y, x, a, b, (0, 47, 79, 99), groups)
    with pytest.raises(ValueError, match="does not take these operands"):
        sgmv_add(y[:, :90], x, a, b, offsets, groups)
    with pytest.raises(ValueError, match="does not take these operands"):
        sgmv_add(y, x, a[:, :40], b, offsets, groups)
    for past in (KernelGroups.of([a.shape[0]], [4], [[0]]), KernelGroups.of([0], [4], [[x.shape[0]]]),
                 KernelGroups.of([0], [17], [[0]])):   # a slot, a row, a rank past the buffers
        with pytest.raises(ValueError, match="past the batch, the slots or the rank"):
            sgmv_add(y, x, a, b, offsets, past)
    with pytest.raises(ValueError, match="past the batch, the slots or the rank"):   # rows past the tensor
        torch.ops.loraserve.sgmv_add(y, x, a, b, offsets, torch.tensor([0, 8, 0, 5, 0]), 1)
    with pytest.raises(ValueError, match="cannot hold 5 groups"):
        torch.ops.loraserve.sgmv_add(y, x, a, b, offsets, torch.tensor([0, 8, 0, 1, 0]), 5)
    with pytest.raises(ValueError, match="past the batch, the slots or the rank"):
        torch.ops.loraserve.bgmv_add(y, x, a, b, offsets, torch.full((x.shape[0],), a.shape[0]))
    with pytest.raises(ValueError, match="one per row"):
        torch.ops.loraserve.bgmv_add(y, x, a, b, offsets, torch.zeros(3, dtype=torch.int64))
    assert not cpu_sgmv.supports(y.half(), x.half(), a.half(), b)   # no fp16 code: the torch ops'
    assert not cpu_sgmv.supports(y.float(), x.float(), a, b)        # nor mixed dtypes
    strided_b = tuple(b_s.transpose(1, 2).contiguous().transpose(1, 2) for b_s in b)
    for bad in ((y, x, a, strided_b), (y.float(), x.float(), a, b), (y, x[:, ::2], a, b)):
        with pytest.raises(ValueError, match="does not take these operands"):
            sgmv_add(*bad, offsets, groups)


def test_negative_rows_slots_or_ranks_are_refused():
    ranks, a, b, offsets, token_slots, x, y = _case("mixed", 16, torch.float32)
    before = y.clone()
    for slots, ranks_, rows in (([0], [8], [[-1]]), ([-1], [8], [[0]]), ([0], [-2], [[0]])):
        with pytest.raises(ValueError, match="past the batch, the slots or the rank"):
            sgmv_add(y, x, a, b, offsets, KernelGroups.of(slots, ranks_, rows))
    assert torch.equal(y, before)


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], text=True,
                          capture_output=True, timeout=300, env={**os.environ, **env})


FALLBACK = """
import sys
import pytest, torch
from lora.backends import cpu_sgmv, get_backend
import workers.cpu_attention
assert "torch._dynamo" not in sys.modules, "importing the kernels costs a second of torch._dynamo import again"
from lora_reference import make_lora_case, ref_add_lora
assert not cpu_sgmv.available()
backend = get_backend(None, "cpu", torch.float32, 8)       # the CPU's default: cpu, without its kernel
assert backend.name == "torch_native", backend.name
with pytest.raises(RuntimeError, match="lora_backend 'cpu': the CPU LoRA kernel is unavailable"):
    get_backend("cpu", "cpu", torch.float32, 8)            # asked for by name: refused at start-up
case = make_lora_case("uniform", [1] * 12, (24, 8, 8), seed=4)
expected = ref_add_lora(case.y.clone(), case.x, case.a, case.b, case.offsets, case.token_slots)
op = backend.bind("0.qkv_proj", case.a, case.b, case.offsets)
op(case.y, case.x, backend.batch_info(case.token_slots, case.ranks, "decode"))
torch.testing.assert_close(case.y, expected, rtol=1e-5, atol=1e-5)
"""


def test_the_kernels_availability_is_marked_constant_as_torch_compiler_marks_it():
    """lora.native.constant_result sets what torch.compiler.assume_constant_result sets (FALLBACK checks that
    it does so without importing torch._dynamo)."""
    from workers import cpu_attention

    def probe():
        return True

    marked = torch.compiler.assume_constant_result(probe)
    assert vars(marked) == {"_dynamo_marked_constant": True}
    for available in (cpu_sgmv.available, cpu_attention.available):
        assert vars(available).items() >= vars(marked).items()


@pytest.mark.slow   # a fresh interpreter running the ops
def test_switched_off_the_torch_ops_do_the_work():
    done = _run_python(FALLBACK, LORASERVE_CPU_KERNEL="0", PYTHONPATH="tests")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow   # a fresh interpreter running the ops
def test_without_a_compiler_the_torch_ops_do_the_work_and_a_warning_says_why(tmp_path):
    done = _run_python(FALLBACK, CC=str(tmp_path / "no-such-cc"), LORASERVE_KERNEL_DIR=str(tmp_path / "kernels"),
                       PYTHONPATH="tests")
    assert done.returncode == 0, done.stderr
    assert "CPU kernel cpu_sgmv.c unavailable" in done.stderr
    assert done.stderr.count("running torch_native") == 1, done.stderr


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
    sgmv_add(y, x, a, b, offsets, _groups(token_slots, ranks))
    torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=6e-2)


def test_a_kernel_is_rebuilt_when_a_header_it_includes_changes(tmp_path, monkeypatch):
    """lora/native.py keys each build by the source and every local header it includes, recursively (vec.h includes
    native.h): an edited header must not load a stale library."""
    monkeypatch.setenv("LORASERVE_KERNEL_DIR", str(tmp_path / "kernels"))
    (tmp_path / "inner.h").write_text("#define VALUE 1\n")
    (tmp_path / "outer.h").write_text('#include "inner.h"\n')
    source = tmp_path / "k.c"
    source.write_text('#include "outer.h"\nint value(void) { return VALUE; }\n')
    first = native._build(source)
    assert native._build(source) == first
    (tmp_path / "inner.h").write_text("#define VALUE 2\n")
    second = native._build(source)
    assert second != first and ctypes.CDLL(str(second)).value() == 2
