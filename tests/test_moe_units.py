"""Qwen3-MoE pieces without an engine: the expert LoRA formats against PEFT's own maths, refusals naming what
is wrong, the loader's layouts, TP cuts, the expert slot memory rule, and the Ascend kernels on combined
(slot, expert) indices (tests/ascend_emulator.py)."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import huge_pages
from factories import make_adapter, make_model
from lora.adapter import LoRAWeights, load_adapter, model_spec_from_hf_config
from lora.errors import AdapterError, AdapterTargetError
from lora.expert_memory import check_expert_slots
from lora.slots import GroupShape
from moe_factories import make_expert_adapter, make_moe_model, moe_config, write_per_expert_adapter
from workers import EngineConfig, LLMEngine
from workers.models.qwen3_moe import Qwen3MoeForCausalLM
from workers.parallel import TPGroup
from lora.layers import lora_shard


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("moe-units") / "model")


def spec_of(path):
    return model_spec_from_hf_config(json.loads((path / "config.json").read_text()))


def peft_deltas(path, adapter):
    """PEFT's own delta weights of each fused experts parameter: {(layer, 'gate_up_proj' | 'down_proj'): [E, out, in]}."""
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper
    from transformers import AutoModelForCausalLM

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter)
    out = {}
    for name, module in peft.named_modules():
        if isinstance(module, ParamWrapper):
            layer = int(name.split("layers.")[1].split(".")[0])
            out[layer, module.parameter_name] = module.get_delta_weight("default").detach()
    return out


def ours(adapter, layer: int, module: str) -> torch.Tensor:
    w = adapter.weights[layer, module]
    return w.scaling * torch.einsum("eor,eri->eoi", w.lora_b, w.lora_a)


