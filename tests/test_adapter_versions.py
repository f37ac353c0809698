"""Adapter versions (issue 19): loading a name again with other weights makes a new version beside the old;
requests running on the old one finish on it, requests admitted after the load get the new one; the same
weights again are a no-op; unload then load of other files works at once, under traffic."""
from __future__ import annotations

import shutil

import pytest

from factories import PROMPTS, make_adapter
from lora_fixtures import ALL7
from workers import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow   # make test-fast skips it: engines swapping adapter versions

LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


@pytest.fixture(scope="module")
def weights(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("versions")
    return {v: make_adapter(model, out / v, r=8, alpha=16, target_modules=ALL7, seed=seed)
            for seed, v in enumerate(("v1", "v2"))}


def _engine(model, **kw):
    return LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_lora_rank=16,
                                  max_model_len=128, **kw))


def _reference(model, source, prompts):
    engine = _engine(model)
    engine.load_adapter("A", str(source))
    return [o.token_ids for o in engine.generate(prompts, LONG, adapters=["A"] * len(prompts))]


def _finish(engine, ids):
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return [outs[i] for i in ids]


@pytest.mark.parametrize("how", ["replace_same_path", "replace_other_path", "unload_then_load"])
@pytest.mark.parametrize("slots", [1, 4])
def test_running_requests_keep_their_version_new_ones_get_the_new(model, weights, tmp_path, how, slots):
    old_prompts, new_prompts = PROMPTS[:4], PROMPTS[4:8]
    want_old = _reference(model, weights["v1"], old_prompts)
    want_new = _reference(model, weights["v2"], new_prompts)
    path = tmp_path / "A"
    shutil.copytree(weights["v1"], path)
    engine = _engine(model, max_loras_per_batch=slots)
    assert engine.load_adapter("A", str(path)) == "loaded"
    old = [engine.add_request(p, LONG, adapter="A") for p in old_prompts]
    for _ in range(6):
        engine.step()                                  # the old requests are decoding
    if how == "replace_same_path":                     # a trainer saved new weights into the directory
        shutil.rmtree(path)
        shutil.copytree(weights["v2"], path)
        assert engine.load_adapter("A", str(path)) == "replaced"
    elif how == "replace_other_path":
        assert engine.load_adapter("A", str(weights["v2"])) == "replaced"
    else:
        engine.unload_adapter("A")
        assert engine.load_adapter("A", str(weights["v2"])) == "loaded"   # at once, old requests still running
    new = [engine.add_request(p, LONG, adapter="A") for p in new_prompts]
    done = _finish(engine, old + new)
    got_old, got_new = done[:len(old)], done[len(old):]
    assert [o.token_ids for o in got_old] == want_old
    assert [o.token_ids for o in got_new] == want_new
    assert all(o.finish_reason == "length" for o in got_old + got_new)
    # the old version is freed once its requests ended: only the current one is resident
    cache = engine.adapters.cache
    assert cache.stats()["referenced"] == 0 and list(engine.list_adapters()) == ["A"]
    assert [k for k in cache._resident] == [engine.adapters.current("A")]


def test_loading_the_same_weights_again_is_a_no_op(model, weights):
    engine = _engine(model)
    assert engine.load_adapter("A", str(weights["v1"])) == "loaded"
    key, version = engine.adapters.current("A"), engine.adapters.version("A")
    assert engine.load_adapter("A", str(weights["v1"])) == "unchanged"
    assert (engine.adapters.current("A"), engine.adapters.version("A")) == (key, version)
    assert engine.load_adapter("A", str(weights["v2"])) == "replaced" and engine.adapters.version("A") != version


def test_a_bad_new_version_leaves_the_current_one_serving(model, weights, tmp_path):
    engine = _engine(model)
    engine.load_adapter("A", str(weights["v1"]))
    broken = tmp_path / "broken"
    shutil.copytree(weights["v1"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception, match="cannot read adapter_model.safetensors"):
        engine.load_adapter("A", str(broken))
    assert engine.list_adapters() == {"A": str(weights["v1"])}
    [out] = engine.generate([PROMPTS[0]], LONG, adapters=["A"])
    assert out.token_ids == _reference(model, weights["v1"], [PROMPTS[0]])[0]


def test_the_same_weights_from_another_path_are_the_same_version(model, weights, tmp_path):
    """Same content, new source: "replaced" (the source changed), the version and the resident copy are kept,
    a running request is undisturbed, and the next page-in reads the new path (the old one is gone)."""
    old, moved = tmp_path / "old", tmp_path / "moved"
    shutil.copytree(weights["v1"], old)
    shutil.copytree(weights["v1"], moved)
    engine = _engine(model, max_loaded_loras=1, max_loras_per_batch=1)
    engine.load_adapter("A", str(old))
    ref, version = engine.adapters.current("A"), engine.adapters.version("A")
    running = engine.add_request(PROMPTS[0], LONG, adapter="A")
    engine.step()
    assert engine.load_adapter("A", str(moved)) == "replaced"
    assert engine.adapters.current("A") == ref and engine.adapters.current("A").source == str(moved)
    assert engine.adapters.version("A") == version and engine.list_adapters() == {"A": str(moved)}
    want = _reference(model, weights["v1"], PROMPTS[:2])
    assert [o.token_ids for o in _finish(engine, [running])] == want[:1]
    shutil.rmtree(old)
    engine.load_adapter("B", str(weights["v2"]))       # evicts A (one adapter in host memory)
    assert not engine.adapters.cache.is_resident(ref)
    [out] = engine.generate([PROMPTS[1]], LONG, adapters=["A"])   # paged in again, from the new path
    assert (out.finish_reason, out.token_ids) == ("length", want[1])
