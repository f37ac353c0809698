"""LoRA backends (lora/backends/): one object per runner chosen once by name; each layer's ops bound per
phase at wrap time; what each builds per step; fallbacks counted and logged once, never silent per call."""
from __future__ import annotations

import logging

import pytest
import torch

from ascend_emulator import register_emulator
from lora.backend_names import BACKENDS
from lora.backends import get_backend
from lora.backends.ascend import AscendBackend
from lora.backends.cpu_sgmv import CpuBackend
from lora.backends.torch_native import TorchNativeBackend
from lora_reference import OpLog, make_lora_case, ref_add_lora

TOKENS = [0, 0, 1, -1, 1, 0]
RANKS = [8, 16]


def test_one_backend_per_device_by_default_and_by_name():
    assert BACKENDS == ("torch_native", "cpu", "ascend")
    assert isinstance(get_backend(None, "cpu", torch.float32, 8), CpuBackend)
    assert isinstance(get_backend("torch_native", "cpu", torch.float32, 8), TorchNativeBackend)
    with pytest.raises(ValueError, match="unknown LoRA backend 'triton'; known backends: torch_native, cpu, ascend"):
        get_backend("triton", "cpu", torch.float32, 8)
    with pytest.raises(ValueError, match="lora_backend 'ascend' runs on npu only, not on cpu"):
        get_backend("ascend", "cpu", torch.bfloat16, 8)


def test_an_unknown_backend_is_refused_by_the_config():
    from workers import EngineConfig
    with pytest.raises(ValueError, match="lora_backend must be one of torch_native, cpu, ascend"):
        EngineConfig(model="m", lora_backend="punica")


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
@pytest.mark.parametrize("phase", ["prefill", "decode", "graph"])
def test_bound_ops_match_the_reference_in_every_phase(backend, phase):
    case = make_lora_case("base_mixed", [1] * 12 if phase != "prefill" else [5, 1, 9, 3], (32, 16, 16), seed=3)
    chosen = get_backend(backend, "cpu", torch.float32, case.max_rank)
    op = chosen.bind("0.qkv_proj", case.a, case.b, case.offsets)
    info = (chosen.graph_info(torch.tensor(case.token_slots)) if phase == "graph"
            else chosen.batch_info(case.token_slots, case.ranks, phase))
    y = case.y.clone()
    with OpLog() as log:
        op(y, case.x, info)
    torch.testing.assert_close(y, ref_add_lora(case.y.clone(), case.x, case.a, case.b, case.offsets, case.token_slots),
                               rtol=1e-5, atol=1e-5)
    kernel = {"prefill": None, "decode": None, "graph": "loraserve::bgmv_add"}[phase]   # eager: the prepared call
    assert (kernel in log.names) == (backend == "cpu" and kernel is not None)


def test_each_backend_builds_only_what_its_ops_read():
    torch_info = get_backend("torch_native", "cpu", torch.float32, 16).batch_info(TOKENS, RANKS, "decode")
    assert torch_info.plan is not None and torch_info.plan.kernel is None and torch_info.token_slots is None
    cpu_info = get_backend("cpu", "cpu", torch.float32, 16).batch_info(TOKENS, RANKS, "decode")
    assert cpu_info.plan.kernel.slot.tolist() == [0, 1] and cpu_info.token_slots is None
    ascend = AscendBackend("cpu", torch.bfloat16, 16, ops=torch.ops.npu)
    prefill, decode = ascend.batch_info(TOKENS, RANKS, "prefill"), ascend.batch_info(TOKENS, RANKS, "decode")
    assert prefill.seg_slots.tolist() == [0, 1, -1, 1, 0] and prefill.seg_lens.tolist() == [2, 1, 1, 1, 1]
    assert prefill.plan is None and decode.seg_lens is None and decode.token_slots.tolist() == TOKENS
    assert decode.has_lora and not ascend.batch_info([-1, -1], RANKS, "decode").has_lora
    graph = ascend.graph_info(torch.tensor(TOKENS))
    assert graph.use_graph and graph.plan is None and graph.seg_lens is None


def test_a_layer_the_kernels_do_not_take_falls_back_once_at_wrap_time(caplog):
    """fp16 on the CPU kernel (no fp16 code): decided when the layer is bound, counted per layer, logged once."""
    register_emulator()
    case = make_lora_case("zipf", [1] * 16, (32, 16, 16), dtype=torch.float16, seed=6)
    backend = get_backend("cpu", "cpu", torch.float16, case.max_rank)
    with caplog.at_level(logging.WARNING, logger="lora.backends.base"):
        ops = [backend.bind(f"{layer}.qkv_proj", case.a, case.b, case.offsets) for layer in range(3)]
    assert backend.fallbacks == {"the C kernel has no torch.float16 code": 3}
    assert len([r for r in caplog.records if "run the torch ops" in r.getMessage()]) == 1
    assert backend.stats() == {"lora_backend": "cpu", "lora_fallbacks": {"the C kernel has no torch.float16 code": 3}}
    y = case.y.clone()
    with OpLog() as log:
        ops[0](y, case.x, backend.batch_info(case.token_slots, case.ranks, "decode"))
    assert not any(name.startswith("loraserve::") for name in log.names)
    torch.testing.assert_close(y.float(), ref_add_lora(case.y.float(), case.x, case.a, case.b, case.offsets,
                                                       case.token_slots), rtol=2e-2, atol=3e-2)


def test_an_ascend_layer_with_a_rank_the_kernels_lack_falls_back_at_wrap_time():
    register_emulator()
    backend = AscendBackend("cpu", torch.bfloat16, 12, ops=torch.ops.npu)   # R = 12: no expand reduction for it
    case = make_lora_case("zipf", [1] * 8, (32, 16, 16), dtype=torch.bfloat16, max_rank=12, seed=2)
    backend.bind("0.qkv_proj", case.a, case.b, case.offsets)
    [(reason, count)] = backend.fallbacks.items()
    assert count == 1 and "rank 12" in reason and backend.needs_plan
