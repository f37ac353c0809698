"""load_adapter against PEFT's own view of real adapters, and each way an adapter is refused."""
from __future__ import annotations

import json
import re
import shutil

import huggingface_hub
import pytest
import torch
from factories import make_adapter, make_model, model_config, read_json
from safetensors.torch import load_file, save_file

from lora.adapter import LINEAR_MODULES, SUPPORTED_MODULES, load_adapter, model_spec_from_hf_config
from lora.modules import EXPERT_MODULES
from lora.errors import (AdapterConfigError, AdapterNotFoundError, AdapterPathError, AdapterRankError,
                         AdapterShapeError, AdapterTargetError, AdapterUnsupportedError, AdapterWeightsError)
from lora.peft_format import CONFIG_NAME, PICKLED_NAME, SAFETENSORS_NAME

NAME = "tiny-lora"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def good(models, tmp_path_factory):
    """qwen3, q_proj + v_proj, r=8: the adapter every error case breaks in one way."""
    return make_adapter(models["qwen3"], tmp_path_factory.mktemp("good") / "adapter", r=8, alpha=16)


def spec_of(model_path, modules=SUPPORTED_MODULES):
    return model_spec_from_hf_config(read_json(model_path / "config.json"), modules)


@pytest.fixture(scope="module")
def spec(models):
    return spec_of(models["qwen3"])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_model_spec_matches_transformers(arch):
    from transformers import AutoModelForCausalLM

    cfg = model_config(arch, vocab_size=384)
    cfg_dict = json.loads(cfg.to_json_string())  # as config.json holds it
    spec = model_spec_from_hf_config(cfg_dict)
    # Layer 0 and the global modules, by their last name.
    modules = {n.rsplit(".", 1)[-1]: m for n, m in AutoModelForCausalLM.from_config(cfg).named_modules()
               if "layers.1." not in n}
    assert spec.num_layers == 2 and spec.module_dims.keys() == set(SUPPORTED_MODULES) - set(EXPERT_MODULES)  # dense
    for module, dims in spec.module_dims.items():
        base = modules[module]
        actual = tuple(base.weight.shape) if module == "embed_tokens" else (base.in_features, base.out_features)
        assert dims == actual, module
    assert model_spec_from_hf_config(cfg_dict, ["q_proj"]).module_dims.keys() == {"q_proj"}
    with pytest.raises(ValueError, match="qkv_proj"):
        model_spec_from_hf_config(cfg_dict, ["qkv_proj"])


