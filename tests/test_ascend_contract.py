"""The Ascend implementations (lora/backends/ascend.py) against a strict CPU emulator of
sgl_kernel_npu's LoRA kernels (tests/ascend_emulator.py: what it checks and how it reads memory)."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

import ascend_emulator as emulator
from ascend_emulator import CALLS, CONVENTION, HALF, LIBRARIES, register_emulator
from lora import ops
from lora.backends import ascend
from lora.batch import LoRABatchInfo, make_batch_info
from lora_reference import make_embedding_buffers, make_lora_case
from workers.parallel import ParallelLMHead, TPGroup


@pytest.fixture(scope="module")
def npu_ops() -> Counter[str]:
    register_emulator()
    return CALLS


@pytest.fixture(autouse=True)
def today_s_convention():
    CONVENTION["now"] = emulator.TODAY
    ascend._PROBED.clear()
    yield
    CONVENTION["now"] = emulator.TODAY
    ascend._PROBED.clear()


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
    ops.add_lora(y, case.x, case.a, case.b, case.offsets, info_for(case, phase), impl=impl or PHASES[phase])
    return y


def native(case, phase: str = "prefill") -> torch.Tensor:
    return run(case, phase, "torch_segments" if phase == "prefill" else "torch_masked")


def assert_half_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=3e-2)


def kernel_calls(before: Counter) -> dict[str, int]:
    return {name: n - before[name] for name, n in CALLS.items() if n != before[name]}


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_torch_native(npu_ops, pattern, stack, shape, phase):
    case = make_lora_case(pattern, SHAPES[shape], STACKS[stack], dtype=torch.bfloat16, seed=len(pattern))
    before = Counter(npu_ops)
    y = run(case, phase)
    kind = "sgmv" if phase == "prefill" else "bgmv"
    assert kernel_calls(before) == {f"{kind}_shrink": 1, f"{kind}_expand": len(STACKS[stack])}
    assert_half_close(y, native(case, phase))


def test_fp16_and_graph_style_padded_rows(npu_ops):
    """A decode bucket: real rows, then padding rows with slot -1 that must stay untouched."""
    case = make_lora_case("uniform", [1] * 12, STACKS["qkv"], dtype=torch.float16, seed=2)
    case = dataclasses.replace(case, token_slots=case.token_slots[:9] + [-1, -1, -1])
    y = run(case, "graph")
    assert torch.equal(y[9:], case.y[9:])
    assert_half_close(y, native(case))


@pytest.mark.parametrize("phase", PHASES)
def test_non_contiguous_y_goes_through_a_copy(npu_ops, phase):
    case = make_lora_case("zipf", SHAPES["decode"], STACKS["qkv"], dtype=torch.bfloat16, seed=5)
    wide = torch.zeros(case.y.shape[0], case.y.shape[1] + 16, dtype=case.y.dtype)
    wide[:, 8:8 + case.y.shape[1]] = case.y
    y = run(case, phase, y=wide[:, 8:8 + case.y.shape[1]])
    assert not y.is_contiguous()
    assert_half_close(y, native(case, phase))
    assert (wide[:, :8] == 0).all() and (wide[:, -8:] == 0).all()


@pytest.mark.parametrize("phase", PHASES)
def test_no_tokens_reach_no_kernel(npu_ops, phase):
    case = make_lora_case("uniform", [0], STACKS["plain"], dtype=torch.bfloat16, seed=1)
    before = Counter(npu_ops)
    assert run(case, phase).shape == (0, 48) and kernel_calls(before) == {}
    with pytest.raises(RuntimeError, match="num_tokens_per_core"):   # what a T = 0 call would meet
        torch.ops.npu.bgmv_shrink(case.x, case.a, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 8), 1.0)


@pytest.mark.parametrize("why,stack,in_dim,dtype", [
    ("slice_size 40 % 16", (40, 40), 64, torch.bfloat16),
    ("in 72 % 16", (48,), 72, torch.bfloat16),
    ("in <= stack * R", (32, 16, 16), 16, torch.bfloat16),
    ("fp32: the host check raises", (48,), 64, torch.float32),
])
@pytest.mark.parametrize("phase", PHASES)
def test_operands_the_kernels_cannot_take_go_to_the_torch_ops(npu_ops, phase, why, stack, in_dim, dtype):
    case = make_lora_case("zipf", SHAPES["prefill"], stack, in_dim=in_dim, dtype=dtype, seed=4)
    before = Counter(npu_ops)
    y = run(case, phase)
    assert kernel_calls(before) == {}, why
    torch.testing.assert_close(y, native(case, phase), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_rank", range(1, 65))
def test_every_max_rank_matches_torch_native(npu_ops, max_rank):
    """Kernels for R in {8, 16, 32, 64} (adapters of lower ranks zero-padded), the torch ops otherwise."""
    case = make_lora_case("mixed_ranks", [3, 9, 1, 4], (64,), max_rank=max_rank, in_dim=80, dtype=torch.bfloat16,
                          num_slots=4, seed=max_rank)
    before = Counter(npu_ops)
    y = run(case, "prefill")
    assert bool(kernel_calls(before)) == (max_rank in ascend.KERNEL_RANKS)
    assert_half_close(y, native(case))


def test_lm_head_shard_padded_to_16_rows_takes_the_kernels(npu_ops):
    vocab, hidden, tp = 1001, 64, 2
    shard = ParallelLMHead(vocab, hidden, TPGroup(1, tp)).shard_size
    assert shard % 16 == 0 and shard * tp >= vocab and -(-vocab // tp) % 16 != 0   # 501 rows unpadded
    for rows, kernels in ((shard, True), (-(-vocab // tp), False)):
        case = make_lora_case("zipf", [1] * 8, (rows,), num_slots=3, in_dim=hidden, dtype=torch.bfloat16, seed=1)
        before = Counter(npu_ops)
        y = run(case, "decode")
        assert bool(kernel_calls(before)) == kernels
        assert_half_close(y, native(case, "decode"))


@pytest.mark.parametrize("impl", ["ascend_sgmv", "ascend_bgmv"])
def test_embedding_is_a_gather_in_torch(npu_ops, impl):
    gen = torch.Generator().manual_seed(0)
    a, b = make_embedding_buffers([8, 3, 8, 5], 8, 30, 16, torch.bfloat16, gen)
    token_slots = [2, 2, -1, 0, 3, 3, 3]
    ids = torch.randint(0, 30, (len(token_slots),), generator=gen)
    info = make_batch_info(token_slots, [8, 3, 8, 5], 8, use_graph=impl == "ascend_bgmv")
    y, expected = torch.zeros(len(token_slots), 16, dtype=torch.bfloat16), torch.zeros(len(token_slots), 16,
                                                                                        dtype=torch.bfloat16)
    before = Counter(npu_ops)
    ops.add_embedding_lora(y, ids, a, b, info, impl=impl)
    ops.add_embedding_lora(expected, ids, a, b, info, impl="torch_segments" if impl == "ascend_sgmv" else "torch_masked")
    assert kernel_calls(before) == {}
    torch.testing.assert_close(y, expected)


# The emulator must have teeth: each known way of calling the kernels wrongly fails.

def test_emulator_semantics(npu_ops):
    x, w = torch.ones(4, 32, dtype=torch.bfloat16), torch.ones(2, 8, 32, dtype=torch.bfloat16)
    y = torch.full((4, 8), -1.0)
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    torch.ops.npu.sgmv_shrink(x, w, i64([1, -1]), i64([1, 2]), y, 0.5)   # token 3 is past the last segment
    assert y[0].tolist() == [16.0] * 8 and (y[1:] == -1).all()
    with pytest.raises(AssertionError, match="int64"):
        torch.ops.npu.sgmv_shrink(x, w, i64([0]).int(), i64([4]).int(), y, 1.0)
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        torch.ops.npu.bgmv_shrink(x.float(), w.float(), i64([0] * 4), y, 1.0)
    with pytest.raises(AssertionError, match="R = 12"):
        torch.ops.npu.bgmv_expand(torch.zeros(4, 12), torch.zeros(2, 16, 12, dtype=torch.bfloat16), i64([0] * 4),
                                  torch.zeros(4, 16, dtype=torch.bfloat16), 0, 16)
    with pytest.raises(AssertionError, match="32-byte"):
        torch.ops.npu.bgmv_expand(torch.zeros(4, 8), torch.zeros(2, 24, 8, dtype=torch.bfloat16), i64([0] * 4),
                                  torch.zeros(4, 24, dtype=torch.bfloat16), 0, 24)


def _expand_each_slice(y, h, b, offsets, index, R, contiguous_h=True) -> None:
    for s, b_s in enumerate(b):
        h_s = h[:, s * R:(s + 1) * R]
        torch.ops.npu.sgmv_expand(h_s.contiguous() if contiguous_h else h_s, b_s, *index, y, offsets[s],
                                  offsets[s + 1] - offsets[s])


def int32_indices(y, x, a, b, offsets, info):
    h = torch.zeros(x.shape[0], a.shape[1])
    torch.ops.npu.sgmv_shrink(x, a, info.seg_slots.int(), info.seg_lens.int(), h, 1.0)


def model_dtype_buffer(y, x, a, b, offsets, info):
    h = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype)
    torch.ops.npu.sgmv_shrink(x, a, info.seg_slots, info.seg_lens, h, 1.0)
    _expand_each_slice(y, h, b, offsets, (info.seg_slots, info.seg_lens), info.max_rank)


def strided_activation(y, x, a, b, offsets, info):
    h = torch.zeros(x.shape[0], a.shape[1])
    torch.ops.npu.sgmv_shrink(x, a, info.seg_slots, info.seg_lens, h, 1.0)
    _expand_each_slice(y, h, b, offsets, (info.seg_slots, info.seg_lens), info.max_rank, contiguous_h=False)


def packed_weight_views(y, x, a, b, offsets, info):
    """Keeps B as one [L, out, stack*R] buffer and passes each slice as a column view."""
    R = info.max_rank
    packed = torch.zeros(b[0].shape[0], offsets[-1], len(b) * R, dtype=b[0].dtype)
    for s, b_s in enumerate(b):
        packed[:, offsets[s]:offsets[s + 1], s * R:(s + 1) * R] = b_s
    views = [packed[:, offsets[s]:offsets[s + 1], s * R:(s + 1) * R] for s in range(len(b))]
    h = torch.zeros(x.shape[0], a.shape[1])
    torch.ops.npu.sgmv_shrink(x, a, info.seg_slots, info.seg_lens, h, 1.0)
    _expand_each_slice(y, h, views, offsets, (info.seg_slots, info.seg_lens), R)


@pytest.mark.parametrize("broken", [int32_indices, model_dtype_buffer])
def test_contract_rejects_wrong_dtypes(npu_ops, broken):
    case = make_lora_case("uniform", SHAPES["prefill"], STACKS["qkv"], dtype=torch.bfloat16, seed=8)
    info = make_batch_info(case.token_slots, case.ranks, case.max_rank)
    with pytest.raises(AssertionError, match="int64|fp32"):
        broken(case.y.clone(), case.x, case.a, case.b, case.offsets, info)


@pytest.mark.parametrize("broken", [strided_activation, packed_weight_views])
def test_contract_catches_strided_views(npu_ops, broken):
    case = make_lora_case("uniform", SHAPES["prefill"], STACKS["qkv"], dtype=torch.bfloat16, seed=9)
    expected = native(case)
    assert_half_close(run(case, "prefill"), expected)
    wrong = case.y.clone()
    broken(wrong, case.x, case.a, case.b, case.offsets, make_batch_info(case.token_slots, case.ranks, case.max_rank))
    assert not torch.allclose(wrong.float(), expected.float(), rtol=2e-2, atol=3e-2)


def test_contract_catches_a_strided_y(npu_ops):
    case = make_lora_case("uniform", SHAPES["decode"], STACKS["qkv"], dtype=torch.bfloat16, seed=9)
    info = make_batch_info(case.token_slots, case.ranks, case.max_rank)
    wide = torch.zeros(case.y.shape[0], case.y.shape[1] + 16, dtype=case.y.dtype)
    view = wide[:, :case.y.shape[1]]
    view.copy_(case.y)
    h = torch.zeros(case.x.shape[0], case.a.shape[1])
    torch.ops.npu.sgmv_shrink(case.x, case.a, info.seg_slots, info.seg_lens, h, 1.0)
    _expand_each_slice(view, h, case.b, case.offsets, (info.seg_slots, info.seg_lens), case.max_rank)
    assert not torch.allclose(view.float(), native(case).float(), rtol=2e-2, atol=3e-2)


def test_backend_refuses_a_strided_weight(npu_ops):
    case = make_lora_case("uniform", SHAPES["decode"], STACKS["gate_up"], dtype=torch.bfloat16, seed=10)
    R = case.max_rank
    views = tuple(torch.zeros(b_s.shape[0], b_s.shape[1], 2 * R, dtype=b_s.dtype)[:, :, :R] for b_s in case.b)
    with pytest.raises(AssertionError, match="densely"):
        ops.add_lora(case.y.clone(), case.x, case.a, views, case.offsets, info_for(case, "decode"), impl="ascend_bgmv")


# The start-up probe of the installed kernels: which contract, or a refusal naming both.

def test_the_pinned_tag_exists():
    assert ascend.SGL_KERNEL_NPU_VERSION == "2026.08.21" and ascend.SGL_KERNEL_NPU_COMMIT == "f425bdf1"
    assert emulator.TODAY == ascend.SGL_KERNEL_NPU_VERSION


def test_probe_finds_today_s_contract(npu_ops):
    for dtype in HALF:
        assert ascend.probe("cpu", dtype) is ascend.TODAY
    assert ascend.probe("cpu", torch.float32) is None   # nothing of the kernels is used: nothing to check


def test_probe_tells_pr676_apart_and_the_backend_adapts(npu_ops, caplog):
    """PR #676's host checks refuse today's int64 indices / fp32 rank buffer; the probe then finds the known
    answer under PR #676's conventions, and the backend calls the kernels that way, in every phase."""
    CONVENTION["now"] = emulator.PR676
    case = make_lora_case("mixed_ranks", SHAPES["prefill"], STACKS["qkv"], max_rank=16, dtype=torch.bfloat16, seed=3)
    with pytest.raises(RuntimeError, match="int32"):   # what code written for today's contract meets
        run(case, "prefill")
    with caplog.at_level("WARNING", logger="lora.backends.ascend"):
        assert ascend.probe("cpu", torch.bfloat16) is ascend.PR676
    assert "PR #676" in caplog.text
    assert ascend.unavailable_reason("cpu", torch.bfloat16, ops=torch.ops.npu) is None   # as get_backend asks
    backend = ascend.AscendBackend("cpu", torch.bfloat16, 16, ops=torch.ops.npu)          # then builds it
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


