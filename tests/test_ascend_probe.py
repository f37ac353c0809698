"""The Ascend backend at start-up (lora/backends/ascend_probe.py): the probe of the installed sgl_kernel_npu
kernels (which contract, or a refusal naming both), and the torch ops when the kernels are absent or the
chip is a 310P; against the strict emulator of tests/ascend_emulator.py."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

# npu_ops (registers the emulator) and today_s_convention (autouse) are fixtures: pytest finds them here
from ascend_cases import (PHASES, SHAPES, STACKS, assert_half_close, info_for, kernel_calls, native,  # noqa: F401
                          npu_ops, run, today_s_convention)
import ascend_emulator as emulator
from ascend_emulator import CONVENTION, HALF, LIBRARIES
from lora import ops
from lora.backends import ascend, ascend_probe, get_backend
from lora_reference import make_lora_case


# The start-up probe of the installed kernels: which contract, or a refusal naming both.

def test_the_pinned_tag_exists():
    assert ascend.SGL_KERNEL_NPU_VERSION == "2026.08.21" and ascend.SGL_KERNEL_NPU_COMMIT == "f425bdf1"
    assert emulator.TODAY == ascend.SGL_KERNEL_NPU_VERSION


def test_probe_finds_today_s_contract(npu_ops):
    for dtype in HALF:
        assert ascend_probe.probe("cpu", dtype) is ascend.TODAY
    assert ascend_probe.probe("cpu", torch.float32) is None   # nothing of the kernels is used: nothing to check


def test_probe_tells_pr676_apart_and_the_backend_adapts(npu_ops, caplog):
    """PR #676's host checks refuse today's int64 indices / fp32 rank buffer; the probe then finds the known
    answer under PR #676's conventions, and the backend calls the kernels that way, in every phase."""
    CONVENTION["now"] = emulator.PR676
    case = make_lora_case("mixed_ranks", SHAPES["prefill"], STACKS["qkv"], max_rank=16, dtype=torch.bfloat16, seed=3)
    with pytest.raises(RuntimeError, match="int32"):   # what code written for today's contract meets
        run(case, "prefill")
    with caplog.at_level("WARNING", logger="lora.backends.ascend_probe"):
        assert ascend_probe.probe("cpu", torch.bfloat16) is ascend.PR676
    assert "PR #676" in caplog.text
    assert ascend_probe.unavailable_reason("cpu", torch.bfloat16, ops=torch.ops.npu) is None   # as get_backend asks
    contract = ascend_probe.installed_contract("cpu", torch.bfloat16, ops=torch.ops.npu)   # (probed once: cached)
    backend = ascend.AscendBackend("cpu", torch.bfloat16, 16, ops=torch.ops.npu, contract=contract)  # then builds it
    assert backend.contract is ascend.PR676
    layer = backend.bind("0.qkv_proj", case.a, case.b, case.offsets)
    assert backend.fallbacks == {}
    for phase in PHASES:
        info = (backend.graph_info(torch.tensor(case.token_slots)) if phase == "graph"
                else backend.batch_info(case.token_slots, case.ranks, phase))
        if phase != "graph":
            assert info.token_slots.dtype == torch.int32
        before, y = Counter(npu_ops), case.y.clone()
        layer(y, case.x, info)
        assert kernel_calls(before), phase
        assert_half_close(y, native(case, phase))


def test_get_backend_builds_the_backend_on_the_probed_contract(npu_ops, fake_npu):
    from fake_device import FakeDevice
    CONVENTION["now"] = emulator.PR676
    with FakeDevice():   # the device's default backend, as a worker's model runner asks for it
        backend = get_backend(None, fake_npu, torch.bfloat16, 16)
    assert isinstance(backend, ascend.AscendBackend) and backend.contract is ascend.PR676


