"""Acceptance: bad input raises a clear ValueError-family error and the engine keeps working."""
import pytest

from lora.errors import AdapterError
from workers import EngineConfig, LLMEngine, SamplingParams

OK = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", max_model_len=64))


@pytest.mark.parametrize("prompt, params, match", [
    ("", OK, "prompt is empty"),
    ([[]], OK, "prompt is empty"),
    ("word " * 80, OK, "exceeds max_model_len"),
    ("Hello", SamplingParams(max_tokens=64), "exceeds max_model_len"),
    ([1, 2, 10**6], OK, "outside the vocabulary"),
])
def test_bad_request_then_next_request_works(engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompt, params)
    assert engine.generate("Hello", OK)[0].finish_reason in ("length", "stop")
    assert engine.stats()["waiting"] == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_max_tokens_none_is_the_rest_of_the_context_resolved_with_the_prompt(engine):
    """SamplingParams' max_tokens None (a chat's default) is made a number once, where the prompt's length is known
    (workers/request.py), with min_tokens then checked against it; the caller's parameters stay as given."""
    params = SamplingParams(max_tokens=None, temperature=0.0, min_tokens=2)
    request = engine.make_request([1, 2, 3], params)
    assert request.params.max_tokens == 61 and params.max_tokens is None
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, 61\], got 62"):
        engine.make_request([1, 2, 3], SamplingParams(max_tokens=None, min_tokens=62))
    with pytest.raises(ValueError, match="no room to generate"):
        engine.make_request(list(range(1, 65)), SamplingParams(max_tokens=None))


def test_unknown_adapter_is_refused(engine):
    with pytest.raises(AdapterError, match="nope"):
        engine.generate("Hello", OK, adapters=["nope"])
    assert engine.generate("Hello", OK)[0].token_ids


@pytest.mark.parametrize("model, match", [("/no/such/model/dir", "does not exist"), ("", "non-empty")])
def test_wrong_model_path(model, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(EngineConfig(model=model, device="cpu"))


def test_bad_config_values(model_dir):
    with pytest.raises(ValueError, match="max_loaded_loras"):
        EngineConfig(model="x", max_loras_per_batch=8, max_loaded_loras=2)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", max_model_len=256, num_kv_blocks=4))
