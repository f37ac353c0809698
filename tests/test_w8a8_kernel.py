"""The fused CPU W8A8 linear (workers/quant/cpu_w8a8.c: quantization, AMX int8 GEMM and rescale in one call),
no Ray: bit-identical to tests/w8a8_reference.py over shapes that break the kernel's blocks (K not a multiple
of 64, N not of 32, 1 / 3 / 17 / 33 / 70 tokens), bf16 and fp32, with and without a bias, strided rows, all-zero
rows; through W8A8Linear; recorded on the decode tape as one op and replayed; seen by FakeTensor mode; chosen
on a CPU with AMX int8 (its absence, or LORASERVE_W8A8_KERNEL=onednn, keeps oneDNN's path). The engine's
W8A8 decode on it, eager and captured, against the reference model: tests/test_quant.py."""
import ctypes

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import huge_pages
from lora import native
from lora_reference import OpLog
from w8a8_reference import w8a8_reference
from workers import tape_graph
from workers.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup
from workers.quant import cpu_w8a8
from workers.quant.kernels import CpuW8A8, FusedCpuW8A8, w8a8_kernel
from workers.quant.w8a8_linear import W8A8Linear
from workers.quant.writer import quantize_weight


def _amx_int8() -> bool:
    with open("/proc/cpuinfo") as f:
        return "amx_int8" in next((line for line in f if line.startswith("flags")), "").split()


def _kernel():
    """What the engine runs on this machine: the fused kernel where the CPU has AMX int8, else oneDNN's path
    (whose arithmetic the reference describes too), so these tests hold on either."""
    return w8a8_kernel("cpu", torch.bfloat16)


def _weights(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize_weight(torch.randn(n, k, generator=gen) * 0.05)
    return q, scale, gen


def test_the_fused_kernel_is_chosen_where_the_cpu_has_amx_int8(monkeypatch):
    assert cpu_w8a8.available() == _amx_int8()
    assert isinstance(_kernel(), FusedCpuW8A8 if _amx_int8() else CpuW8A8)
    assert isinstance(w8a8_kernel("cpu", torch.float16), CpuW8A8)   # no fp16 code in the kernel
    monkeypatch.setenv("LORASERVE_W8A8_KERNEL", "onednn")
    assert isinstance(w8a8_kernel("cpu", torch.bfloat16), CpuW8A8)
    monkeypatch.setenv("LORASERVE_W8A8_KERNEL", "amx")
    with pytest.raises(ValueError, match="LORASERVE_W8A8_KERNEL"):
        w8a8_kernel("cpu", torch.bfloat16)
    monkeypatch.delenv("LORASERVE_W8A8_KERNEL")
    monkeypatch.setattr(cpu_w8a8, "available", lambda: False)
    assert isinstance(w8a8_kernel("cpu", torch.bfloat16), CpuW8A8)


def test_a_build_without_amx_reports_it(monkeypatch, tmp_path):
    """A CPU without AMX int8 (here: a build for x86-64-v3) gets a library that says so, and no kernel."""
    monkeypatch.setenv("LORASERVE_KERNEL_ARCH", "x86-64-v3")
    monkeypatch.setenv("LORASERVE_KERNEL_DIR", str(tmp_path))
    lib = ctypes.CDLL(str(native._build(cpu_w8a8.SOURCE)))
    assert lib.w8a8_init() == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k, n", [(64, 32), (100, 70), (1000, 33), (200, 1)])
def test_kernel_is_exact_against_the_reference(dtype, k, n):
    q, scale, gen = _weights(n, k, seed=k + n)
    kernel = _kernel()
    packed = kernel.pack(q, scale.flatten())
    for m in (1, 3, 17, 33, 70):
        x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
        x[m // 2] = 0   # an all-zero token (a padded graph row) quantizes to zeros, not NaN
        bias = torch.randn(n, generator=gen).to(dtype)
        for b in (None, bias):
            y = kernel(x, packed, b)
            expected = w8a8_reference(x, q, scale, b)
            assert y.dtype == dtype and y.shape == (m, n)
            assert torch.equal(y, expected), (m, b is not None, (y.float() - expected.float()).abs().max().item())


def test_the_packed_weight_is_on_huge_pages():
    q, scale, _ = _weights(70, 100, seed=1)
    weight, _ = cpu_w8a8.pack(q, scale.flatten())
    assert huge_pages.advised(weight) and not huge_pages.advised(q)


def test_strided_and_batched_inputs():
    """Rows of a wider buffer (a stride past K) and a leading batch dimension read as the reference's."""
    q, scale, gen = _weights(48, 130, seed=5)
    kernel = _kernel()
    packed = kernel.pack(q, scale.flatten())
    wide = torch.randn(9, 200, generator=gen).bfloat16()
    x = wide[:, 30:160]
    assert torch.equal(kernel(x, packed, None), w8a8_reference(x, q, scale, None))
    x3 = torch.randn(2, 5, 130, generator=gen).bfloat16()
    y3 = kernel(x3, packed, None)
    assert y3.shape == (2, 5, 48) and torch.equal(y3, w8a8_reference(x3, q, scale, None))
    wrong = (torch.randn(2, 131).bfloat16(), torch.randn(2, 130).half()) if isinstance(kernel, FusedCpuW8A8) else ()
    for x in wrong:   # the eager call checks x against the layer (it never reads past the weight)
        with pytest.raises(ValueError, match="W8A8 kernel"):
            kernel(x, packed, None)


@pytest.mark.parametrize("row", [False, True])
def test_w8a8_linear_layers_on_the_kernel(row):
    tp = TPGroup()
    base = (RowParallelLinear(96, 40, bias=False, tp=tp) if row
            else ColumnParallelLinear(96, [24, 16], bias=True, tp=tp))
    layer = W8A8Linear(base, _kernel(), "test")
    q, scale, gen = _weights(40, 96, seed=7)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale)
    layer.weight_offset.data.zero_()
    if layer.bias is not None:
        layer.bias.data.copy_(torch.randn(40, generator=gen))
    layer.finish_loading()
    x = torch.randn(6, 96, generator=gen)
    assert torch.equal(layer(x), w8a8_reference(x, q, scale, layer.bias))


def test_the_op_is_recorded_on_the_tape_and_replays():
    q, scale, gen = _weights(70, 100, seed=11)
    kernel = _kernel()
    packed = kernel.pack(q, scale.flatten())
    x, bias = torch.randn(3, 100, generator=gen).bfloat16(), torch.randn(70, generator=gen).bfloat16()
    graph = tape_graph.TapeGraph()
    with OpLog() as log, tape_graph.graph(graph):
        y = torch.relu(kernel(x, packed, bias))
    assert not isinstance(kernel, FusedCpuW8A8) or "loraserve::w8a8_linear" in log.names
    for seed in range(1, 3):   # new values in the input, in place; the captured output tensor is rewritten
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(y, torch.relu(w8a8_reference(x, q, scale, bias)))


def test_fake_tensor_mode_sees_the_shape_and_the_checks():
    q, scale, _ = _weights(33, 100, seed=13)
    weight, w_scale = cpu_w8a8.pack(q, scale.flatten())
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = torch.ops.loraserve.w8a8_linear(torch.empty(4, 7, 100, dtype=torch.bfloat16), weight, w_scale, None, 33)
        assert y.shape == (4, 7, 33) and y.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="W8A8 kernel does not take"):
            torch.ops.loraserve.w8a8_linear(torch.empty(4, 64, dtype=torch.float16), weight, w_scale, None, 33)