def test_pr676_s_rank_checks_send_rank_8_to_the_torch_ops(npu_ops):
    CONVENTION["now"] = emulator.PR676
    case = make_lora_case("uniform", SHAPES["decode"], STACKS["plain"], max_rank=8, dtype=torch.bfloat16, seed=2)
    contract = ascend_probe.installed_contract("cpu", torch.bfloat16, ops=torch.ops.npu)
    assert contract is ascend.PR676
    backend = ascend.AscendBackend("cpu", torch.bfloat16, 8, ops=torch.ops.npu, contract=contract)
    layer = backend.bind("0.o_proj", case.a, case.b, case.offsets)
    assert backend.contract is ascend.PR676 and list(backend.fallbacks.values()) == [1]
    before, y = Counter(npu_ops), case.y.clone()
    layer(y, case.x, backend.batch_info(case.token_slots, case.ranks, "decode"))
    assert kernel_calls(before) == {}
    assert_half_close(y, native(case, "decode"))


def test_probe_refuses_a_kernel_that_raises_naming_both_contracts(npu_ops):
    CONVENTION["now"] = emulator.RAISES
    with pytest.raises(RuntimeError) as failed:
        ascend_probe.probe("cpu", torch.bfloat16)
    message = str(failed.value)
    assert "neither contract" in message and "EZ9999" in message
    assert "sgl-kernel-npu 2026.08.21 (int64 indices, fp32 rank buffer)" in message
    assert "sgl-kernel-npu PR #676 (int32 indices, model-dtype rank buffer)" in message
    assert "install sgl-kernel-npu 2026.08.21 (commit f425bdf1)" in message and "torch_native" in message
    assert ascend_probe.unavailable_reason("cpu", torch.bfloat16) == message


def test_probe_catches_a_failure_at_the_device_synchronisation(npu_ops, monkeypatch):
    """Launches are asynchronous: a kernel's device-side error surfaces at the synchronisation, inside the probe."""
    def broken(device):
        raise RuntimeError("ACL stream synchronize failed, error code 507015")
    monkeypatch.setattr(ascend_probe, "_synchronize", broken)
    with pytest.raises(RuntimeError, match="neither contract.*sgmv RuntimeError: ACL stream synchronize failed"):
        ascend_probe.probe("cpu", torch.float16)


def test_probe_refuses_wrong_answers(npu_ops, monkeypatch):
    """A kernel that runs without an error but computes something else (e.g. misread indices)."""
    real = torch.ops.npu.bgmv_expand

    class Ops:
        sgmv_shrink, sgmv_expand, bgmv_shrink = torch.ops.npu.sgmv_shrink, torch.ops.npu.sgmv_expand, torch.ops.npu.bgmv_shrink

        class bgmv_expand:   # noqa: N801  the schema of the real op, a result off by one
            default = real.default

            def __new__(cls, x, w, i, y, off, size):
                real(x, w, i, y, off, size)
                return y.add_(1)
    with pytest.raises(RuntimeError, match=r"neither contract.*bgmv wrong result"):
        ascend_probe.probe("cpu", torch.bfloat16, ops=Ops)


def test_probe_fails_on_missing_or_changed_ops(npu_ops):
    with pytest.raises(RuntimeError, match=r"op sgmv_shrink is missing; install sgl-kernel-npu 2026\.08\.21"):
        ascend_probe.probe("cpu", torch.bfloat16, ops=torch.ops.loraserve)
    if not hasattr(torch.ops.loraserve_drift, "sgmv_shrink"):
        lib = torch.library.Library("loraserve_drift", "DEF")
        lib.define("sgmv_shrink(Tensor x, Tensor weight, Tensor lora_indices, Tensor seq_len, Tensor lora_ranks, "
                   "Tensor y, float scale) -> ()")
        LIBRARIES.append(lib)
    with pytest.raises(RuntimeError, match="op sgmv_shrink takes .*expected"):
        ascend_probe.probe("cpu", torch.bfloat16, ops=torch.ops.loraserve_drift)


def test_y_row_stride_is_checked_where_the_expand_offset_is_computed(npu_ops):
    case = make_lora_case("uniform", SHAPES["decode"], (32,), max_rank=16, in_dim=64, dtype=torch.bfloat16, seed=1)
    wide = torch.zeros(case.y.shape[0], 40, dtype=case.y.dtype)   # 40 % 16 != 0
    assert not ascend.eligible(wide, case.x, case.a, case.b, case.offsets)
    before = Counter(npu_ops)
    with pytest.raises(AssertionError, match="row stride 40"):
        ascend._add_lora(wide, case.x, case.a, case.b, case.offsets, info_for(case, "decode"), True, torch.ops.npu)
    assert "bgmv_expand" not in kernel_calls(before)


