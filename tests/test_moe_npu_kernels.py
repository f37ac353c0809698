"""The Qwen3-MoE experts on an NPU through torch_npu's MoE ops (workers/models/moe_kernels.py), checked against the
strict CPU emulator of their contract (tests/ascend_moe_emulator.py) and the torch path, in fp32:

- the sparse block with expert LoRA (the combined (expert slot, expert) index per row) in every LoRA phase, and
  captured on the op tape (workers/tape_graph.py) then replayed on other inputs: routing and the per-expert counts
  change between capture and replay, so nothing may have been read back to the host;
- whole engines: on the fake NPU (tests/fake_device.py: a host tensor mixed into device ops raises), eager and
  graph-safe decode, and on the CPU with captured decode, token for token HF transformers + PEFT's output;
- the selection: the torch path where the ops or the chip's dtypes are missing.
"""
from __future__ import annotations

import copy
import dataclasses
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from ascend_moe_emulator import TorchNpuMoeEmulator
from factories import PROMPTS, engine_with_adapters
from lora.backends.torch_native import TorchNativeBackend
from lora.expert_layers import MoeExpertsLoRA, wrap_experts
from lora.slots import SlotPool
from moe_factories import MergedOracle, PerAdapterOracle, expert_slot_pool, make_expert_adapter, make_moe_model, \
    moe_config, write_per_expert_adapter
from workers import SamplingParams, tape_graph
from workers.forward_batch import ForwardBatch
from workers.models import cpu_moe, moe_kernels
from workers.models.moe_kernels import NpuMoeKernel, moe_kernel
from workers.models.qwen3_moe import SparseMoeBlock
from workers.parallel import TPGroup

E, H, I, R = 8, 64, 24, 8
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
NAMES = [None, "experts", "per_expert"]
REQUESTS = [(PROMPTS[i], NAMES[i % 3]) for i in range(6)]


# ---- the block ---------------------------------------------------------------------------------------------------
def make_pool() -> SlotPool:
    return expert_slot_pool((E, H, I, R), (8, 4, 2))


def blocks(kernel):
    """The same random block twice, wrapped with expert LoRA: on the torch path and through `kernel`."""
    torch.manual_seed(0)
    block = SparseMoeBlock(moe_config(384, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2), TPGroup())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)
    pool, wrapped = make_pool(), []
    for k in (None, kernel):
        model = SimpleNamespace(layers=[SimpleNamespace(mlp=copy.deepcopy(block))])
        assert wrap_experts(model, TorchNativeBackend("cpu", torch.float32, R), pool) == 1
        model.layers[0].mlp.kernel = k
        wrapped.append(model.layers[0].mlp)
    return wrapped


def step(block, x, token_slots, phase):
    backend = TorchNativeBackend("cpu", torch.float32, R)
    info = backend.graph_info(token_slots) if phase == "graph" else backend.batch_info(token_slots.tolist(),
                                                                                         [8, 4, 2], phase)
    T = x.shape[0]
    zeros = torch.zeros(T, dtype=torch.int64)
    return block(x, ForwardBatch(input_ids=zeros, positions=zeros, slot_mapping=zeros, logits_indices=zeros[:1],
                                 lora=info, graph_safe=phase == "graph"))


@pytest.mark.parametrize("phase,slots", [("prefill", [0] * 5 + [-1] * 3 + [2] * 6 + [1] * 4),
                                         ("decode", [2, -1, 0, 1, 1, 0]), ("graph", [1, 0, -1, 2, 2, 0, -1, 1])])
def test_block_through_the_npu_ops_matches_the_torch_path(phase, slots):
    emulator = TorchNpuMoeEmulator()
    torch_block, npu_block = blocks(NpuMoeKernel(emulator))
    assert isinstance(npu_block.experts, MoeExpertsLoRA)
    x, token_slots = torch.randn(len(slots), H), torch.tensor(slots)
    want, got = step(torch_block, x, token_slots, phase), step(npu_block, x, token_slots, phase)
    assert dict(emulator.calls) == {"npu_moe_gating_top_k_softmax": 1, "npu_moe_init_routing_v2": 1,
                                    "npu_grouped_matmul": 2, "npu_moe_finalize_routing": 1}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = torch_block(x, ForwardBatch(input_ids=None, positions=None, slot_mapping=None, logits_indices=None))
    assert (want - base).abs().max() > 0.1, "the adapters must change the output"


