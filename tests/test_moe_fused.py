"""A MoE block's routing and decode-sized experts in one C call each (workers/models/moe_fused.py, cpu_moe_fused.c):
the routing equal to HF's softmax / top-k / renormalisation and group_rows' sort; the fused experts and the combine
equal, bit for bit, to the unfused path they replace (gather, grouped GEMMs, SiLU-and-mul, index_add_) at shapes
that break the kernels' blocking; threaded; on the tape with fakes; and a Qwen3-MoE engine with them equal to the
engine without (fp32: tokens identical, |dlogprob| < 1e-5), eager and captured, with and without expert LoRA."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from factories import PROMPTS, engine_with_adapters
from moe_factories import make_expert_adapter, make_moe_model
from workers import SamplingParams, cpu_ops, tape_graph
from workers.models import cpu_moe, moe_experts, moe_fused

assert moe_fused.available(), "no C compiler: the kernels under test are not built"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _router(logits, top_k, normalize):
    """Qwen3-MoE's router after its linear (workers/models/qwen3_moe.py's Router, HF's), ties in the top-k to the lower
    expert id (torch.topk leaves their order to its selection algorithm; bf16 logits tie often)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids)
    assert torch.equal(weights, torch.topk(probs, top_k, dim=-1).values)   # the same values as torch.topk's choice
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


ROUTES = [(16, 128, 8), (3, 8, 2), (1, 5, 5), (7, 7, 3), (0, 4, 1), (33, 12, 1)]   # (tokens, experts, top_k)


@DTYPES
@pytest.mark.parametrize("normalize", [True, False], ids=["renormalised", "softmax"])
@pytest.mark.parametrize("tokens,experts,top_k", ROUTES)
def test_route_matches_the_router_and_group_rows(tokens, experts, top_k, normalize, dtype):
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    expected = moe_experts.group_rows(*_router(logits, top_k, normalize), experts, False, grouped=True)
    rows = moe_experts.route_grouped(logits, top_k, normalize)
    assert torch.equal(rows.token, expected.token) and torch.equal(rows.expert, expected.expert)
    assert torch.equal(rows.offsets, expected.offsets)
    if dtype == torch.bfloat16:   # exp's last fp32 bit never reaches a bf16 weight here
        assert torch.equal(rows.weight, expected.weight)
    else:
        torch.testing.assert_close(rows.weight, expected.weight, rtol=1e-6, atol=1e-7)


def _rows(tokens, experts, top_k, dtype, seed):
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return moe_experts.route_grouped(logits, top_k, True)


def _unfused(x, w13, w2, rows):
    """MoeExperts.forward before the fusion: gather, gate_up, SiLU-and-mul, down (the vector kernel), index_add_."""
    h = cpu_moe.grouped_gemm(x[rows.token], w13, rows.offsets)
    y = cpu_moe.grouped_gemm(cpu_ops.silu_and_mul(h), w2, rows.offsets)
    return y.new_zeros(x.shape[0], x.shape[1]).index_add_(0, rows.token, y * rows.weight.unsqueeze(1))


EXPERTS = [   # (tokens, experts, top_k, hidden, inter): vector tails, 4x4 blocks' tails, 64-output items, empty experts
    (16, 128, 8, 1024, 384), (3, 8, 2, 72, 40), (1, 5, 5, 33, 17), (5, 16, 2, 64, 24), (2, 40, 3, 300, 1),
]


@DTYPES
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", EXPERTS)
def test_the_fused_block_and_its_combine_matches_the_unfused_path(tokens, experts, top_k, hidden, inter, dtype,
                                                                 monkeypatch):
    monkeypatch.setattr(cpu_moe, "KERNEL_ROWS_PER_EXPERT", 10 ** 9)   # the reference on the same vector kernel
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    rows = _rows(tokens, experts, top_k, dtype, seed=hidden)
    expected = _unfused(x, w13, w2, rows)
    assert torch.equal(moe_fused.experts(x, w13, w2, rows.offsets, rows.token, rows.weight), expected)
    y = cpu_moe.grouped_gemm(cpu_ops.silu_and_mul(cpu_moe.grouped_gemm(x[rows.token], w13, rows.offsets)), w2,
                             rows.offsets)
    assert torch.equal(moe_fused.combine(y, rows.token, rows.weight, tokens), expected)


