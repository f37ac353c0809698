"""The fake-device tier: the device paths run with "device" tensors told apart from host tensors
(tests/fake_device.py), so an op mixing a host tensor into device tensors fails here as it would
on an NPU or a GPU: slot loads, batch info, the graph runner's fill and replay, the sampler state,
whole decode steps; the Ascend path through the strict kernel emulator; and who may pin memory.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ascend_emulator import CALLS, register_emulator
from factories import PROMPTS, make_adapter
from fake_device import DEVICE, FakeDevice, HostDeviceMix, on_device
from lora.adapter import load_adapter, model_spec_from_hf_config
from lora.backends import get_backend
from lora.slots import GroupShape, SlotPool
from lora_fixtures import ALL7
from workers import EngineConfig, LLMEngine, SamplingParams
from workers.device import PLATFORMS
from workers.grammar import StructuredSpec
from workers.worker import make_runner

pytestmark = pytest.mark.slow   # make test-fast skips it: whole engines through the emulators

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SAMPLED = [SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                          repetition_penalty=1.2, logit_bias={3: 2.0}, seed=i, logprobs=2) for i in range(4)]
NAMES = ["A", None, "B", "A"]
NUMBER = StructuredSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
STRUCTURED = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, logprobs=2, structured=NUMBER) for i in range(4)]


@pytest.fixture(scope="module")
def npu_ops():
    register_emulator()


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("fake-device")
    return {name: str(make_adapter(model, out / name, r=r, alpha=2 * r, target_modules=ALL7, seed=i))
            for i, (name, r) in enumerate({"A": 8, "B": 16}.items())}


def test_the_tier_fails_on_mixing_and_passes_transfers():
    with FakeDevice():
        buf = torch.zeros(2, 8, 4, device=DEVICE)
        host = torch.randn(8, 4)
        with pytest.raises(HostDeviceMix, match="aten.mul.out: host tensor"):
            torch.mul(host, 0.5, out=buf[0])          # the slot load that failed on every device
        with pytest.raises(HostDeviceMix):
            buf[0] + host
        with pytest.raises(HostDeviceMix):
            buf[torch.tensor([0, 1])]                 # host indices into a device tensor
        moved = host.to(DEVICE)
        assert on_device(moved) and on_device(buf[0] + moved) and on_device(buf * torch.tensor(2.0))
        buf[1].copy_(host)                            # explicit transfers both ways
        back = buf[1].cpu()
        assert not on_device(back) and torch.equal(back, host) and buf[1].sum().item() == pytest.approx(host.sum().item())


def test_slot_load_copies_host_adapters_onto_the_device(model, adapters):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(model)
    spec = model_spec_from_hf_config(cfg.to_dict(), ALL7)
    adapter = load_adapter("A", adapters["A"], spec, max_lora_rank=16)
    q, kv, hidden, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.hidden_size, cfg.intermediate_size
    groups = {"qkv_proj": GroupShape(hidden, (q, kv, kv)), "o_proj": GroupShape(q, (hidden,)),
              "gate_up_proj": GroupShape(hidden, (inter, inter)), "down_proj": GroupShape(inter, (hidden,))}
    host_pool = SlotPool(cfg.num_hidden_layers, groups, 2, 16, torch.float32, "cpu")
    host_pool.load(1, adapter)
    with FakeDevice():
        pool = SlotPool(cfg.num_hidden_layers, groups, 2, 16, torch.float32, DEVICE)
        pool.load(1, adapter)                         # the adapter's tensors are host tensors
        pool.load(0, adapter)
        pool.clear(0)
    for key, (a, bs) in pool.buffers.items():
        assert on_device(a) and all(on_device(b) for b in bs)
        host_a, host_bs = host_pool.buffers[key]
        assert torch.equal(a.cpu(), host_a) and all(torch.equal(b.cpu(), h) for b, h in zip(bs, host_bs))


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_batch_info_is_built_on_the_device(phase):
    with FakeDevice():
        backend = get_backend("torch_native", DEVICE, torch.float32, 8)
        info = backend.batch_info([1, 1, -1, 0, 0, 0], [8, 4], phase)
        graph = backend.graph_info(torch.full((4,), -1, dtype=torch.int64, device=DEVICE))
    assert all(on_device(g.rows) for g in info.plan.groups if isinstance(g.rows, torch.Tensor))
    assert [g.slot for g in info.plan.groups] == [1, 0] and info.has_lora
    assert on_device(graph.token_slots) and graph.plan is None


def _device_engine(model, adapters, platform, **kw):
    """A CPU engine whose worker holds the fake device: the controller, adapters and plans are the
    engine's own, every tensor the worker computes with is on the device."""
    config = EngineConfig(model=str(model), device="cpu", dtype="float32", max_lora_rank=16, **kw)
    engine = LLMEngine(config)
    engine.executor = make_runner(dataclasses.replace(config, device="npu"), engine.runtime, platform,
                             engine._resident_adapter)
    for name, source in adapters.items():
        engine.load_adapter(name, source)
    return engine