def test_captured_block_replays_other_routing_without_host_reads():
    """Captured once, replayed on other tokens and adapters: other experts, other counts per expert (which only
    the device holds), still the torch path's result."""
    torch_block, npu_block = blocks(NpuMoeKernel(TorchNpuMoeEmulator()))
    x, token_slots = torch.randn(8, H), torch.tensor([1, 0, -1, 2, 2, 0, -1, 1])
    graph = tape_graph.TapeGraph()
    with torch.inference_mode():
        with tape_graph.graph(graph):
            out = step(npu_block, x, token_slots, "graph")
        counts = []
        for seed in range(3):
            gen = torch.Generator().manual_seed(seed)
            x.copy_(torch.randn(8, H, generator=gen))
            token_slots.copy_(torch.randint(-1, 3, (8,), generator=gen))
            graph.replay()
            torch.testing.assert_close(out, step(torch_block, x, token_slots, "graph"), rtol=1e-5, atol=1e-5)
            counts.append(torch.topk(x @ npu_block.gate.weight.T, 2).indices.flatten().bincount(minlength=E).tolist())
    assert len({tuple(c) for c in counts}) > 1, "the replays must route differently"


def test_a_host_read_in_the_capture_raises(monkeypatch):
    """The torch path's eager grouping reads the counts back: refused under capture, as on a device (the CPU's
    grouped kernel, which reads nothing back, off)."""
    monkeypatch.setattr(cpu_moe, "ENABLED", False)
    torch_block, _ = blocks(None)
    zeros = torch.zeros(4, dtype=torch.int64)
    eager = ForwardBatch(input_ids=zeros, positions=zeros, slot_mapping=zeros, logits_indices=zeros[:1])
    with pytest.raises(tape_graph.CaptureError), torch.inference_mode(), tape_graph.graph(tape_graph.TapeGraph()):
        torch_block(torch.randn(4, H), eager)


# ---- the contract the emulator holds callers to -------------------------------------------------------------------
def test_the_emulator_refuses_what_the_ops_refuse():
    ops = TorchNpuMoeEmulator()
    x, w = torch.randn(6, 16), torch.randn(3, 8, 16)   # [E, N, K]
    counts = torch.tensor([2, 6, 6])
    ops.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts, split_item=2, group_type=0)
    with pytest.raises(RuntimeError, match="int64"):
        ops.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts.int(), split_item=2, group_type=0)
    with pytest.raises(RuntimeError, match="non-decreasing"):   # counts read as a cumsum
        ops.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=torch.tensor([2, 4, 0]), split_item=2,
                               group_type=0, group_list_type=0)
    with pytest.raises(RuntimeError, match="strides"):
        ops.npu_grouped_matmul([x], [w.transpose(1, 2)[:, :, :4]], group_list=counts, split_item=2, group_type=0)
    with pytest.raises(RuntimeError, match="split_item"):
        ops.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts, split_item=0, group_type=0)
    with pytest.raises(RuntimeError, match="int32"):
        ops.npu_moe_init_routing_v2(x, torch.zeros(6, 2, dtype=torch.int64), expert_num=3)
    with pytest.raises(RuntimeError, match="past expert_num"):
        ops.npu_moe_init_routing_v2(x, torch.full((6, 2), 3, dtype=torch.int32), expert_num=3)
    with pytest.raises(RuntimeError, match="scales"):
        ops.npu_moe_finalize_routing(torch.randn(12, 16), None, None, None, torch.rand(6, 2, dtype=torch.float64),
                                     torch.arange(12, dtype=torch.int32), None, drop_pad_mode=2)