def test_pr676_s_rank_checks_send_rank_8_to_the_torch_ops(npu_ops):
    CONVENTION["now"] = emulator.PR676
    case = make_lora_case("uniform", SHAPES["decode"], STACKS["plain"], max_rank=8, dtype=torch.bfloat16, seed=2)
    assert ascend.installed_contract("cpu", torch.bfloat16, ops=torch.ops.npu) is ascend.PR676
    backend = ascend.AscendBackend("cpu", torch.bfloat16, 8, ops=torch.ops.npu)
    layer = backend.bind("0.o_proj", case.a, case.b, case.offsets)
    assert backend.contract is ascend.PR676 and list(backend.fallbacks.values()) == [1]
    before, y = Counter(npu_ops), case.y.clone()
    layer(y, case.x, backend.batch_info(case.token_slots, case.ranks, "decode"))
    assert kernel_calls(before) == {}
    assert_half_close(y, native(case, "decode"))


def test_probe_refuses_a_kernel_that_raises_naming_both_contracts(npu_ops):
    CONVENTION["now"] = emulator.RAISES
    with pytest.raises(RuntimeError) as failed:
        ascend.probe("cpu", torch.bfloat16)
    message = str(failed.value)
    assert "neither contract" in message and "EZ9999" in message
    assert "sgl-kernel-npu 2026.08.21 (int64 indices, fp32 rank buffer)" in message
    assert "sgl-kernel-npu PR #676 (int32 indices, model-dtype rank buffer)" in message
    assert "install sgl-kernel-npu 2026.08.21 (commit f425bdf1)" in message and "torch_native" in message
    assert ascend.unavailable_reason("cpu", torch.bfloat16) == message


