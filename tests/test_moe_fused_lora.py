"""Expert LoRA inside the fused MoE block (workers/models/moe_fused.py's experts_lora, cpu_moe_fused.c with
lora/sgmv.h): bit for bit the path it replaces (gather, grouped GEMMs, each projection's LoRA by the CPU backend's
kernel over the rows' combined (slot, expert) indices, SiLU-and-mul, combine) at shapes that break the blocking, with
base tokens, empty and partial-rank expert slots, a shared gate/up A, one projection off, threads; bad operands
refused; and an engine whose decode steps run it."""
from __future__ import annotations

import pytest
import torch

from factories import PROMPTS, engine_with_adapters
from lora.backends.cpu_sgmv import CpuBackend
from moe_factories import make_expert_adapter, make_moe_model
from workers import SamplingParams, cpu_ops
from workers.models import cpu_moe, moe_experts, moe_fused

assert moe_fused.available(), "no C compiler: the kernels under test are not built"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
R = 16


def _buffers(M, E, hidden, inter, dtype, gen, shared_slot=None):
    """The slot pool's expert buffers (lora/slots.py): gate_up a [M*E, 2R, H], b 2 x [M*E, I, R]; down a [M*E, R, I],
    b [M*E, H, R]; expert slot m's rank ranks[m] (rows / columns past it zero, the pool's contract)."""
    ranks = torch.tensor([R, 5, 0, 12][:M] + [R] * max(0, M - 4), dtype=torch.int64)
    def zero_past_rank(t, dim):
        for m, k in enumerate(ranks.tolist()):
            t[m * E:(m + 1) * E].narrow(dim, k, R - k).zero_()
        return t
    a13 = torch.randn(M * E, 2 * R, hidden, generator=gen) / hidden ** 0.5
    for s in range(2):
        zero_past_rank(a13[:, s * R:(s + 1) * R], 1)
    b13 = [zero_past_rank(torch.randn(M * E, inter, R, generator=gen) / 4, 2).to(dtype) for _ in range(2)]
    a2 = zero_past_rank(torch.randn(M * E, R, inter, generator=gen) / inter ** 0.5, 1).to(dtype)
    b2 = [zero_past_rank(torch.randn(M * E, hidden, R, generator=gen) / 4, 2).to(dtype)]
    shared = torch.zeros(M * E, dtype=torch.int64)
    if shared_slot is not None:   # that slot's gate and up share A (PEFT's fused format)
        block = slice(shared_slot * E, (shared_slot + 1) * E)
        a13[block, R:] = a13[block, :R]
        shared[block] = 1
    return ((a13.to(dtype), b13, (0, inter, 2 * inter), shared), (a2, b2, (0, hidden), None)), ranks


def _unfused(x, w13, w2, rows, ops, token_slot, ranks, E, gate_up, down):
    """MoeExpertsLoRA's separate path: each projection's LoRA by the backend's eager op over combined indices."""
    backend = CpuBackend("cpu", x.dtype, R)
    slots = token_slot[rows.token]
    combined = torch.where(slots >= 0, slots * E + rows.expert, -1)
    info = backend.row_batch_info(combined, ranks.repeat_interleave(E), "decode")
    xs = x[rows.token]
    h = cpu_moe.grouped_gemm(xs, w13, rows.offsets)
    if gate_up and info.has_lora:
        backend.bind("gate_up", ops[0][0], ops[0][1], ops[0][2], a_shared=ops[0][3])(h, xs, info)
    act = cpu_ops.silu_and_mul(h)
    y = cpu_moe.grouped_gemm(act, w2, rows.offsets)
    if down and info.has_lora:
        backend.bind("down", ops[1][0], ops[1][1], ops[1][2])(y, act, info)
    return moe_fused.combine(y, rows.token, rows.weight, x.shape[0])


CASES = [   # (tokens, experts, top_k, hidden, inter, expert slots): vector tails, 64-output items, an empty expert
    (16, 128, 8, 1024, 384, 8), (3, 8, 2, 72, 40, 3), (5, 16, 2, 64, 24, 4), (2, 40, 3, 300, 1, 2),
    (9, 4, 4, 48, 20, 4),
]


@DTYPES
@pytest.mark.parametrize("projections,absent", [((True, True), False), ((True, False), False), ((False, True), False),
                                                ((True, False), True), ((False, True), True)],
                         ids=["both", "gate_up", "down", "gate_up_buffers_only", "down_buffers_only"])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,M", CASES)
def test_the_block_with_expert_lora_matches_the_separate_lora_calls(tokens, experts, top_k, hidden, inter, M, dtype,
                                                                     projections, absent, monkeypatch):
    monkeypatch.setattr(cpu_moe, "KERNEL_ROWS_PER_EXPERT", 10 ** 9)   # the reference on the same vector kernel
    gen = torch.Generator().manual_seed(hidden + M)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    ops, ranks = _buffers(M, experts, hidden, inter, dtype, gen, shared_slot=M - 1)
    rows = moe_experts.route_grouped(torch.randn(tokens, experts, generator=gen).to(dtype), top_k, True)
    token_slot = torch.randint(-1, M, (tokens,), generator=gen)   # -1: a base token
    # absent: the other projection has no buffers at all (an adapter set without it), else it is only off this step
    lora = moe_fused.ExpertLoRA(*(op if on or not absent else None for op, on in zip(ops, projections)), experts)
    got = moe_fused.experts_lora(x, w13, w2, rows.offsets, rows.token, rows.weight, lora, token_slot,
                                 torch.arange(M), ranks, *projections)   # LoRA slot m holds expert slot m
    expected = _unfused(x, w13, w2, rows, ops, token_slot, ranks, experts, *projections)
    assert torch.equal(got, expected)
    if (token_slot >= 0).any() and ranks[token_slot.clamp(min=0)].max() > 0:   # the LoRA changed something
        assert not torch.equal(got, moe_fused.experts(x, w13, w2, rows.offsets, rows.token, rows.weight))


