"""Torch-native LoRA ops against the per-token references, over adapter popularity patterns."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lora.backends import default_backend_name, get_lora_backend, register_lora_backend
from lora.backends.torch_native import TorchNativeBackend
from lora.batch import LoRABatchInfo, make_batch_info
from lora_reference import (POPULARITY, assign_slots, make_embedding_buffers, make_lora_case,
                            ref_add_embedding_lora, ref_add_lora, slot_ranks)

SHAPES = {"prefill": [1, 40, 7, 23, 2, 15], "decode": [1] * 16}
STACKS = {"single": (48,), "qkv": (32, 16, 16), "gate_up": (40, 40)}
PATHS = {"kernel": False, "kernel+torch": False, "control": False, "control-loop": False, "graph": True}


@pytest.fixture(autouse=True)
def path_mode(request, monkeypatch):
    """Control-flow paths: "kernel": the CPU kernel (lora/backends/cpu_sgmv.c) takes every adapter;
    "kernel+torch": adapters with 8+ tokens go to torch GEMMs, the rest to the kernel (the CPU's
    split, with a lower threshold so that these small cases mix both); "control": the torch ops
    (batched, padded); "control-loop": the per-adapter loop those replace."""
    from lora.backends import cpu_sgmv, torch_batched
    callspec = getattr(request.node, "callspec", None)
    path = callspec.params.get("path") if callspec is not None else None
    calls = []
    if path in ("kernel", "kernel+torch"):
        assert cpu_sgmv.available(), "the CPU LoRA kernel did not build (needs a C compiler)"
        original = cpu_sgmv._run
        monkeypatch.setattr(cpu_sgmv, "_run", lambda *args: calls.append(1) or original(*args))
        monkeypatch.setattr(cpu_sgmv, "TORCH_MIN_TOKENS", 10**6 if path == "kernel" else 8)
    elif path in ("control", "control-loop"):
        monkeypatch.setattr(cpu_sgmv, "available", lambda: False)
    if path == "control-loop":
        monkeypatch.setattr(torch_batched, "BATCHED_MAX_TOKENS_PER_ADAPTER", 0)
    torch_batched.padded_layout.cache_clear()     # layouts are cached per batch shape
    cpu_sgmv.plan_groups.cache_clear()
    yield calls
    torch_batched.padded_layout.cache_clear()
    cpu_sgmv.plan_groups.cache_clear()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pattern", POPULARITY)
def test_add_lora_matches_reference(pattern, shape, stack, path, path_mode):
    case = make_lora_case(pattern, SHAPES[shape], STACKS[stack], seed=sum(map(ord, pattern + shape + stack)))
    info = make_batch_info(case.token_slots, case.ranks, case.max_rank, use_graph=PATHS[path])
    expected = ref_add_lora(case.y.clone(), case.x, case.a, case.b, case.offsets, case.token_slots)
    y = case.y.clone()
    TorchNativeBackend().add_lora(y, case.x, case.a, case.b, case.offsets, info)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert (path != "kernel") or path_mode, "the kernel path did not run the kernel"


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
    info = make_batch_info(token_slots, ranks, max_rank, use_graph=PATHS[path])
    TorchNativeBackend().add_embedding_lora(y, ids, a, b, info)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_add_lora_bf16(path):
    case = make_lora_case("zipf", SHAPES["prefill"], STACKS["qkv"], dtype=torch.bfloat16, seed=3)
    info = make_batch_info(case.token_slots, case.ranks, case.max_rank, use_graph=PATHS[path])
    expected = ref_add_lora(case.y.float(), case.x, case.a, case.b, case.offsets, case.token_slots)
    y = case.y.clone()
    TorchNativeBackend().add_lora(y, case.x, case.a, case.b, case.offsets, info)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("path", PATHS)
def test_shrink_writes_zero_for_base_tokens(path):
    case = make_lora_case("base_mixed", SHAPES["prefill"], STACKS["qkv"], seed=5)
    info = make_batch_info(case.token_slots, case.ranks, case.max_rank, use_graph=PATHS[path])
    h = torch.full((case.x.shape[0], case.a.shape[1]), float("nan"))
    TorchNativeBackend().shrink(h, case.x, case.a, info)
    base = torch.tensor(case.token_slots) < 0
    assert base.any() and (h[base] == 0).all()
    assert torch.isfinite(h).all() and (h[~base] != 0).any()


def _graph_only_info(token_slots: torch.Tensor, max_rank: int) -> LoRABatchInfo:
    # Empty host lists: the graph-safe path must not need them.
    return LoRABatchInfo(token_slots=token_slots, seg_lens=token_slots, seg_slots=token_slots,
                         seg_lens_host=(), seg_slots_host=(), slot_ranks_host=(), max_rank=max_rank,
                         use_graph=True)


def test_graph_path_runs_on_fake_tensors():
    case = make_lora_case("base_mixed", SHAPES["decode"], STACKS["qkv"], seed=11)
    emb_a, emb_b = make_embedding_buffers(case.ranks, case.max_rank, 30, 16, torch.float32,
                                          torch.Generator().manual_seed(0))
    mode = FakeTensorMode()
    fake = mode.from_tensor
    info = _graph_only_info(fake(torch.tensor(case.token_slots)), case.max_rank)
    y, emb_y = fake(case.y.clone()), fake(torch.zeros(len(case.token_slots), 16))
    ids = fake(torch.zeros(len(case.token_slots), dtype=torch.int64))
    with mode:
        TorchNativeBackend().add_lora(y, fake(case.x), fake(case.a), tuple(map(fake, case.b)), case.offsets, info)
        TorchNativeBackend().add_embedding_lora(emb_y, ids, fake(emb_a), fake(emb_b), info)
    assert y.shape == case.y.shape and emb_y.shape == (len(case.token_slots), 16)


def test_graph_path_compiles_without_graph_breaks():
    case = make_lora_case("base_mixed", SHAPES["decode"], STACKS["gate_up"], num_slots=4, seed=13)
    info = _graph_only_info(torch.tensor(case.token_slots), case.max_rank)
    expected = ref_add_lora(case.y.clone(), case.x, case.a, case.b, case.offsets, case.token_slots)
    torch._dynamo.reset()
    compiled = torch.compile(TorchNativeBackend().add_lora, fullgraph=True, backend="aot_eager")
    y = case.y.clone()
    compiled(y, case.x, case.a, case.b, case.offsets, info)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_registry_resolves_builtins_and_rejects_unknown_names():
    assert get_lora_backend("torch_native") is TorchNativeBackend
    assert get_lora_backend("ascend").__name__ == "AscendBackend"
    with pytest.raises(ValueError, match="torch_native.*ascend|ascend.*torch_native"):
        get_lora_backend("triton")
    with pytest.raises(ValueError, match="already registered"):
        register_lora_backend("torch_native")(type("Impostor", (), {}))
    assert default_backend_name("npu") == "ascend"
    assert default_backend_name("cuda") == default_backend_name("cpu") == "torch_native"


def test_registry_imports_ascend_lazily_and_never_the_npu_packages():
    code = ("import sys; import lora.backends.registry as r; "
            "assert 'lora.backends.ascend' not in sys.modules; "
            "r.get_lora_backend('ascend'); "
            "assert 'lora.backends.ascend' in sys.modules; "
            "assert not {'torch_npu', 'sgl_kernel_npu'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