# Kernels absent, or a 310P: one message, then torch_native, unless ascend was asked for by name.

@pytest.fixture
def fake_npu():
    from fake_device import DEVICE   # registers a fake torch.npu (device name Ascend910B1)
    return DEVICE


def test_kernels_absent_fall_back_to_torch_native_with_one_message(fake_npu, monkeypatch, caplog):
    from lora.backends.torch_native import TorchNativeBackend
    monkeypatch.setattr(torch, "ops", _OpsWithout(torch.ops))          # no torch.ops.npu.sgmv_shrink
    monkeypatch.setitem(__import__("sys").modules, "sgl_kernel_npu", None)   # and the package is absent
    reason = ascend_probe.unavailable_reason(fake_npu, torch.bfloat16)
    assert reason.startswith("sgl_kernel_npu is not importable (ModuleNotFoundError") and "torch_native" in reason
    with caplog.at_level("WARNING", logger="lora.backends"):
        backend = get_backend(None, fake_npu, torch.bfloat16, 16)
    assert isinstance(backend, TorchNativeBackend)
    assert [r.getMessage() for r in caplog.records if r.name == "lora.backends"] == [
        f"LoRA backend ascend: {reason}; running torch_native (same results, slower)"]
    with pytest.raises(RuntimeError, match="lora_backend 'ascend': sgl_kernel_npu is not importable"):
        get_backend("ascend", fake_npu, torch.bfloat16, 16)   # asked for by name: a start-up error


def test_310p_takes_the_torch_ops(fake_npu, monkeypatch, caplog):
    """No sgl-kernel-npu build for 310P: the ascend backend is never chosen there, said once."""
    from lora.backends.torch_native import TorchNativeBackend
    assert ascend.kernel_dtypes("Ascend310P3") == () and ascend.kernel_dtypes("Ascend910B4") == HALF
    monkeypatch.setattr(ascend, "_device_name", lambda index: "Ascend310P3")
    reason = ascend_probe.unavailable_reason(fake_npu, torch.float16)
    assert "Ascend310P3" in reason and "no build for 310P" in reason
    assert ascend_probe.probe(fake_npu, torch.float16) is None   # nothing of the kernels is touched
    with caplog.at_level("WARNING", logger="lora.backends"):
        assert isinstance(get_backend(None, fake_npu, torch.float16, 16), TorchNativeBackend)
    assert sum("310P" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="no build for 310P"):
        get_backend("ascend", fake_npu, torch.float16, 16)
    case = make_lora_case("zipf", SHAPES["decode"], STACKS["plain"], dtype=torch.float16, seed=3)
    assert not ascend.eligible(case.y, case.x, case.a, case.b, case.offsets, ascend.kernel_dtypes("Ascend310P3"))


@pytest.mark.parametrize("chip,devices,checkpoint,want", [
    ("Ascend310P3", 1, "bfloat16", "float16"), ("Ascend310P3", 1, None, "float16"),
    ("Ascend310P3", 1, "float32", "float32"), ("Ascend910B1", 1, "bfloat16", "bfloat16"),
    ("Ascend910B1", 1, "float16", "float16"), ("Ascend310P3", 0, "bfloat16", "bfloat16"),   # no device: unknown
])
def test_310p_defaults_to_fp16(fake_npu, monkeypatch, chip, devices, checkpoint, want):
    from workers.device import PLATFORMS
    monkeypatch.setattr(torch.npu, "get_device_name", lambda index=0: chip)
    monkeypatch.setattr(torch.npu, "device_count", lambda: devices)
    assert PLATFORMS["npu"].default_dtype(checkpoint) == want


class _OpsWithout:
    """torch.ops whose `npu` namespace lacks the kernels (as before sgl_kernel_npu is imported)."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, "loraserve_absent" if name == "npu" else name)
