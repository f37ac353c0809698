"""What tests/test_ascend_contract.py and tests/test_ascend_probe.py share: the strict emulator of
sgl_kernel_npu's LoRA kernels registered as torch.ops.npu (tests/ascend_emulator.py), today's kernel
convention restored around every test, the LoRA cases' shapes, and running a case through an implementation."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import ascend_emulator as emulator
from ascend_emulator import CALLS, CONVENTION, register_emulator
from lora.backends import ascend_probe
from lora.batch import LoRABatchInfo
from lora_impls import add_lora, make_batch_info


@pytest.fixture(scope="module")
def npu_ops() -> Counter[str]:
    register_emulator()
    return CALLS


@pytest.fixture(autouse=True)
def today_s_convention():
    CONVENTION["now"] = emulator.TODAY
    ascend_probe._PROBED.clear()
    yield
    CONVENTION["now"] = emulator.TODAY
    ascend_probe._PROBED.clear()


STACKS = {"plain": (48,), "qkv": (32, 16, 16), "gate_up": (48, 48)}
SHAPES = {"prefill": [1, 40, 7, 23, 2, 15], "decode": [1] * 16}
PATTERNS = ("distinct", "zipf", "identical", "mixed_ranks", "base_mixed")
PHASES = {"prefill": "ascend_sgmv", "decode": "ascend_bgmv", "graph": "ascend_bgmv"}


def graph_info(token_slots: list[int], max_rank: int) -> LoRABatchInfo:
    """As the graph runner builds it: one segment per token, no host lists."""
    slots = torch.tensor(token_slots)
    return LoRABatchInfo(token_slots=slots, seg_lens=torch.ones_like(slots), seg_slots=slots, seg_lens_host=(),
                         seg_slots_host=(), slot_ranks_host=(), max_rank=max_rank, use_graph=True)


def info_for(case, phase: str) -> LoRABatchInfo:
    if phase == "graph":
        return graph_info(case.token_slots, case.max_rank)
    return make_batch_info(case.token_slots, case.ranks, case.max_rank, phase=phase)


def run(case, phase: str, impl: str | None = None, y: torch.Tensor | None = None) -> torch.Tensor:
    y = case.y.clone() if y is None else y
    add_lora(y, case.x, case.a, case.b, case.offsets, info_for(case, phase), impl=impl or PHASES[phase])
    return y


def native(case, phase: str = "prefill") -> torch.Tensor:
    return run(case, phase, "torch_segments" if phase == "prefill" else "torch_masked")


def assert_half_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=3e-2)


def kernel_calls(before: Counter) -> dict[str, int]:
    return {name: n - before[name] for name, n in CALLS.items() if n != before[name]}
