"""Expert LoRA on Ascend: the same sgmv / bgmv kernels as every other layer, one combined (slot, expert) index per
(token, choice) row (as vllm-ascend does), checked against the strict emulator of sgl_kernel_npu's kernels
(tests/ascend_emulator.py) and the torch ops, in every phase and under both kernel contracts."""
from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import ascend_emulator as emulator
from ascend_emulator import CALLS, CONVENTION, register_emulator
from lora.backends import ascend, ascend_probe
from lora.backends.torch_native import TorchNativeBackend
from lora.expert_layers import MoeExpertsLoRA, wrap_experts
from lora.slots import SlotPool
from moe_factories import expert_slot_pool, moe_config
from workers.forward_batch import ForwardBatch
from workers.models.qwen3_moe import SparseMoeBlock
from workers.parallel import TPGroup

E, H, I, R = 8, 64, 32, 16     # every copy a whole number of 32-byte blocks, R one the expand reduces
DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def kernels():
    register_emulator()
    ascend_probe._PROBED.clear()
    yield
    CONVENTION["now"] = emulator.TODAY
    ascend_probe._PROBED.clear()


def make_pool(seed: int = 0) -> SlotPool:
    # adapters of lower rank than the slots: zero rows past theirs
    return expert_slot_pool((E, H, I, R), (16, 8, 4), dtype=DTYPE, scale=0.2, seed=seed)


def wrapped_block(block, pool, backend):
    model = SimpleNamespace(layers=[SimpleNamespace(mlp=copy.deepcopy(block))])
    assert wrap_experts(model, backend, pool) == 1
    assert isinstance(model.layers[0].mlp.experts, MoeExpertsLoRA)
    return model.layers[0].mlp


def run(block, backend, token_slots: list[int], phase: str, x: torch.Tensor) -> torch.Tensor:
    pool_ranks = [16, 8, 4]
    if phase == "graph":
        dtype = backend.contract.index_dtype if hasattr(backend, "contract") else torch.int64
        info = backend.graph_info(torch.tensor(token_slots, dtype=dtype))
    else:
        info = backend.batch_info(token_slots, pool_ranks, phase)
    T = x.shape[0]
    batch = ForwardBatch(input_ids=torch.zeros(T, dtype=torch.int64), positions=torch.zeros(T, dtype=torch.int64),
                         slot_mapping=torch.zeros(T, dtype=torch.int64), logits_indices=torch.zeros(1, dtype=torch.int64),
                         lora=info, graph_safe=phase == "graph")
    return block(x, batch)


@pytest.mark.parametrize("contract", [emulator.TODAY, emulator.PR676])
@pytest.mark.parametrize("phase,token_slots", [
    ("prefill", [0] * 5 + [-1] * 3 + [2] * 6 + [1] * 4),   # prompts of three adapters and the base
    ("decode", [2, -1, 0, 1, 1, 0]),
    ("graph", [1, 0, -1, 2, 2, 0, -1, 1]),
])
def test_expert_lora_through_the_kernels_matches_the_torch_ops(contract, phase, token_slots):
    CONVENTION["now"] = contract
    torch.manual_seed(0)
    cfg = moe_config(384, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2)
    block = SparseMoeBlock(cfg, TPGroup()).to(DTYPE)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.2)
    pool = make_pool()
    expected = ascend.PR676 if contract == emulator.PR676 else ascend.TODAY
    probed = ascend_probe.installed_contract("cpu", DTYPE, ops=torch.ops.npu)   # the start-up probe
    assert probed is expected
    npu = ascend.AscendBackend("cpu", DTYPE, R, ops=torch.ops.npu, contract=probed)
    kernel_block, torch_block = wrapped_block(block, pool, npu), wrapped_block(block, pool, TorchNativeBackend("cpu", DTYPE, R))
    assert not npu.fallbacks, npu.fallbacks                 # the expert layers take the kernels
    x = torch.randn(len(token_slots), H, dtype=DTYPE)
    before = Counter(CALLS)
    got = run(kernel_block, npu, token_slots, phase, x)
    calls = {name: n - before[name] for name, n in CALLS.items() if n != before[name]}
    kind = "sgmv" if phase == "prefill" else "bgmv"
    assert calls == {f"{kind}_shrink": 2, f"{kind}_expand": 3}  # gate_up: 1 shrink + 2 slices; down: 1 + 1
    want = run(torch_block, TorchNativeBackend("cpu", DTYPE, R), token_slots, phase, x)
    base = block(x, ForwardBatch(input_ids=None, positions=None, slot_mapping=None, logits_indices=None))
    scale = want.float().abs().max().item()   # bf16: the kernels round h and y once each, the torch ops per GEMM
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2 * scale)
    assert (want - base).abs().max() > 0.1, "the adapters must change the output"
    rows_with_base_only = [t for t, s in enumerate(token_slots) if s < 0]
    torch.testing.assert_close(got[rows_with_base_only], base[rows_with_base_only], rtol=0, atol=0)