def test_threads_and_bad_operands():
    gen = torch.Generator().manual_seed(3)
    tokens, E, H, I, M = 24, 32, 1024, 256, 4
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    w13, w2 = torch.randn(E, 2 * I, H).to(torch.bfloat16) / 32, torch.randn(E, H, I).to(torch.bfloat16) / 16
    ops, ranks = _buffers(M, E, H, I, torch.bfloat16, gen)
    rows = moe_experts.route_grouped(torch.randn(tokens, E, generator=gen).to(torch.bfloat16), 4, True)
    lora, token_slot = moe_fused.ExpertLoRA(*ops, E), torch.randint(-1, M, (tokens,), generator=gen)
    slot_map = torch.arange(M).flip(0)   # LoRA slot m holds expert slot M - 1 - m
    args = (x, w13, w2, rows.offsets, rows.token, rows.weight, lora)
    previous, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(moe_fused.experts_lora(*args, token_slot, slot_map, ranks))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(*results)
    for slots, to in ((torch.full((tokens,), M), slot_map), (token_slot, torch.full((M,), M))):
        with pytest.raises(ValueError, match="LoRA slot is past the slot map, or its expert slot past the expert"):
            moe_fused.experts_lora(*args, slots, to, ranks)
    with pytest.raises(ValueError, match="one per token"):
        moe_fused.experts_lora(*args, token_slot[1:], slot_map, ranks)
    with pytest.raises(ValueError, match="one rank per each of the 4 expert slots"):
        moe_fused.experts_lora(*args, token_slot, slot_map, ranks[:2])
    with pytest.raises(ValueError, match="expert LoRA buffers"):
        moe_fused.ExpertLoRA(*ops, E + 1)


def test_a_cpu_graph_replays_the_block_as_kernel_calls_reading_the_slots_at_each_replay():
    """Routing, then the block with its expert LoRA, captured as a CPU decode graph: two kernel calls, no torch op;
    replayed after new logits, token slots, a remapped slot (a load) and a changed rank, it gives what an eager call
    gives on those values."""
    from workers import cpu_graph

    gen = torch.Generator().manual_seed(5)
    tokens, E, H, I, M = 6, 8, 64, 24, 3
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / 8).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen) / 5).to(torch.bfloat16)
    ops, ranks = _buffers(M, E, H, I, torch.bfloat16, gen)
    lora = moe_fused.ExpertLoRA(*ops, E)
    logits = torch.randn(tokens, E, generator=gen).to(torch.bfloat16)
    valid, token_slots = torch.tensor([tokens - 1]), torch.tensor([0, -1, 1, 2, 0, 1])   # the last row: padding
    slot_map = torch.tensor([2, 0, -1, 1])   # LoRA slot -> expert slot (slot 2 holds an adapter without experts)

    def step():
        weight, token, _, offsets = moe_fused.route(logits, 2, True, valid)
        return moe_fused.experts_lora(x, w13, w2, offsets, token, weight, lora, token_slots, slot_map, ranks)

    graph = cpu_graph.CPUGraph()
    with torch.inference_mode(), cpu_graph.graph(graph):
        out = step()
    assert graph.num_torch_ops == 0 and graph.num_kernel_calls == 2
    logits.copy_(torch.randn(tokens, E, generator=gen))
    token_slots.copy_(torch.tensor([3, 3, 0, -1, 1, 2]))
    slot_map[3], ranks[0] = 2, 7
    graph.replay()
    expected = step()
    assert torch.equal(out, expected) and not out[-1].any()
    with_lora = out.clone()
    slot_map.fill_(-1)   # every adapter unloaded: the base block
    graph.replay()
    weight, token, _, offsets = moe_fused.route(logits, 2, True, valid)
    assert torch.equal(out, moe_fused.experts(x, w13, w2, offsets, token, weight)) and not torch.equal(out, with_lora)


# ---- an engine whose eager decode steps run it ---------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_fused_lora")
    path = make_moe_model(out / "model", moe_intermediate_size=40, num_experts=6)
    return path, {"experts": make_expert_adapter(path, out / "experts", r=4, alpha=8, seed=2)}


def _generate(path, adapters, names, monkeypatch, fused: bool):
    monkeypatch.setattr(moe_fused, "ENABLED", fused)
    calls = []   # per call of the block: whether it had LoRA operands
    run = moe_fused._experts_impl
    monkeypatch.setattr(moe_fused, "_experts_impl", lambda *a: calls.append(len(a) > 6 and a[6] is not None) or run(*a))
    engine = engine_with_adapters(path, adapters, max_lora_rank=8)
    try:
        out = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(names))],
                              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), adapters=names)
        assert any(calls) == fused   # decode steps ran the block with their expert LoRA inside
        return out
    finally:
        engine.close()


def test_an_engine_with_expert_lora_in_the_block_equals_the_engine_without(moe_files, monkeypatch):
    path, adapters = moe_files
    names = [None, "experts", "experts", None]
    fused = _generate(path, adapters, names, monkeypatch, True)
    unfused = _generate(path, adapters, names, monkeypatch, False)
    assert [o.token_ids for o in fused] == [o.token_ids for o in unfused]
    assert max(abs(a - b) for of, ou in zip(fused, unfused) for a, b in zip(of.logprobs, ou.logprobs)) < 1e-5