@pytest.mark.parametrize("kind", ["target_parameters", "converted_gate_up_down"])
def test_fused_experts_read_as_peft_computes_them(model, tmp_path, kind):
    """A [r*E, in] expert-major, B [out, r*E] expert-minor (PEFT's ParamWrapper); PEFT 0.21 also turns target_modules
    gate/up/down_proj into target_parameters at twice the rank and alpha for gate_up (rank_pattern / alpha_pattern)."""
    if kind == "target_parameters":
        adapter_dir = make_expert_adapter(model, tmp_path / "a", r=3, alpha=5, seed=7)
    else:
        adapter_dir = make_adapter(model, tmp_path / "a", r=3, alpha=5, seed=7,
                                   target_modules=["gate_proj", "up_proj", "down_proj"])
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        assert config["rank_pattern"] == {r".*\.gate_up_proj": 6} and config["target_parameters"]
    adapter = load_adapter("a", str(adapter_dir), spec_of(model), max_lora_rank=8)
    deltas = peft_deltas(model, adapter_dir)
    I = 24
    assert {layer for layer, _ in deltas} == {0, 2}
    for (layer, param), delta in deltas.items():
        if param == "down_proj":
            torch.testing.assert_close(ours(adapter, layer, "experts.down_proj"), delta, rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(ours(adapter, layer, "experts.gate_proj"), delta[:, :I], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours(adapter, layer, "experts.up_proj"), delta[:, I:], rtol=1e-5, atol=1e-6)


def test_per_expert_keys_stack_with_absent_experts_zero(model, tmp_path):
    path, pairs = write_per_expert_adapter(model, tmp_path / "a", r=4, alpha=8, layers=(2,))
    tensors = load_file(path / "adapter_model.safetensors")
    for key in [k for k in tensors if ".experts.5." in k]:   # an adapter trained on some experts only
        del tensors[key]
    save_file(tensors, path / "adapter_model.safetensors")
    adapter = load_adapter("a", str(path), spec_of(model), max_lora_rank=8)
    assert {key for key in adapter.weights} == {(2, "experts.gate_proj"), (2, "experts.up_proj"), (2, "experts.down_proj")}
    w = adapter.weights[2, "experts.up_proj"]
    assert w.lora_a.shape == (8, 4, 64) and w.lora_b.shape == (8, 24, 4) and w.scaling == 2.0
    a, b = pairs[2, 3, "up_proj"]
    assert torch.equal(w.lora_a[3], a) and torch.equal(w.lora_b[3], b)
    assert not w.lora_a[5].any() and not w.lora_b[5].any()


def write(path, tensors: dict, **config):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    return path


@pytest.mark.parametrize("case,match", [
    ("router_keys", r"router \(mlp.gate\) is not a supported LoRA target"),
    ("dense_mlp_in_sparse_layer", r"layer 0 is a sparse \(mixture-of-experts\) layer"),
    ("expert_in_dense_layer", r"targets experts in layer 1, which has none"),
    ("wrong_shapes", r"expected \[\[32, 64\], \[48, 32\]\] \(mlp.experts.gate_up_proj"),
    ("other_parameter", r"target_parameters 'mlp.experts.bias' .* is not supported"),
])
def test_refusals_name_what_is_wrong(model, tmp_path, case, match):
    r = torch.randn
    pre = "base_model.model.model.layers"
    tensors, config = {
        "router_keys": ({f"{pre}.0.mlp.gate.lora_A.weight": r(4, 64), f"{pre}.0.mlp.gate.lora_B.weight": r(8, 4)}, {}),
        "dense_mlp_in_sparse_layer": ({f"{pre}.0.mlp.up_proj.lora_A.weight": r(4, 64),
                                       f"{pre}.0.mlp.up_proj.lora_B.weight": r(96, 4)}, {}),
        "expert_in_dense_layer": ({f"{pre}.1.mlp.experts.0.up_proj.lora_A.weight": r(4, 64),
                                   f"{pre}.1.mlp.experts.0.up_proj.lora_B.weight": r(24, 4)}, {}),
        "wrong_shapes": ({f"{pre}.0.mlp.experts.base_layer.lora_A.weight": r(32, 64),
                          f"{pre}.0.mlp.experts.base_layer.lora_B.weight": r(24, 32)},
                         {"target_parameters": ["mlp.experts.gate_up_proj"]}),
        "other_parameter": ({f"{pre}.0.self_attn.q_proj.lora_A.weight": r(4, 64),
                             f"{pre}.0.self_attn.q_proj.lora_B.weight": r(64, 4)},
                            {"target_parameters": ["mlp.experts.bias"]}),
    }[case]
    with pytest.raises(AdapterError, match=match):
        load_adapter("a", str(write(tmp_path / case, tensors, **config)), spec_of(model), max_lora_rank=8)


def test_expert_adapter_on_a_dense_model_is_refused(model, tmp_path):
    dense = make_model(tmp_path / "dense", "qwen3")
    adapter = make_expert_adapter(model, tmp_path / "a")
    with pytest.raises(AdapterTargetError, match="the base model has none"):
        load_adapter("a", str(adapter), spec_of(dense), max_lora_rank=8)


def test_loader_refuses_a_checkpoint_missing_an_expert(tmp_path):
    path = make_moe_model(tmp_path / "model")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.6.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing experts of layers.2.mlp.experts.gate_up_proj: \(expert, slice\) \[\(6, 1\)\]"):
        LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", enable_lora=False))


def test_lora_shard_cuts_experts_like_their_weights():
    cfg = moe_config(384)
    shards = [lora_shard(Qwen3MoeForCausalLM(cfg, TPGroup(rank, 2), 64)) for rank in range(2)]
    gen = torch.Generator().manual_seed(0)
    E, H, I = 8, 64, 24
    for module, (i, o) in {"experts.gate_proj": (H, I), "experts.up_proj": (H, I), "experts.down_proj": (I, H)}.items():
        w = LoRAWeights(torch.randn(E, 4, i, generator=gen), torch.randn(E, o, 4, generator=gen), 1.0)
        (a0, b0), (a1, b1) = (shard(module, w) for shard in shards)
        if module == "experts.down_proj":   # row: A on the input columns, B replicated
            assert torch.equal(torch.cat([a0, a1], -1), w.lora_a) and b0 is w.lora_b and b1 is w.lora_b
        else:                               # column: B on the output rows of each expert, A replicated
            assert torch.equal(torch.cat([b0, b1], 1), w.lora_b) and a0 is w.lora_a and a1 is w.lora_a


def test_expert_slot_memory_is_said_and_a_config_that_does_not_fit_is_refused(model, caplog):
    groups = {"experts_gate_up": GroupShape(64, (24, 24), (0, 2), 8), "experts_down": GroupShape(24, (64,), (0, 2), 8)}
    per_slot = 2 * 8 * 16 * (2 * 64 + 48 + 24 + 64) * 4      # layers x experts x R x (A + B) x fp32
    report = check_expert_slots(groups, 3, 4, 16, torch.float32, lambda: 4 * per_slot, "budget")
    assert report.startswith(f"expert LoRA slots (max_expert_loras): 4 x {per_slot / 2 ** 30:.3f} GB")
    with pytest.raises(ValueError, match=r"do not fit; what would: max_expert_loras <= 2, or max_lora_rank <= 8"):
        check_expert_slots(groups, 3, 4, 16, torch.float32, lambda: 2 * per_slot, "budget")
    assert check_expert_slots(groups, 3, 4, 16, torch.float32, lambda: None, "free").endswith("free unknown")
    assert check_expert_slots({"o_proj": GroupShape(64, (64,))}, 3, 4, 16, torch.float32, lambda: 0, "b") is None
    with caplog.at_level(logging.INFO, logger="workers.runner"):
        LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_lora_rank=16)).close()
    default = EngineConfig.__dataclass_fields__["max_loras_per_batch"].default   # max_expert_loras' default
    assert f"expert LoRA slots (max_expert_loras): {default} x" in caplog.text
    with pytest.raises(ValueError, match="expert_lora_memory_gb .* do not fit; what would: max_expert_loras <= 1"):
        LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_lora_rank=16,
                               expert_lora_memory_gb=1.5 * per_slot / 2 ** 30))
    LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_lora_rank=16, max_expert_loras=1,
                           expert_lora_memory_gb=1.5 * per_slot / 2 ** 30)).close()   # what the message said
    no_experts = ("q_proj", "k_proj", "v_proj", "o_proj")      # attention only: no expert slot at all
    LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_lora_rank=16,
                           lora_target_modules=no_experts, expert_lora_memory_gb=0)).close()