def test_the_routing_ops_index_conventions():
    """init_routing_v2's gather index, finalize's two orders and gating's k-major row_idx, on known values."""
    ops = TorchNpuMoeEmulator()
    x = torch.arange(3.0).unsqueeze(1).repeat(1, 16)                       # token t's row is all t
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]], dtype=torch.int32)
    sorted_x, gather, cumsum, _ = ops.npu_moe_init_routing_v2(x, ids, expert_num=3, expert_tokens_num_flag=True)
    assert sorted_x[:, 0].tolist() == [0, 1, 1, 2, 0, 2]                  # expert 0: (0,1) (1,0); 1: (1,1) (2,1); 2: ..
    assert gather.tolist() == [4, 0, 1, 2, 5, 3] and cumsum.tolist() == [2, 4, 6]
    assert ops.npu_moe_init_routing_v2(x, ids, expert_num=3, row_idx_type=1)[1].tolist() == [1, 2, 3, 5, 0, 4]
    scales = torch.tensor([[1.0, 10.0], [100.0, 1000.0], [1e4, 1e5]])
    by_row = ops.npu_moe_finalize_routing(sorted_x, None, None, None, scales, gather, ids, drop_pad_mode=2)
    assert by_row[:, 0].tolist() == [0.0, 1100.0, 2.2e5]
    k_major = gather.view(3, 2).t().reshape(-1).to(torch.int32)
    assert torch.equal(ops.npu_moe_finalize_routing(sorted_x, None, None, None, scales, k_major, ids), by_row)
    _, _, row_idx = ops.npu_moe_gating_top_k_softmax(torch.randn(3, 4), k=2)
    assert row_idx.tolist() == [[0, 3], [1, 4], [2, 5]]


def test_the_kernel_is_chosen_where_the_ops_and_dtypes_are():
    ops = TorchNpuMoeEmulator()
    assert moe_kernel("cpu", torch.float32, ops=ops) is None
    assert isinstance(moe_kernel("npu", torch.bfloat16, ops=ops, device_name="Ascend910B1"), NpuMoeKernel)
    assert isinstance(moe_kernel("npu", torch.float16, ops=ops, device_name="Ascend310P3"), NpuMoeKernel)
    assert moe_kernel("npu", torch.float32, ops=ops, device_name="Ascend310P3") is None
    older = SimpleNamespace(npu_grouped_matmul=ops.npu_grouped_matmul)   # a torch_npu without the routing ops
    assert "npu_moe_init_routing_v2" in moe_kernels.unavailable_reason(older, torch.bfloat16, "Ascend910B1")
    assert moe_kernel("npu", torch.bfloat16, ops=older, device_name="Ascend910B1") is None


# ---- whole engines, fp32, against HF + PEFT ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-npu")
    path = make_moe_model(out / "model")
    adapters = {"experts": make_expert_adapter(path, out / "experts", r=4, alpha=8, target_modules=["q_proj"], seed=2),
                "per_expert": write_per_expert_adapter(path, out / "per_expert", r=8, alpha=16, seed=3)[0]}
    peft = PerAdapterOracle(path, {"experts": adapters["experts"]})
    oracles = {None: peft, "experts": peft, "per_expert": MergedOracle(path, adapters["per_expert"])}
    return path, adapters, [oracles[a].greedy(p, a, MAX_TOKENS) for p, a in REQUESTS]


def assert_matches_hf(outs, expected):
    for (prompt, adapter), out, (tokens, logprobs) in zip(REQUESTS, outs, expected):
        assert out.token_ids == tokens, (prompt, adapter)
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-3, (prompt, adapter)


def generate(engine):
    return engine.generate([p for p, _ in REQUESTS], GREEDY, adapters=[a for _, a in REQUESTS])


@pytest.mark.parametrize("graph_safe", [False, True], ids=["eager", "graph_safe"])
def test_engine_on_a_fake_npu_matches_hf(moe, monkeypatch, graph_safe):
    from fake_device import FakeDevice, on_device
    from workers import EngineConfig, LLMEngine
    from workers.device import PLATFORMS
    from workers.worker import make_runner

    path, adapters, expected = moe
    emulator = TorchNpuMoeEmulator()
    monkeypatch.setattr("workers.runner.moe_kernel", partial(moe_kernel, ops=emulator, device_name="Ascend910B1"))
    with FakeDevice():
        config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_lora_rank=16, max_loras_per_batch=3,
                              lora_backend="torch_native", graph_safe_decode=graph_safe)
        engine = LLMEngine(config)
        platform = dataclasses.replace(PLATFORMS["npu"], supports_graphs=False)
        engine.executor = make_runner(dataclasses.replace(config, device="npu"), engine.runtime, platform,
                                 engine._resident_adapter)
        for name, source in adapters.items():
            engine.load_adapter(name, str(source))
        model = engine.executor.model
        assert all(layer.mlp.kernel is not None for layer in model.layers if hasattr(layer.mlp, "experts"))
        assert on_device(next(model.parameters()))
        outs = generate(engine)
    assert emulator.calls["npu_grouped_matmul"] > 0
    assert_matches_hf(outs, expected)