def _cpu_engine(model, adapters, **kw):
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_lora_rank=16,
                                    lora_backend="torch_native", **kw))
    for name, source in adapters.items():
        engine.load_adapter(name, source)
    return engine


@pytest.mark.parametrize("graph_safe", [False, True], ids=["eager", "graph_safe"])
@pytest.mark.parametrize("params", ["greedy", "sampled", "structured"])
def test_decode_steps_on_the_device_equal_the_cpu_engine(model, adapters, graph_safe, params):
    """Prefill, eager or graph-safe decode with LoRA slot loads and every sampler option, on the device,
    token for token the CPU engine's (both on the torch ops: the same maths)."""
    sampling = {"greedy": GREEDY, "sampled": SAMPLED, "structured": STRUCTURED}[params]   # structured: the bitmask
    platform = dataclasses.replace(PLATFORMS["npu"], supports_graphs=False)
    with FakeDevice() as tier:
        engine = _device_engine(model, adapters, platform, lora_backend="torch_native",
                                graph_safe_decode=graph_safe, max_loras_per_batch=2)
        assert tier.pin_requests[-1] is True           # the device worker holds its device: it may pin
        runner = engine.executor
        assert on_device(runner.kv_cache.k) and on_device(runner.sampler_state.output_counts)
        assert on_device(runner.graph_runner.block_tables) and runner.lora_backend.name == "torch_native"
        got = engine.generate(PROMPTS[:4], sampling, adapters=NAMES)
    want = _cpu_engine(model, adapters, graph_safe_decode=graph_safe, max_loras_per_batch=2).generate(
        PROMPTS[:4], sampling, adapters=NAMES)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_the_ascend_backend_runs_a_whole_engine_through_the_kernel_emulator(model, adapters, npu_ops):
    """Fake NPU + sgl_kernel_npu's strict emulator: probe, sgmv prefill and bgmv decode, in 16 bits as the
    kernels need (fp16); the same greedy tokens as the torch ops on the same device."""
    platform = dataclasses.replace(PLATFORMS["npu"], supports_graphs=False)
    kw = dict(dtype="float32", max_loras_per_batch=2, lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                              "gate_proj", "up_proj", "down_proj"))
    runs = {}
    for backend in ("ascend", "torch_native"):
        with FakeDevice():
            config = EngineConfig(model=str(model), device="cpu", max_lora_rank=16, **kw)
            engine = LLMEngine(config)
            engine.executor = make_runner(dataclasses.replace(config, device="npu", lora_backend=backend),
                                     dataclasses.replace(engine.runtime, dtype="float16"), platform,
                                     engine._resident_adapter)
            for name, source in adapters.items():
                engine.load_adapter(name, source)
            runs[backend] = [o.token_ids for o in engine.generate(PROMPTS[:4], GREEDY, adapters=NAMES)]
            if backend == "ascend":
                assert engine.executor.lora_backend.stats() == {"lora_backend": "ascend", "lora_fallbacks": {}}
                calls = dict(CALLS)
    assert calls["sgmv_shrink"] and calls["bgmv_shrink"] and calls["sgmv_expand"] and calls["bgmv_expand"]
    assert runs["ascend"] == runs["torch_native"]


def test_only_a_process_that_holds_its_device_pins(model):
    """TP > 1: the replica drives remote workers and holds no device: its adapter host copies stay
    pageable (torch_npu's pinned allocator would initialise a device Ray hid from it)."""
    base = dict(model=str(model), device="cpu")
    for tp, executor, pins in ((1, "auto", True), (2, "auto", False), (1, "ray", False)):
        engine = LLMEngine.__new__(LLMEngine)
        engine.config = EngineConfig(**base, tensor_parallel_size=tp, distributed_executor=executor)
        engine.platform = PLATFORMS["npu"]
        assert engine._copies_to_its_device() is pins, (tp, executor)
    engine.platform = PLATFORMS["cpu"]
    engine.config = EngineConfig(**base)
    assert not engine._copies_to_its_device()