def test_expert_slots_hold_every_expert_at_combined_indices_and_clear_to_zero():
    from lora.adapter import LoRAAdapter
    from lora.slots import SlotPool

    E, H, I, R = 4, 16, 8, 4
    groups = {"experts_gate_up": GroupShape(H, (I, I), (1,), E), "experts_down": GroupShape(I, (H,), (1,), E),
              "o_proj": GroupShape(H, (H,))}
    pool = SlotPool(2, groups, num_slots=3, max_rank=R, dtype=torch.float32, device="cpu", num_expert_slots=2)
    assert set(pool.buffers) == {(1, "experts_gate_up"), (1, "experts_down"), (0, "o_proj"), (1, "o_proj")}
    # the expert buffers zeros on huge-page-advised memory (a decode reads scattered blocks of them), the others not
    a, b = pool.buffers[(1, "experts_gate_up")]
    assert all(huge_pages.advised(t) and not t.any() and t.dtype == torch.float32 for t in (a, *b))
    assert not huge_pages.advised(pool.buffers[(1, "o_proj")][0])
    gen = torch.Generator().manual_seed(0)
    w = {(1, m): LoRAWeights(torch.randn(E, 2, i, generator=gen), torch.randn(E, o, 2, generator=gen), 0.5)
         for m, (i, o) in {"experts.gate_proj": (H, I), "experts.up_proj": (H, I), "experts.down_proj": (I, H)}.items()}
    adapter = LoRAAdapter("a", "src", 2, frozenset(m for _, m in w), w)
    with pytest.raises(ValueError, match="needs an expert slot in \\[0, 2\\), got None"):
        pool.load(2, adapter)
    pool.load(2, adapter, expert_slot=1)
    a, (b_gate, b_up) = pool.buffers[(1, "experts_gate_up")]
    assert a.shape == (2 * E, 2 * R, H) and b_up.shape == (2 * E, I, R)   # two expert slots of E blocks
    for e in range(E):
        assert torch.equal(a[E + e, R:R + 2], w[1, "experts.up_proj"].lora_a[e])      # slice 1 at row R
        assert torch.equal(b_up[E + e, :, :2], 0.5 * w[1, "experts.up_proj"].lora_b[e])
    assert not a[:E].any() and not a[E:, 2:R].any() and not b_up[E:, :, 2:].any()
    assert pool.expert_ranks.tolist() == [0, 2] and pool.slot_ranks == [0, 0, 2]
    assert pool.expert_slot_of == [-1, -1, 1]
    assert pool.expert_slot_of_device.tolist() == [-1, -1, 1]
    o = LoRAWeights(torch.randn(2, H, generator=gen), torch.randn(H, 2, generator=gen), 1.0)
    pool.load(0, LoRAAdapter("b", "src", 2, frozenset({"o_proj"}), {(0, "o_proj"): o}))   # no experts: no expert slot
    assert pool.expert_slot_of == [-1, -1, 1] and torch.equal(a[E, R:R + 2], w[1, "experts.up_proj"].lora_a[0])
    with pytest.raises(ValueError, match="invalid layer 0"):
        pool.load(1, LoRAAdapter("c", "src", 2, frozenset(), {(0, "experts.down_proj"): w[1, "experts.down_proj"]}), 0)
    pool.clear(2)
    pool.clear(0)
    assert not any(t.any() for a, bs in pool.buffers.values() for t in (a, *bs))
    assert pool.expert_ranks.tolist() == [0, 0]
    assert pool.expert_slot_of == [-1, -1, -1]