@DTYPES
@pytest.mark.parametrize("valid", [3, 0, 9], ids=["padded", "none_real", "past_the_tokens"])
def test_a_count_of_real_tokens_routes_only_them(valid, dtype):
    """A captured decode's padded bucket: the rows past `valid` get no expert rows (offsets end at valid * top_k)
    and zeros out of the block; the real ones the bits they get routed alone."""
    tokens, experts, top_k, hidden, inter = 5, 16, 2, 64, 24
    gen = torch.Generator().manual_seed(valid)
    logits = torch.randn(tokens, experts, generator=gen).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    real = min(valid, tokens)
    weight, token, expert, offsets = moe_fused.route(logits, top_k, True, torch.tensor([valid]))
    alone = moe_experts.route_grouped(logits[:real], top_k, True)
    n = real * top_k
    assert torch.equal(offsets, alone.offsets) and int(offsets[-1]) == n
    assert torch.equal(token[:n], alone.token) and torch.equal(expert[:n], alone.expert)
    assert torch.equal(weight[:n], alone.weight)
    assert torch.equal(token[n:], torch.arange(n, tokens * top_k) // top_k) and bool((expert[n:] == -1).all())
    out = moe_fused.experts(x, w13, w2, offsets, token, weight)
    assert torch.equal(out[:real], moe_fused.experts(x[:real], w13, w2, alone.offsets, alone.token, alone.weight))
    assert not out[real:].any()


def test_threads_share_the_experts_and_the_combine_without_changing_a_value():
    x = torch.randn(24, 1024).to(torch.bfloat16)   # past the kernels' thresholds for a parallel region
    w13, w2 = torch.randn(32, 512, 1024).to(torch.bfloat16), torch.randn(32, 1024, 256).to(torch.bfloat16)
    rows = _rows(24, 32, 4, torch.bfloat16, seed=1)
    y = torch.randn(rows.token.shape[0], 4096).to(torch.bfloat16)
    previous, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((moe_fused.experts(x, w13, w2, rows.offsets, rows.token, rows.weight),
                            moe_fused.combine(y, rows.token, rows.weight, 24)))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_bad_operands_are_refused_naming_them():
    x, w13, w2 = torch.randn(2, 8), torch.randn(3, 6, 8), torch.randn(3, 8, 3)
    rows = _rows(2, 3, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="offsets must rise"):
        moe_fused.experts(x, w13, w2, torch.tensor([0, 3, 2, 4]), rows.token, rows.weight)
    with pytest.raises(ValueError, match="each row's token"):
        moe_fused.experts(x, w13, w2, rows.offsets, torch.tensor([0, 1, 5, 1]), rows.weight)
    with pytest.raises(ValueError, match="w2 \\[E, H, I\\]"):
        moe_fused.experts(x, w13, w2[:, :, :2], rows.offsets, rows.token, rows.weight)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_fused.experts(x.to(torch.bfloat16), w13, w2, rows.offsets, rows.token, rows.weight)
    with pytest.raises(ValueError, match="each row's token"):
        moe_fused.combine(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]), rows.weight, 2)
    with pytest.raises(ValueError, match="1 <= top_k <= experts"):
        moe_fused.route(torch.randn(2, 3), 4, True)
    with pytest.raises(ValueError, match="an int64 count of real tokens"):
        moe_fused.route(torch.randn(2, 3), 2, True, torch.tensor([1.0]))


