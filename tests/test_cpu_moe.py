"""The CPU grouped expert GEMM (workers/models/cpu_moe.py: cpu_moe.c's kernel, torch._grouped_mm for many rows per
expert): exact against per-expert torch GEMMs at shapes that break the kernel's blocking (4 outputs x 4 rows,
32-element bf16 / 16-element fp32 vectors, 64-output work items, empty experts) and torch's 16-byte strides,
threaded, on the tape; and a Qwen3-MoE engine with it equal to the per-expert path (fp32: tokens
identical, |dlogprob| < 1e-5), expert LoRA mixed with the base, eager and captured decode."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import huge_pages
from factories import PROMPTS, engine_with_adapters
from lora import native
from moe_factories import make_expert_adapter, make_moe_model
from workers import SamplingParams, tape_graph
from workers.models import cpu_moe, moe_experts, moe_fused

assert cpu_moe.available(), "no C compiler: the kernel under test is not built"


def _operands(counts, in_dim, out_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), in_dim, generator=gen).to(dtype)
    w = torch.randn(len(counts), out_dim, in_dim, generator=gen).to(dtype)
    offsets = torch.tensor([0, *counts]).cumsum(0)
    return x, w, offsets


def _reference(x, w, offsets):
    """Per expert, fp32 GEMM, rounded once to x's dtype (what the kernel's fp32 accumulation gives)."""
    y = torch.empty(x.shape[0], w.shape[1])
    for e in range(w.shape[0]):
        lo, hi = offsets[e].item(), offsets[e + 1].item()
        y[lo:hi] = x[lo:hi].double().matmul(w[e].double().T).float()
    return y.to(x.dtype)


SHAPES = [   # (rows per expert, in, out): tails of every block and vector
    ([1], 1, 1), ([3, 0, 5], 17, 3), ([0, 9, 1, 4], 33, 70), ([2, 0, 0, 7, 1], 64, 129), ([4, 5], 1029, 5),
    ([6, 0, 1], 24, 64), ([5, 0, 7], 32, 16), ([9, 3], 64, 40),
    # the AMX tiles' (dims multiples of 32): row blocks of 16 in pairs, a pair's second block partial or absent
    ([17, 0, 33, 1], 64, 96), ([40], 1024, 64), ([3, 16, 0, 32], 32, 32),
    ([300, 0, 520], 64, 96),   # past cpu_moe.c's ROW_CHUNK (256): an expert's rows in several tasks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts,in_dim,out_dim", SHAPES)
@pytest.mark.parametrize("kernel_rows", [10 ** 9, 0], ids=["kernel", "grouped_mm_where_aligned"])
def test_grouped_gemm_matches_per_expert_gemms(counts, in_dim, out_dim, dtype, kernel_rows, monkeypatch):
    monkeypatch.setattr(cpu_moe, "KERNEL_ROWS_PER_EXPERT", kernel_rows)
    x, w, offsets = _operands(counts, in_dim, out_dim, dtype)
    y = cpu_moe.grouped_gemm(x, w, offsets)
    expected = _reference(x, w, offsets)
    if dtype == torch.float32:
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * in_dim ** 0.5)
    else:   # fp32 sums in another order, rounded once: at most one bf16 step from the exact sum's rounding
        step = expected.float().abs().clamp(min=2.0 ** -120) * 2.0 ** -7
        assert ((y.float() - expected.float()).abs() <= step).all()


def test_many_rows_per_expert_in_bf16_run_on_amx_tiles_where_the_cpu_and_dims_allow():
    with open("/proc/cpuinfo") as f:
        amx = "amx_bf16" in next((line for line in f if line.startswith("flags")), "").split()
    assert cpu_moe.amx_available() == amx
    for counts, in_dim, out_dim in SHAPES:
        x, w, _ = _operands(counts, in_dim, out_dim, torch.bfloat16)
        many = len(counts) * cpu_moe.KERNEL_ROWS_PER_EXPERT < sum(counts)
        assert cpu_moe._amx(x, w) == (amx and many and in_dim % 32 == 0 and out_dim % 32 == 0)
        assert not cpu_moe._amx(x.float(), w.float())


@pytest.mark.parametrize("out_dim", [300, 320], ids=["vector", "amx"])
def test_threads_share_the_experts_without_changing_a_value(out_dim):
    x, w, offsets = _operands([3, 0, 2, 5, 1, 4], 1024, out_dim, torch.bfloat16, seed=3)   # past PARALLEL_MIN
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_moe.grouped_gemm(x, w, offsets)
        torch.set_num_threads(2)
        two = cpu_moe.grouped_gemm(x, w, offsets)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def test_strided_rows_and_bad_operands(monkeypatch):
    monkeypatch.setattr(cpu_moe, "KERNEL_ROWS_PER_EXPERT", 10 ** 9)   # the kernel's checks
    x, w, offsets = _operands([2, 3], 40, 8, torch.float32)
    wide = torch.zeros(5, 48)
    wide[:, :40] = x
    assert torch.equal(cpu_moe.grouped_gemm(wide[:, :40], w, offsets), cpu_moe.grouped_gemm(x, w, offsets))
    with pytest.raises(ValueError, match="offsets must rise"):
        cpu_moe.grouped_gemm(x, w, torch.tensor([0, 4, 3]))
    with pytest.raises(ValueError, match="offsets must rise"):
        cpu_moe.grouped_gemm(x, w, torch.tensor([0, 2, 4]))   # 4 rows counted, 5 given
    with pytest.raises(ValueError, match="int64 offsets"):
        cpu_moe.grouped_gemm(x, w, offsets.int())
    with pytest.raises(ValueError, match="moe_grouped_gemm"):
        cpu_moe.grouped_gemm(x.to(torch.bfloat16), w, offsets)


def test_the_op_records_on_the_tape_and_has_a_fake():
    x, w, offsets = _operands([2, 0, 3], 20, 7, torch.float32)
    graph = tape_graph.TapeGraph()
    with torch.inference_mode(), tape_graph.graph(graph):
        y = cpu_moe.grouped_gemm(x, w, offsets)
    assert graph.num_ops == 1
    x.copy_(torch.randn_like(x))
    offsets.copy_(torch.tensor([0, 4, 4, 5]))   # the counts too are read at replay
    graph.replay()
    torch.testing.assert_close(y, _reference(x, w, offsets))
    with FakeTensorMode() as mode:
        fake = torch.ops.loraserve.moe_grouped_gemm(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(offsets))
    assert fake.shape == (5, 7)


def test_expert_offsets_count_sorted_rows_on_the_device():
    experts = torch.tensor([0, 0, 2, 2, 2, 5])
    assert cpu_moe.expert_offsets(experts, 6).tolist() == [0, 2, 2, 5, 5, 5, 6]


def test_huge_page_copy_is_an_equal_copy_in_advised_memory():
    w = torch.randn(3, 5, 7).to(torch.bfloat16)
    h = native.huge_page_copy(w)
    assert torch.equal(h, w) and h.dtype == w.dtype and h.is_contiguous()
    assert h.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    assert huge_pages.advised(h) and not huge_pages.advised(w)
    z = native.huge_page_zeros((4, 6), torch.bfloat16)   # the same memory, zeros without a first copy
    assert z.shape == (4, 6) and z.dtype == torch.bfloat16 and not z.any() and huge_pages.advised(z)
    z[1, 2] = 3.0   # writable
    assert z.sum().item() == 3.0


# ---- a Qwen3-MoE engine with the kernel, against the per-expert path --------------------------------------------
@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu_moe")
    path = make_moe_model(out / "model", moe_intermediate_size=40, num_experts=6)   # 40: a masked vector tail
    return path, {"experts": make_expert_adapter(path, out / "experts", r=4, alpha=8, target_modules=["q_proj"],
                                                 seed=2)}


GROUPED = {torch.ops.loraserve.moe_grouped_gemm.default, torch.ops.aten._grouped_mm.default}


def _generate(path, adapters, monkeypatch, enabled: bool, **config):
    monkeypatch.setattr(cpu_moe, "ENABLED", enabled)
    engine = engine_with_adapters(path, adapters, max_lora_rank=8, **config)
    try:
        experts = [m for m in engine.executor.model.modules() if isinstance(m, moe_experts.GroupedLinear)]
        assert experts and all(m.packed is None for m in experts) == enabled   # the kernel reads them unpacked
        assert not enabled or all(huge_pages.advised(m.weight) for m in experts)
        names = [None, "experts"] * 3
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        out = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(names))], params, adapters=names)
        graphs = engine.executor.graph_runner.graphs.values()
        recorded = {entry.func for graph, _ in graphs for entry in graph._tape}
        expected = {torch.ops.loraserve.moe_grouped_gemm.default} if cpu_moe.KERNEL_ROWS_PER_EXPERT > 100 else GROUPED
        assert bool(recorded & expected) == (enabled and bool(graphs))
        return out
    finally:
        engine.close()


@pytest.mark.parametrize("config", [{}, {"emulate_capture": True}], ids=["eager", "captured"])
@pytest.mark.parametrize("kernel_rows", [cpu_moe.KERNEL_ROWS_PER_EXPERT, 10 ** 9], ids=["default", "kernel_only"])
def test_engine_with_the_kernel_equals_the_per_expert_path(moe_files, monkeypatch, config, kernel_rows):
    monkeypatch.setattr(cpu_moe, "KERNEL_ROWS_PER_EXPERT", kernel_rows)
    # the grouped GEMM per projection, not the fused block that runs the same kernel inside one call (whose own tests,
    # test_moe_fused*.py, hold it to this path)
    monkeypatch.setattr(moe_fused, "ENABLED", False)
    path, adapters = moe_files
    calls = []
    monkeypatch.setattr(cpu_moe, "grouped_gemm", lambda *a, run=cpu_moe.grouped_gemm: calls.append(1) or run(*a))
    grouped = _generate(path, adapters, monkeypatch, True, **config)
    assert calls, "the grouped GEMM did not run"
    calls.clear()
    per_expert = _generate(path, adapters, monkeypatch, False, **config)
    assert not calls
    assert [o.token_ids for o in grouped] == [o.token_ids for o in per_expert]
    assert max(abs(a - b) for og, op in zip(grouped, per_expert) for a, b in zip(og.logprobs, op.logprobs)) < 1e-5


def test_the_benchmark_alternates_the_grouped_gemm_with_the_per_expert_path(tmp_path, monkeypatch):
    """benchmarks/moe.py --kernel-ab at a tiny shape: both engines built (one packed, one not) and measured."""
    from dataclasses import replace

    from benchmarks import moe
    from benchmarks.common import TINY_SIZES

    monkeypatch.setenv("LORASERVE_BENCH_CACHE", str(tmp_path))
    shape = moe.MoeShape(hidden_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_hidden_layers=1,
                         vocab_size=512, intermediate_size=96)
    sizes = replace(TINY_SIZES, threads=1)
    result = moe.run(sizes, "float32", rounds=1, log=lambda *_: None, shape=shape, peft=False, kernel_ab=True)
    assert set(result["output_tok_s"]) == {"before_eight", "before_base", "after_eight", "after_base"}
    assert result["after_over_before_base"] > 0 and result["eight_over_base"] > 0 and cpu_moe.ENABLED