def test_moe_benchmark_runs_at_a_tiny_shape(tmp_path, monkeypatch):
    """benchmarks/moe.py end to end (checkpoint, PEFT-made adapters, both systems, ratios) at a tiny shape."""
    from benchmarks import moe
    from benchmarks.common import TINY_SIZES

    monkeypatch.setenv("LORASERVE_BENCH_CACHE", str(tmp_path))
    shape = moe.MoeShape(hidden_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_hidden_layers=1,
                         vocab_size=512, intermediate_size=96)
    result = moe.run(replace_sizes(TINY_SIZES), "float32", rounds=1, log=lambda *_: None, shape=shape)
    assert result["eight_over_base"] > 0 and result["ours_over_peft_eight"] > 0
    assert set(result["output_tok_s"]) == {"ours_eight", "ours_base", "peft_eight", "peft_base"}


def replace_sizes(sizes):
    from dataclasses import replace

    return replace(sizes, batch=8, max_tokens=3, prompt_len=8, rank=8, threads=1)


def test_pinning_keeps_an_expert_slot_free(model, tmp_path):
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_lora_rank=8,
                                    max_loras_per_batch=4, max_expert_loras=2))
    try:
        experts = [make_expert_adapter(model, tmp_path / f"e{i}", seed=i) for i in range(2)]
        attention = make_adapter(model, tmp_path / "attn", target_modules=["q_proj"])
        engine.load_adapter("e0", str(experts[0]), pinned=True)
        with pytest.raises(AdapterError, match=r"no free expert slot \(max_expert_loras=2\)"):
            engine.load_adapter("e1", str(experts[1]), pinned=True)
        engine.load_adapter("attn", str(attention), pinned=True)   # no expert weights: an ordinary slot only
        engine.load_adapter("e1", str(experts[1]))
    finally:
        engine.close()


def test_free_host_memory_is_read_without_psutil():
    """The CPU budget comes from /proc/meminfo (psutil is only a test dependency, through peft)."""
    from lora.expert_memory import free_memory

    free = free_memory(torch.device("cpu"))
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < free <= total