def test_probe_catches_a_failure_at_the_device_synchronisation(npu_ops, monkeypatch):
    """Launches are asynchronous: a kernel's device-side error surfaces at the synchronisation, inside the probe."""
    def broken(device):
        raise RuntimeError("ACL stream synchronize failed, error code 507015")
    monkeypatch.setattr(ascend, "_synchronize", broken)
    with pytest.raises(RuntimeError, match="neither contract.*sgmv RuntimeError: ACL stream synchronize failed"):
        ascend.probe("cpu", torch.float16)


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
        ascend.probe("cpu", torch.bfloat16, ops=Ops)


def test_probe_fails_on_missing_or_changed_ops(npu_ops):
    with pytest.raises(RuntimeError, match=r"op sgmv_shrink is missing; install sgl-kernel-npu 2026\.08\.21"):
        ascend.probe("cpu", torch.bfloat16, ops=torch.ops.loraserve)
    if not hasattr(torch.ops.loraserve_drift, "sgmv_shrink"):
        lib = torch.library.Library("loraserve_drift", "DEF")
        lib.define("sgmv_shrink(Tensor x, Tensor weight, Tensor lora_indices, Tensor seq_len, Tensor lora_ranks, "
                   "Tensor y, float scale) -> ()")
        LIBRARIES.append(lib)
    with pytest.raises(RuntimeError, match="op sgmv_shrink takes .*expected"):
        ascend.probe("cpu", torch.bfloat16, ops=torch.ops.loraserve_drift)


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
    from lora.backends import get_backend
    from lora.backends.torch_native import TorchNativeBackend
    monkeypatch.setattr(torch, "ops", _OpsWithout(torch.ops))          # no torch.ops.npu.sgmv_shrink
    monkeypatch.setitem(__import__("sys").modules, "sgl_kernel_npu", None)   # and the package is absent
    reason = ascend.unavailable_reason(fake_npu, torch.bfloat16)
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
    from lora.backends import get_backend
    from lora.backends.torch_native import TorchNativeBackend
    assert ascend.kernel_dtypes("Ascend310P3") == () and ascend.kernel_dtypes("Ascend910B4") == HALF
    monkeypatch.setattr(ascend, "_device_name", lambda index: "Ascend310P3")
    reason = ascend.unavailable_reason(fake_npu, torch.float16)
    assert "Ascend310P3" in reason and "no build for 310P" in reason
    assert ascend.probe(fake_npu, torch.float16) is None   # nothing of the kernels is touched
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
