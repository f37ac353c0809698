"""The LoRA op API (lora/ops.py, lora/backends/): each implementation against the per-token references, over
adapter popularity patterns; the per-step plan; graph safety."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lora.batch import AdapterRows, LoRABatchInfo, plan_step
from lora_impls import add_embedding_lora, add_lora, make_batch_info
from lora_reference import (POPULARITY, OpLog, assign_slots, make_embedding_buffers, make_lora_case,
                            ref_add_embedding_lora, ref_add_lora, slot_ranks)

SHAPES = {"prefill": [1, 40, 7, 23, 2, 15], "decode": [1] * 16}
STACKS = {"single": (48,), "qkv": (32, 16, 16), "gate_up": (40, 40)}
# test id -> (implementation, phase, the plan's gemm_min_tokens: None keeps make_batch_info's)
PATHS = {
    "torch_segments": ("torch_segments", "prefill", None),
    "torch_masked": ("torch_masked", "graph", None),
    "cpu_sgmv": ("cpu_sgmv", "prefill", 10**6),         # the kernel takes every adapter
    "cpu_sgmv+gemm": ("cpu_sgmv", "decode", 8),         # adapters with 8+ tokens go to torch's GEMMs
    "cpu_bgmv": ("cpu_bgmv", "graph", None),
}
KERNEL_OPS = {"cpu_sgmv": "loraserve::sgmv_add", "cpu_bgmv": "loraserve::bgmv_add"}


def _info(token_slots, ranks, max_rank, path) -> LoRABatchInfo:
    _, phase, gemm_min_tokens = PATHS[path]
    info = make_batch_info(token_slots, ranks, max_rank, use_graph=phase == "graph",
                           phase=None if phase == "graph" else phase)
    if gemm_min_tokens is not None:
        info = dataclasses.replace(info, plan=plan_step(info.seg_lens_host, info.seg_slots_host,
                                                        info.slot_ranks_host, max_rank, gemm_min_tokens=gemm_min_tokens))
    return info


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    from lora.backends import cpu_sgmv
    assert cpu_sgmv.available(), "the CPU LoRA kernel did not build (needs a C compiler)"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pattern", POPULARITY)
def test_add_lora_matches_reference(pattern, shape, stack, path):
    case = make_lora_case(pattern, SHAPES[shape], STACKS[stack], seed=sum(map(ord, pattern + shape + stack)))
    info = _info(case.token_slots, case.ranks, case.max_rank, path)
    expected = ref_add_lora(case.y.clone(), case.x, case.a, case.b, case.offsets, case.token_slots)
    y = case.y.clone()
    with OpLog() as log:
        add_lora(y, case.x, case.a, case.b, case.offsets, info, impl=PATHS[path][0])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    impl = PATHS[path][0]
    if impl in KERNEL_OPS and (impl == "cpu_bgmv" or info.plan.kernel is not None):
        assert KERNEL_OPS[impl] in log.names, f"{path} did not run {KERNEL_OPS[impl]}"
    if path == "cpu_sgmv+gemm" and shape == "prefill":
        assert info.plan.gemm, "no adapter went to torch's GEMMs"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pattern", POPULARITY)
def test_add_embedding_lora_matches_reference(pattern, shape, path):
    gen = torch.Generator().manual_seed(7)
    vocab, hidden, max_rank, num_slots = 50, 24, 8, 6
    ranks = slot_ranks(pattern, num_slots, max_rank, gen)
    a, b = make_embedding_buffers(ranks, max_rank, vocab, hidden, torch.float32, gen)
    token_slots = assign_slots(pattern, SHAPES[shape], num_slots, gen)
    ids = torch.randint(0, vocab, (len(token_slots),), generator=gen)
    y0 = torch.randn(len(token_slots), hidden, generator=gen)
    expected = ref_add_embedding_lora(y0.clone(), ids, a, b, token_slots)
    y = y0.clone()
    add_embedding_lora(y, ids, a, b, _info(token_slots, ranks, max_rank, path), impl=PATHS[path][0])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_add_lora_bf16(path):
    case = make_lora_case("zipf", SHAPES["prefill"], STACKS["qkv"], dtype=torch.bfloat16, seed=3)
    info = _info(case.token_slots, case.ranks, case.max_rank, path)
    expected = ref_add_lora(case.y.float(), case.x, case.a, case.b, case.offsets, case.token_slots)
    y = case.y.clone()
    add_lora(y, case.x, case.a, case.b, case.offsets, info, impl=PATHS[path][0])
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("path", PATHS)
def test_no_tokens_is_a_no_op(path):
    case = make_lora_case("uniform", [0], STACKS["qkv"], seed=1)
    y = case.y.clone()
    add_lora(y, case.x, case.a, case.b, case.offsets, _info([], case.ranks, case.max_rank, path),
                 impl=PATHS[path][0])
    assert y.shape == (0, 64)


@pytest.mark.parametrize("impl", ["cpu_sgmv", "cpu_bgmv"])
def test_kernel_entries_refuse_operands_they_do_not_read(impl):
    """fp16: no kernel of that dtype. The cpu backend binds such layers to the torch ops at wrap time
    (tests/test_lora_backends.py); the entries themselves never fall back silently."""
    case = make_lora_case("zipf", SHAPES["decode"], STACKS["qkv"], dtype=torch.float16, seed=6)
    info = _info(case.token_slots, case.ranks, case.max_rank, "cpu_bgmv" if impl == "cpu_bgmv" else "cpu_sgmv")
    with pytest.raises(ValueError, match="the CPU LoRA kernel does not take these operands"):
        add_lora(case.y.clone(), case.x, case.a, case.b, case.offsets, info, impl=impl)


def test_masked_shrink_writes_zero_for_base_tokens():
    from lora.ops import shrink_masked
    case = make_lora_case("base_mixed", SHAPES["prefill"], STACKS["qkv"], seed=5)
    h = torch.full((case.x.shape[0], case.a.shape[1]), float("nan"))
    shrink_masked(h, case.x, case.a, torch.tensor(case.token_slots))
    base = torch.tensor(case.token_slots) < 0
    assert base.any() and (h[base] == 0).all()
    assert torch.isfinite(h).all() and (h[~base] != 0).any()


def test_the_plan_groups_tokens_by_adapter_once_per_step():
    info = make_batch_info([4, 4, -1, 1, 1, 1, 4, 4, 2], [8, 0, 8, 0, 8], 8, gemm_min_tokens=64)   # slots 1, 3 empty
    plan = info.plan
    assert [(g.slot, g.rank) for g in plan.groups] == [(4, 8), (2, 8)]
    assert plan.groups[0].rows.tolist() == [0, 1, 6, 7] and plan.groups[1].rows == slice(8, 9)   # a run: a slice
    assert plan.kernel.slot.tolist() == [4, 2] and plan.kernel.start.tolist() == [0, 4, 5]
    assert plan.kernel.rows.tolist() == [0, 1, 6, 7, 8] and plan.gemm == ()
    assert make_batch_info([-1, -1], [8], 8).plan.groups == () and not make_batch_info([-1], [8], 8).has_lora
    split = plan_step((70, 2, 3), (0, 1, 0), (16, 4), 16, gemm_min_tokens=64)
    [many] = split.gemm
    assert isinstance(many, AdapterRows) and (many.slot, many.rank) == (0, 16) and split.kernel.slot.tolist() == [1]
    assert many.rows.tolist() == list(range(70)) + [72, 73, 74]


def test_batch_info_phases():
    graph = LoRABatchInfo(token_slots=torch.tensor([0, -1]), seg_lens=torch.ones(2, dtype=torch.int64),
                          seg_slots=torch.tensor([0, -1]), seg_lens_host=(), seg_slots_host=(), slot_ranks_host=(),
                          max_rank=8, use_graph=True)   # what the graph runner builds: no host lists, no plan
    assert graph.phase == "graph" and graph.plan is None
    assert make_batch_info([0], [8], 8, phase="decode").phase == "decode"
    assert make_batch_info([0], [8], 8).phase == "prefill" and make_batch_info([0], [8], 8, use_graph=True).use_graph
    with pytest.raises(ValueError, match="phase"):
        make_batch_info([0], [8], 8, phase="chunked")


def _graph_only_info(token_slots: torch.Tensor, max_rank: int) -> LoRABatchInfo:
    # Empty host lists: the graph-safe implementations must not need them.
    return LoRABatchInfo(token_slots=token_slots, seg_lens=token_slots, seg_slots=token_slots,
                         seg_lens_host=(), seg_slots_host=(), slot_ranks_host=(), max_rank=max_rank,
                         use_graph=True)


@pytest.mark.parametrize("impl", ["torch_masked", "cpu_bgmv"])
def test_graph_implementations_run_on_fake_tensors(impl):
    case = make_lora_case("base_mixed", SHAPES["decode"], STACKS["qkv"], seed=11)
    emb_a, emb_b = make_embedding_buffers(case.ranks, case.max_rank, 30, 16, torch.float32,
                                          torch.Generator().manual_seed(0))
    mode = FakeTensorMode()
    fake = mode.from_tensor
    info = _graph_only_info(fake(torch.tensor(case.token_slots)), case.max_rank)
    y, emb_y = fake(case.y.clone()), fake(torch.zeros(len(case.token_slots), 16))
    ids = fake(torch.zeros(len(case.token_slots), dtype=torch.int64))
    with mode, OpLog() as log:
        add_lora(y, fake(case.x), fake(case.a), tuple(map(fake, case.b)), case.offsets, info, impl=impl)
        add_embedding_lora(emb_y, ids, fake(emb_a), fake(emb_b), info, impl=impl)
    assert y.shape == case.y.shape and emb_y.shape == (len(case.token_slots), 16)
    assert (KERNEL_OPS.get(impl) in log.names) if impl in KERNEL_OPS else not any("loraserve" in n for n in log.names)


@pytest.mark.parametrize("impl", ["torch_masked", "cpu_bgmv", None])   # None: the phase's torch maths, traced too
def test_graph_implementations_compile_without_graph_breaks(impl):
    case = make_lora_case("base_mixed", SHAPES["decode"], STACKS["gate_up"], num_slots=4, seed=13)
    info = _graph_only_info(torch.tensor(case.token_slots), case.max_rank)
    expected = ref_add_lora(case.y.clone(), case.x, case.a, case.b, case.offsets, case.token_slots)
    torch._dynamo.reset()
    compiled = torch.compile(add_lora, fullgraph=True, backend="aot_eager")
    y = case.y.clone()
    compiled(y, case.x, case.a, case.b, case.offsets, info, impl=impl)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_importing_the_ops_never_imports_the_npu_packages():
    code = ("import sys; import lora.ops, lora.layers; "
            "assert not {'torch_npu', 'sgl_kernel_npu'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
