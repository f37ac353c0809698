"""Acceptance: each invalid adapter is refused with its specific error; the engine keeps serving."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import PROMPTS, make_adapter
from lora import errors
from workers import EngineConfig, LLMEngine, SamplingParams

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


@pytest.fixture(scope="module")
def setup(model_dir, tmp_path_factory):
    path = model_dir("qwen3")
    root = tmp_path_factory.mktemp("adapters")
    good = make_adapter(path, root / "good", r=8, target_modules=["q_proj", "v_proj"])
    big = make_adapter(path, root / "big", r=32, target_modules=["q_proj"])
    other = make_adapter(model_dir("llama"), root / "other-model", r=8, target_modules=["q_proj", "o_proj"])
    outside = make_adapter(path, tmp_path_factory.mktemp("elsewhere") / "x", r=8)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", max_lora_rank=16, adapter_roots=(str(root),),
                                    lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj")))
    return engine, root, good, big, other, outside


def variant(root, good, name, edit_config=None, edit_weights=None, drop=None):
    out = root / name
    shutil.copytree(good, out, dirs_exist_ok=True)
    if edit_config:
        cfg = json.loads((out / CONFIG).read_text())
        edit_config(cfg)
        (out / CONFIG).write_text(json.dumps(cfg))
    if edit_weights:
        tensors = load_file(out / WEIGHTS)
        edit_weights(tensors)
        save_file(tensors, out / WEIGHTS)
    if drop:
        (out / drop).unlink()
    return out


def _nan(tensors):
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = torch.full_like(tensors[key], float("nan"))


def _mlp_key(tensors):
    for key in [k for k in tensors if "q_proj" in k]:
        tensors[key.replace("self_attn.q_proj", "mlp.gate_proj")] = tensors.pop(key)


CASES = {
    "no-config": (dict(drop=CONFIG), errors.AdapterConfigError, "adapter_config.json"),
    "empty-config": (dict(edit_config=lambda c: c.clear()), errors.AdapterConfigError, "r"),
    "dora": (dict(edit_config=lambda c: c.update(use_dora=True)), errors.AdapterUnsupportedError, "use_dora"),
    "bias": (dict(edit_config=lambda c: c.update(bias="all")), errors.AdapterUnsupportedError, "bias"),
    "save": (dict(edit_config=lambda c: c.update(modules_to_save=["lm_head"])), errors.AdapterUnsupportedError,
             "modules_to_save"),
    "nan": (dict(edit_weights=_nan), errors.AdapterWeightsError, "finite"),
    "gate": (dict(edit_weights=_mlp_key), errors.AdapterTargetError, "gate_proj"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_adapter_refused_and_engine_keeps_serving(setup, case):
    engine, root, good, *_ = setup
    kwargs, error, field = CASES[case]
    with pytest.raises(error, match=case) as info:
        engine.load_adapter(case, str(variant(root, good, case, **kwargs)))
    assert field in str(info.value)
    assert case not in engine.list_adapters()
    _still_serves(engine, good)


def test_rank_shape_and_roots(setup):
    engine, root, good, big, other, outside = setup
    with pytest.raises(errors.AdapterRankError, match=r"big.*32.*16|big.*16.*32"):
        engine.load_adapter("big", str(big))
    with pytest.raises(errors.AdapterShapeError, match="other"):
        engine.load_adapter("other", str(other))
    with pytest.raises(errors.AdapterPathError, match="outside.*not an adapter directory inside"):
        engine.load_adapter("outside", str(outside))
    with pytest.raises(errors.AdapterPathError, match="missing.*not an adapter directory inside"):
        engine.load_adapter("missing", str(root / "does-not-exist"))   # the same refusal as outside
    assert sorted(engine.list_adapters()) in ([], ["good"])
    _still_serves(engine, good)


def _still_serves(engine, good):
    engine.load_adapter("good", str(good))
    outs = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0.0), adapters=["good", None])
    assert all(o.finish_reason in ("length", "stop") and o.token_ids for o in outs)
