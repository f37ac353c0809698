"""workers/cpu_gemv.c: a decode step's few rows through oneDNN's packed bf16 weight, read in place."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.factories import PROMPTS
from workers import EngineConfig, LLMEngine, SamplingParams, cpu_gemv, cpu_ops, parallel, tape_graph

pytestmark = pytest.mark.skipif(not (cpu_gemv.available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                                reason="needs the AVX512-BF16 dot instruction and oneDNN's bf16")


def _packed(out_dim: int, in_dim: int, seed: int = 0, hint: int = parallel.PACK_BATCH_HINT):
    dense = torch.randn(out_dim, in_dim, generator=torch.Generator().manual_seed(seed)).bfloat16()
    packed = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(dense, hint), requires_grad=False)
    return dense, packed


def _within_one_rounding(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias) -> None:
    """fp32 sums of exact bf16 products, rounded once: within one bf16 step of the fp64 result (plus the fp32
    sum's own error, far below it at these sizes)."""
    want = x.double() @ dense.double().T + (0 if bias is None else bias.double())
    step = want.abs().clamp_min(1e-30) * 2.0 ** -7 + 1e-6 * (x.double().abs() @ dense.double().abs().T)
    assert bool(((got.double() - want).abs() <= step).all())


# shapes that break the 32-output blocks, the 16-lane halves and any 32-input vector: out 1-100, in down to 2
@pytest.mark.parametrize("out_dim,in_dim", [(64, 32), (37, 64), (16, 130), (100, 2), (1, 1000), (33, 98)])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_few_rows_through_the_packed_weight_matches_the_product(out_dim, in_dim, bias_dtype):
    dense, packed = _packed(out_dim, in_dim)
    assert cpu_gemv.adopt(packed, dense)
    bias = None if bias_dtype is None else torch.randn(out_dim).to(bias_dtype)
    wide = torch.randn(40, in_dim + 6).bfloat16()
    for rows in (*range(10), 16, 17, 31, 32, 33, 40):   # both paths (1-4 rows; 5-32 on AMX tiles), past them
        x = wide[:rows, 3:3 + in_dim]   # a row stride that is not the input's
        got = cpu_gemv.linear(x, packed, bias)
        assert got.shape == (rows, out_dim) and got.dtype == torch.bfloat16
        _within_one_rounding(got, x, dense, bias)
        # a row's bits do not depend on the rows beside it, within one path (one row alone, or among 4 others)
        alone = 1 if rows <= 4 or rows > 32 else 5
        for r in range(rows):
            others = x[[r] + [(r + 1 + i) % rows for i in range(alone - 1)]] if rows >= alone else None
            if others is not None:
                assert torch.equal(got[r], cpu_gemv.linear(others, packed, bias)[0])
    x3 = torch.randn(2, 1, in_dim).bfloat16()
    flat = cpu_gemv.linear(x3.view(2, in_dim), packed, bias)
    assert torch.equal(parallel.linear(x3, packed, bias), flat.view(2, 1, -1))


@pytest.mark.parametrize("inter,in_dim", [(32, 64), (96, 130), (64, 1000)])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_silu_and_mul_in_the_gemv_matches_the_gemv_then_the_kernel(inter, in_dim, bias_dtype):
    """act=SILU_AND_MUL: each gate block beside its up block, the activation in the epilogue: the bits of the
    GEMV's rounded [gate | up] through cpu_ops.silu_and_mul, on both paths (1-4 rows, AMX's 5-32)."""
    dense, packed = _packed(2 * inter, in_dim, seed=3)
    assert cpu_gemv.adopt(packed, dense) and cpu_gemv.takes_silu(packed)
    bias = None if bias_dtype is None else torch.randn(2 * inter).to(bias_dtype)
    wide = torch.randn(32, in_dim + 4).bfloat16() * 3
    for rows in (1, 2, 3, 4, 5, 16, 17, 31, min(32, cpu_gemv.max_rows())):
        if rows > cpu_gemv.max_rows():
            continue
        x = wide[:rows, 2:2 + in_dim]
        fused = cpu_gemv.linear(x, packed, bias, cpu_gemv.SILU_AND_MUL)
        assert fused.shape == (rows, inter)
        assert torch.equal(fused, cpu_ops.silu_and_mul(cpu_gemv.linear(x, packed, bias)))
        assert torch.equal(fused, parallel.linear_silu(x, packed, bias))
    odd = _packed(2 * 48, 64)[1]   # halves of 48 outputs: not whole blocks
    assert not cpu_gemv.takes_silu(odd) and parallel.linear_silu(wide[:2, :64], odd) is None
    with pytest.raises(ValueError, match="act 1"):
        torch.ops.loraserve.packed_gemv(wide[:2, :64], odd, None, 64, cpu_gemv.SILU_AND_MUL)


def test_linear_sends_up_to_max_rows_here_and_more_to_onednn(monkeypatch):
    dense, packed = _packed(96, 64)
    assert cpu_gemv.adopt(packed, dense)
    most = cpu_gemv.max_rows()
    assert most in (4, 32)   # 32 where Linux lends AMX's tiles
    calls = []
    monkeypatch.setattr(cpu_gemv, "_run", lambda *a, run=cpu_gemv._run: calls.append(a[0].shape[0]) or run(*a))
    for rows in (1, 4, most, most + 1, 256):
        y = parallel.linear(torch.randn(rows, 64).bfloat16(), packed)
        assert y.shape == (rows, 96)
    assert calls == [1, 4, most]
    monkeypatch.setattr(cpu_gemv, "ENABLED", False)   # the A/B switch
    parallel.linear(torch.randn(1, 64).bfloat16(), packed)
    assert calls == [1, 4, most]


def test_a_weight_in_another_layout_is_left_to_onednn():
    """The check compares values, not format names: a layout the kernel does not read is never marked."""
    dense, other = _packed(1536, 1024, hint=1)   # oneDNN's blocks of 64 outputs for a batch hint of 1
    assert cpu_gemv.layout_of(other, dense) is None and not cpu_gemv.adopt(other, dense)
    assert not hasattr(other, "gemv")
    dense, packed = _packed(96, 64)
    assert cpu_gemv.layout_of(packed, dense.flip(0)) is None   # the layout's shape, another weight's values
    odd, odd_packed = _packed(8, 7)   # the kernel reads whole input pairs
    assert cpu_gemv.layout_of(odd_packed, odd) is None
    f32 = torch.randn(32, 32)
    assert cpu_gemv.layout_of(torch.ops.mkldnn._reorder_linear_weight(f32, 32), f32) is None


def test_bad_operands_are_refused_naming_them():
    dense, packed = _packed(40, 64)
    assert cpu_gemv.adopt(packed, dense)
    with pytest.raises(ValueError, match=r"packed_gemv: x, weight, bias \[\(\(2, 64\), torch.float32\)"):
        cpu_gemv.linear(torch.randn(2, 64), packed, None)
    with pytest.raises(ValueError, match="packed_gemv"):
        cpu_gemv.linear(torch.randn(2, 62).bfloat16(), packed, None)
    with pytest.raises(ValueError, match="bias"):
        torch.ops.loraserve.packed_gemv(torch.randn(2, 64).bfloat16(), packed, torch.randn(39), packed.gemv.in_padded)
    with pytest.raises(ValueError, match="oneDNN's packed tensor"):
        torch.ops.loraserve.packed_gemv(torch.randn(2, 64).bfloat16(), dense, None, 64)


def test_the_op_records_on_the_tape_and_has_a_fake():
    dense, packed = _packed(50, 64)
    assert cpu_gemv.adopt(packed, dense)
    bias = torch.randn(50).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    graph = tape_graph.TapeGraph()
    with torch.inference_mode(), tape_graph.graph(graph):
        y = parallel.linear(x, packed, bias)
    assert graph.num_ops == 1 and {e.func for e in graph._tape} == {torch.ops.loraserve.packed_gemv.default}
    x.copy_(torch.randn(3, 64).bfloat16())
    graph.replay()
    assert torch.equal(y, cpu_gemv.linear(x, packed, bias))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:   # (FakeTensorMode cannot copy oneDNN's tensors)
        assert torch.ops.loraserve.packed_gemv(mode.from_tensor(x), packed, None, 64).shape == (3, 50)


# ---- a bf16 engine with it: decode steps of up to four sequences take the kernel, eager and captured ----------
def _generate(path: str, monkeypatch, enabled: bool, **config):
    monkeypatch.setattr(cpu_gemv, "ENABLED", enabled)
    calls = []
    monkeypatch.setattr(cpu_gemv, "_run", lambda *a, run=cpu_gemv._run: calls.append(1) or run(*a))
    engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", device="cpu", **config))
    try:
        out = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        graphs = engine.executor.graph_runner.graphs.values()
        recorded = {entry.func for graph, _ in graphs for entry in graph._tape}
        assert bool(calls) == enabled   # eager steps, or the captured op's replays
        assert (torch.ops.loraserve.packed_gemv.default in recorded) == (enabled and bool(graphs))
        return out
    finally:
        engine.close()


@pytest.mark.parametrize("config", [{}, {"emulate_capture": True}], ids=["eager", "captured"])
def test_engine_decodes_through_it(model_dir, monkeypatch, config):
    """oneDNN sums in another order, so the logprobs agree within bf16's rounding (tokens need not: a near tie
    may flip; in bf16 the eager and the captured engine differ by more, oneDNN's bits depend on the batch)."""
    path = str(model_dir("qwen3"))
    ours, onednn = _generate(path, monkeypatch, True, **config), _generate(path, monkeypatch, False, **config)
    assert max(abs(a - b) for oe, oo in zip(ours, onednn) for a, b in zip(oe.logprobs[:2], oo.logprobs[:2])) < 0.05


def test_without_amx_the_dot_path_takes_every_row_count(tmp_path):
    """A CPU with AVX512-BF16 but no AMX (Cooper Lake): the kernel built for it, this file's tests rerun there."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.test_cpu_kernels_arch import _cpu_flags
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= _cpu_flags():
        pytest.skip("this CPU cannot execute Cooper Lake's instructions")
    if os.environ.get("LORASERVE_KERNEL_ARCH"):
        pytest.skip("already the rerun")
    tests = Path(__file__).resolve().parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests / "test_cpu_gemv.py"), "-k",
         "matches or max_rows or layout"], cwd=tests.parent, text=True, capture_output=True, timeout=300,
        env={**os.environ, "LORASERVE_KERNEL_ARCH": "cooperlake", "LORASERVE_KERNEL_DIR": str(tmp_path)})
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    check = subprocess.run([sys.executable, "-c", "from workers import cpu_gemv; print(cpu_gemv.max_rows())"],
                           cwd=tests.parent, text=True, capture_output=True, timeout=120,
                           env={**os.environ, "LORASERVE_KERNEL_ARCH": "cooperlake",
                                "LORASERVE_KERNEL_DIR": str(tmp_path)})
    assert check.stdout.strip() == "4", check.stderr[-2000:]