def test_the_ops_record_on_the_tape_and_have_fakes():
    x, w13, w2 = torch.randn(3, 16), torch.randn(4, 10, 16), torch.randn(4, 16, 5)
    logits = torch.randn(3, 4)
    graph = tape_graph.TapeGraph()
    with torch.inference_mode(), tape_graph.graph(graph):
        weight, token, expert, offsets = moe_fused.route(logits, 2, True)
        out = moe_fused.experts(x, w13, w2, offsets, token, weight)
    assert graph.num_ops == 2
    logits.copy_(torch.randn(3, 4))   # new routing and inputs, replayed on the same buffers
    x.copy_(torch.randn(3, 16))
    graph.replay()
    rows = moe_experts.route_grouped(logits, 2, True)
    assert torch.equal(token, rows.token) and torch.equal(offsets, rows.offsets)
    assert torch.equal(out, moe_fused.experts(x, w13, w2, rows.offsets, rows.token, rows.weight))
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (x, w13, w2, offsets, token, weight)]
        assert torch.ops.loraserve.moe_route(mode.from_tensor(logits), 2, True)[3].shape == (5,)
        assert torch.ops.loraserve.moe_experts(*fakes).shape == (3, 16)
        y = mode.from_tensor(torch.randn(6, 16))
        assert torch.ops.loraserve.moe_combine(y, fakes[4], fakes[5], 3).shape == (3, 16)


# ---- a Qwen3-MoE engine with them, against the engine without ----------------------------------------------------
@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_fused")
    path = make_moe_model(out / "model", moe_intermediate_size=40, num_experts=6)
    return path, {"experts": make_expert_adapter(path, out / "experts", r=4, alpha=8, seed=2)}


FUSED_OPS = {torch.ops.loraserve.moe_route.default, torch.ops.loraserve.moe_experts.default}


def _generate(path, adapters, names, monkeypatch, fused: bool, **config):
    monkeypatch.setattr(moe_fused, "ENABLED", fused)
    calls = []
    monkeypatch.setattr(moe_fused, "_experts_impl", lambda *a, run=moe_fused._experts_impl: calls.append(1) or run(*a))
    engine = engine_with_adapters(path, adapters, max_lora_rank=8, **config)
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        out = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(names))], params, adapters=names)
        graphs = engine.executor.graph_runner.graphs.values()
        recorded = {entry.func for graph, _ in graphs for entry in graph._tape}
        if not any(names):   # base decode steps run the fused experts (a step with expert LoRA keeps its pipeline)
            assert bool(calls) == fused and bool(recorded & FUSED_OPS) == (fused and bool(graphs))
        return out
    finally:
        engine.close()


@pytest.mark.parametrize("config", [{}, {"emulate_capture": True}], ids=["eager", "captured"])
@pytest.mark.parametrize("names", [[None] * 4, [None, "experts"] * 2], ids=["base", "expert_lora"])
def test_engine_with_the_fused_block_equals_the_engine_without(moe_files, monkeypatch, config, names):
    path, adapters = moe_files
    fused = _generate(path, adapters, names, monkeypatch, True, **config)
    unfused = _generate(path, adapters, names, monkeypatch, False, **config)
    assert [o.token_ids for o in fused] == [o.token_ids for o in unfused]
    assert max(abs(a - b) for of, ou in zip(fused, unfused) for a, b in zip(of.logprobs, ou.logprobs)) < 1e-5


def test_the_benchmark_alternates_the_fused_block_with_the_unfused_path(tmp_path, monkeypatch):
    """benchmarks/moe.py --fused-ab at a tiny shape: two engines, the switch off for `before`, on for `after`."""
    from dataclasses import replace

    from benchmarks import moe
    from benchmarks.common import TINY_SIZES

    monkeypatch.setenv("LORASERVE_BENCH_CACHE", str(tmp_path))
    from workers.models import qwen3_moe

    fused, unfused = [], []   # the fused block's calls, the torch routing's (only with the switch off)
    monkeypatch.setattr(moe_fused, "_experts_impl", lambda *a, run=moe_fused._experts_impl: fused.append(1) or run(*a))
    monkeypatch.setattr(qwen3_moe, "group_rows", lambda *a, run=qwen3_moe.group_rows: unfused.append(1) or run(*a))
    shape = moe.MoeShape(hidden_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_hidden_layers=1,
                         vocab_size=512, intermediate_size=96)
    result = moe.run(replace(TINY_SIZES, threads=1), "float32", rounds=1, log=lambda *_: None, shape=shape,
                     peft=False, fused_ab=True)
    assert set(result["output_tok_s"]) == {"before_eight", "before_base", "after_eight", "after_base"}
    assert result["after_over_before_base"] > 0 and fused and unfused and moe_fused.ENABLED