def test_captured_decode_through_the_npu_ops_matches_hf(moe, monkeypatch):
    """Decode captured on the op tape (a host read raises) with the MoE ops and the expert LoRA rows."""
    path, adapters, expected = moe
    emulator = TorchNpuMoeEmulator()
    monkeypatch.setattr("workers.runner.moe_kernel", lambda platform, dtype: NpuMoeKernel(emulator))
    engine = engine_with_adapters(path, adapters, max_lora_rank=16, max_loras_per_batch=3, emulate_capture=True,
                                  prepack_weights=False)   # the NPU keeps [E, out, in] weights (no oneDNN packing)
    try:
        assert_matches_hf(generate(engine), expected)
        assert engine.executor.graph_runner.graphs, "no decode graph was captured"
        assert emulator.calls["npu_moe_init_routing_v2"] > 0
    finally:
        engine.close()


def test_ascend_lora_backend_with_the_npu_moe_ops_on_a_fake_npu(tmp_path, monkeypatch):
    """fp16 on the fake NPU: the MoE ops' emulator for the experts and sgl_kernel_npu's for every LoRA layer, expert
    rows included (combined indices in the kernels' index dtype, sgmv in prefill, bgmv in graph-safe decode); the
    greedy tokens of the torch LoRA ops on the same device (the kernels round h once: a near tie may part late)."""
    from ascend_emulator import CALLS, register_emulator
    from fake_device import FakeDevice
    from workers import EngineConfig, LLMEngine
    from workers.device import PLATFORMS
    from workers.worker import make_runner

    register_emulator()
    path = make_moe_model(tmp_path / "model", moe_intermediate_size=32)   # slices of whole 32-byte blocks (kernels)
    adapters = {"experts": make_expert_adapter(path, tmp_path / "experts", r=8, alpha=16, target_modules=["q_proj"],
                                               seed=2),
                "per_expert": write_per_expert_adapter(path, tmp_path / "per_expert", r=8, alpha=16, seed=3)[0]}
    emulator = TorchNpuMoeEmulator()
    monkeypatch.setattr("workers.runner.moe_kernel", partial(moe_kernel, ops=emulator, device_name="Ascend910B1"))
    platform = dataclasses.replace(PLATFORMS["npu"], supports_graphs=False)
    runs, before = {}, dict(CALLS)
    for backend in ("ascend", "torch_native"):
        with FakeDevice():
            config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_lora_rank=16,
                                  max_loras_per_batch=3, graph_safe_decode=True,
                                  lora_target_modules=("q_proj", "experts.gate_proj", "experts.up_proj",
                                                       "experts.down_proj"))
            engine = LLMEngine(config)
            engine.executor = make_runner(dataclasses.replace(config, device="npu", lora_backend=backend),
                                     dataclasses.replace(engine.runtime, dtype="float16"), platform,
                                     engine._resident_adapter)
            for name, source in adapters.items():
                engine.load_adapter(name, str(source))
            runs[backend] = [o.token_ids for o in generate(engine)]
            if backend == "ascend":
                stats = engine.executor.lora_backend.stats()
    assert stats == {"lora_backend": "ascend", "lora_fallbacks": {}}, stats
    assert CALLS["sgmv_shrink"] > before.get("sgmv_shrink", 0) and CALLS["bgmv_expand"] > before.get("bgmv_expand", 0)
    assert emulator.calls["npu_grouped_matmul"] > 0
    assert all(a[:4] == b[:4] for a, b in zip(runs["ascend"], runs["torch_native"])), runs
    assert sum(a == b for a, b in zip(runs["ascend"], runs["torch_native"])) >= len(REQUESTS) - 1, runs