def peft_weights(model_path, adapter_path) -> dict:
    """{(layer, module): (lora_A, lora_B, scaling)} as PEFT itself loads the adapter."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), adapter_path)
    weights = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            layer = re.search(r"layers\.(\d+)\.", module_name)
            if "default" in module.lora_embedding_A:
                a, b = module.lora_embedding_A["default"], module.lora_embedding_B["default"]
            else:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            weights[int(layer[1]) if layer else -1, module_name.rsplit(".", 1)[-1]] = (
                a.detach(), b.detach(), module.scaling["default"])
    return weights


PEFT_CASES = {
    "regex": ("qwen3", {"gate_proj", "up_proj"}, dict(target_modules=r".*\.mlp\.(gate|up)_proj")),
    # all-linear leaves out lm_head; patterns match the end of the module path at a `.`.
    "all-linear-rslora-patterns": ("qwen3", set(LINEAR_MODULES), dict(
        target_modules="all-linear", use_rslora=True,
        rank_pattern={"down_proj": 4, "layers.1.self_attn.q_proj": 2}, alpha_pattern={"o_proj": 4})),
    "embed-lm_head": ("llama", {"embed_tokens", "lm_head", "q_proj", "v_proj"}, dict(
        r=4, alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj"], rank_pattern={"lm_head": 6})),
}


@pytest.mark.parametrize("case", PEFT_CASES)
def test_matches_peft(models, tmp_path, case):
    arch, target_modules, lora_kwargs = PEFT_CASES[case]
    path = make_adapter(models[arch], tmp_path / "adapter", seed=1, **lora_kwargs)
    adapter = load_adapter(NAME, str(path), spec_of(models[arch]), max_lora_rank=16)
    expected = peft_weights(models[arch], path)
    assert adapter.weights.keys() == expected.keys()
    assert adapter.target_modules == target_modules
    assert adapter.rank == max(a.shape[0] for a, _, _ in expected.values())
    for key, (lora_a, lora_b, scaling) in expected.items():
        weights = adapter.weights[key]
        for ours, theirs in ((weights.lora_a, lora_a), (weights.lora_b, lora_b)):
            assert ours.dtype == torch.float32 and ours.is_contiguous() and ours.device.type == "cpu"
            assert torch.equal(ours, theirs), key
        assert weights.scaling == pytest.approx(scaling), key


def broken(good, tmp_path, *, config=None, tensors=None, files=None):
    """A copy of `good` with its config dict, tensor dict or directory edited in place."""
    path = tmp_path / "broken"
    shutil.copytree(good, path)
    if config:
        cfg = read_json(path / CONFIG_NAME)
        config(cfg)
        (path / CONFIG_NAME).write_text(json.dumps(cfg))
    if tensors:
        state = load_file(path / SAFETENSORS_NAME)
        tensors(state)
        save_file(state, path / SAFETENSORS_NAME)
    if files:
        files(path)
    return path


def renamed(pattern, replacement):
    """Rename the tensor keys matching the regex `pattern`."""
    return lambda state: state.update(
        {re.sub(pattern, replacement, k): state.pop(k) for k in list(state) if re.search(pattern, k)})


def value_at(key, value):
    return lambda state: state[key].__setitem__((0, 0), value)


# (config edit, tensor edit, directory edit, error, fragments of the message besides the adapter name)
BROKEN = {
    "no-config": (None, None, lambda d: (d / CONFIG_NAME).unlink(), AdapterConfigError, [CONFIG_NAME, "missing"]),
    "bad-json": (None, None, lambda d: (d / CONFIG_NAME).write_text("{"), AdapterConfigError, ["not valid JSON"]),
    "not-lora": (lambda c: c.update(peft_type="IA3"), None, None, AdapterConfigError, ["'IA3'", "'LORA'"]),
    "no-r": (lambda c: c.pop("r"), None, None, AdapterConfigError, ["'r' missing"]),
    "dora": (lambda c: c.update(use_dora=True), None, None, AdapterUnsupportedError, ["use_dora=True"]),
    "bias": (lambda c: c.update(bias="lora_only"), None, None, AdapterUnsupportedError, ["bias='lora_only'", "'none'"]),
    "modules-to-save": (lambda c: c.update(modules_to_save=["lm_head"]), None, None, AdapterUnsupportedError,
                        ["modules_to_save=['lm_head']"]),
    "lora-bias": (lambda c: c.update(lora_bias=True), None, None, AdapterUnsupportedError, ["lora_bias=True"]),
    "pickled-only": (None, None, lambda d: (d / SAFETENSORS_NAME).rename(d / PICKLED_NAME), AdapterUnsupportedError,
                     [PICKLED_NAME, SAFETENSORS_NAME]),
    "no-weights": (None, None, lambda d: (d / SAFETENSORS_NAME).unlink(), AdapterNotFoundError, [SAFETENSORS_NAME]),
    "rank-pattern-disagrees": (lambda c: c.update(rank_pattern={"q_proj": 4}), None, None, AdapterShapeError,
                               [Q_A, "[8, 64]", "expected [4, 64]"]),
    "a-without-b": (None, lambda s: s.pop(Q_B), None, AdapterWeightsError, [Q_A, "lora_B"]),
    "nan": (None, value_at(Q_B, float("nan")), None, AdapterWeightsError, [Q_B, "non-finite"]),
    "inf": (None, value_at(Q_A, float("inf")), None, AdapterWeightsError, [Q_A, "non-finite"]),
    "-inf": (None, value_at(Q_B, float("-inf")), None, AdapterWeightsError, [Q_B, "non-finite"]),
    "shape": (None, lambda s: s.update({Q_A: s[Q_A][:, :32].contiguous()}), None, AdapterShapeError,
              [Q_A, "[8, 32]", "expected [8, 64]"]),
    "unknown-module": (None, renamed(r"layers\.0\.self_attn\.q_proj", "layers.0.self_attn.qkv_proj"), None,
                       AdapterTargetError, ["'qkv_proj'", "q_proj"]),
    "layer-beyond-model": (None, renamed(r"layers\.1\.", "layers.5."), None, AdapterTargetError,
                           ["layer 5", "num_layers 2"]),
    "misplaced": (None, renamed(r"layers\.0\.self_attn\.q_proj", "layers.0.self_attn.lm_head"), None,
                  AdapterTargetError, ["'lm_head'", "outside the decoder layers"]),
    "duplicate": (None, lambda s: s.update({k.replace("model.layers", "model.model.layers"): v.clone()
                                            for k, v in list(s.items())}), None, AdapterTargetError,
                  ["'model.model.layers.0.self_attn.q_proj'", "one per layer"]),
    "mixed-kinds": (None, renamed(r"q_proj\.lora_A\.weight", "q_proj.lora_embedding_A"), None, AdapterWeightsError,
                    ["'model.layers.0.self_attn.q_proj' mixes"]),
    "wrong-kind": (None, renamed(r"q_proj\.lora_([AB])\.weight", r"q_proj.lora_embedding_\1"), None,
                   AdapterWeightsError, ["lora_embedding_A", "expected lora_A/B.weight"]),
    "dora-tensor": (None, lambda s: s.update({Q_A.replace("lora_A.weight", "lora_magnitude_vector"): torch.ones(128)}),
                    None, AdapterUnsupportedError, ["lora_magnitude_vector"]),
}


def expect(error, fragments, source, spec, max_lora_rank=16, **kwargs):
    with pytest.raises(error) as info:
        load_adapter(NAME, str(source), spec, max_lora_rank=max_lora_rank, **kwargs)
    for fragment in [repr(NAME), *fragments]:
        assert fragment in str(info.value)


@pytest.mark.parametrize("case", BROKEN)
def test_broken_adapter_refused(spec, good, tmp_path, case):
    config, tensors, files, error, fragments = BROKEN[case]
    expect(error, fragments, broken(good, tmp_path, config=config, tensors=tensors, files=files), spec)


def test_base_layer_copies_ignored(spec, good, tmp_path):
    base_layer = Q_A.replace("lora_A", "base_layer")
    path = broken(good, tmp_path, tensors=lambda s: s.update({base_layer: torch.zeros(128, 64)}))
    adapter = load_adapter(NAME, str(path), spec, max_lora_rank=8)
    assert adapter.target_modules == {"q_proj", "v_proj"} and adapter.rank == 8


def test_limits_of_the_server(models, spec, good):
    expect(AdapterRankError, ["q_proj", "rank 8", "max_lora_rank 4"], good, spec, max_lora_rank=4)
    expect(AdapterTargetError, ["'v_proj'", "['q_proj']"], good, spec_of(models["qwen3"], ["q_proj"]))


def test_adapter_roots(spec, good, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(good, root / "inside")
    shutil.copytree(good, outside)
    shutil.copytree(good, tmp_path / "root-sibling")
    (root / "escape").symlink_to(outside)
    (root / "weights-escape").mkdir()
    shutil.copy(good / CONFIG_NAME, root / "weights-escape")
    (root / "weights-escape" / SAFETENSORS_NAME).symlink_to(outside / SAFETENSORS_NAME)
    (tmp_path / "root-link").symlink_to(root)
    for allowed_root in (root, tmp_path / "root-link"):
        assert load_adapter(NAME, str(root / "inside"), spec, max_lora_rank=8, adapter_roots=[str(allowed_root)])
    # outside, missing, not a directory, a symlink out: one message, which tells nothing of the path
    for source in (outside, root / ".." / "outside", root / "escape", tmp_path / "root-sibling", root / "missing",
                   tmp_path / "no-such-dir", outside / CONFIG_NAME, root / "inside" / CONFIG_NAME):
        with pytest.raises(AdapterPathError) as info:
            load_adapter(NAME, str(source), spec, max_lora_rank=8, adapter_roots=[str(root)])
        assert str(info.value) == (f"adapter {NAME!r}: {str(source)!r} is not an adapter directory inside the "
                                   "allowed adapter roots")
    expect(AdapterPathError, [SAFETENSORS_NAME, "resolves outside the allowed adapter roots"], root / "weights-escape",
           spec, adapter_roots=[str(root)])
    expect(AdapterNotFoundError, ["not a directory"], "./no/such/adapter", spec)


@pytest.fixture
def offline_hub(good, tmp_path, monkeypatch):
    """A Hub cache holding acme/tiny-lora at COMMIT (refs main and v1), with the Hub unreachable."""
    repo = tmp_path / "hub" / "models--acme--tiny-lora"
    shutil.copytree(good, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    for ref in ("main", "v1"):
        (repo / "refs" / ref).write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("source", ["acme/tiny-lora", "acme/tiny-lora@v1", f"acme/tiny-lora@{COMMIT}"])
def test_hub_id_from_offline_cache(spec, good, tmp_path, offline_hub, source):
    # Roots restrict local paths only; a Hub id passes them (the engine refuses it by default then:
    # see test_hub_ids_can_be_refused).
    adapter = load_adapter(NAME, source, spec, max_lora_rank=8, adapter_roots=[str(tmp_path / "root")])
    local = load_adapter(NAME, str(good), spec, max_lora_rank=8)
    assert adapter.source == source and adapter.weights.keys() == local.weights.keys()
    assert all(torch.equal(adapter.weights[k].lora_b, local.weights[k].lora_b) for k in local.weights)


def test_hub_ids_can_be_refused(spec, good, tmp_path, offline_hub):
    """The engine refuses them when adapter_roots is set (EngineConfig.hub_adapters_allowed)."""
    with pytest.raises(AdapterPathError, match="Hub ids are not allowed") as info:
        load_adapter(NAME, "acme/tiny-lora", spec, max_lora_rank=8, adapter_roots=[str(tmp_path)], allow_hub=False)
    assert repr(NAME) in str(info.value) and "allow_hub_adapters=True" in str(info.value)
    local = load_adapter(NAME, str(good), spec, max_lora_rank=8, allow_hub=False)   # local paths still load
    assert local.weights


def test_engine_config_allows_hub_ids_only_without_roots_unless_told():
    from workers import EngineConfig
    assert EngineConfig(model="m").hub_adapters_allowed
    assert not EngineConfig(model="m", adapter_roots=("/srv/adapters",)).hub_adapters_allowed
    assert EngineConfig(model="m", adapter_roots=("/srv/adapters",), allow_hub_adapters=True).hub_adapters_allowed
    assert not EngineConfig(model="m", allow_hub_adapters=False).hub_adapters_allowed


def test_hub_id_not_in_offline_cache(spec, offline_hub):
    expect(AdapterNotFoundError, ["'acme/missing'"], "acme/missing", spec)
    expect(AdapterNotFoundError, ["'acme/tiny-lora@v2'"], "acme/tiny-lora@v2", spec)
