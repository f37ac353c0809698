"""Acceptance: mixed-adapter batches equal PEFT token-for-token, with and without paging."""
import pytest

from factories import PROMPTS
from lora_fixtures import ADAPTERS, PeftOracle, build_adapters
from workers import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow   # make test-fast skips it: PEFT oracles on two architectures

MAX_TOKENS = 24
NAMES = [None, *ADAPTERS]
REQUESTS = [(PROMPTS[i % len(PROMPTS)], NAMES[i % len(NAMES)]) for i in range(24)]
LIMITS = {"generous": dict(max_loras_per_batch=8, max_loaded_loras=8),
          "paging": dict(max_loras_per_batch=2, max_loaded_loras=3)}


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def setup(request, model_dir, tmp_path_factory):
    path = model_dir(request.param)
    adapters = build_adapters(path, tmp_path_factory.mktemp(f"adapters-{request.param}"))
    oracle = PeftOracle(path, adapters)
    expected = [oracle.greedy(prompt, name, MAX_TOKENS) for prompt, name in REQUESTS]
    base = {prompt: oracle.greedy(prompt, None, MAX_TOKENS)[0] for prompt in dict.fromkeys(p for p, _ in REQUESTS)}
    for name in ADAPTERS:  # every adapter changes the output somewhere, so parity is not trivial
        assert any(tokens != base[p] for (p, a), (tokens, _) in zip(REQUESTS, expected) if a == name), name
    return path, adapters, expected


@pytest.mark.parametrize("limits", list(LIMITS))
def test_mixed_batch_matches_peft(setup, limits):
    path, adapters, expected = setup
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_lora_rank=64,
                                    **LIMITS[limits]))
    for name, source in adapters.items():
        engine.load_adapter(name, str(source))
    outs = engine.generate([p for p, _ in REQUESTS], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                    ignore_eos=True),
                           adapters=[a for _, a in REQUESTS])
    for (prompt, name), out, (tokens, logprobs) in zip(REQUESTS, outs, expected):
        assert out.token_ids == tokens, (prompt, name)
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-4, (prompt, name)
    lora = engine.stats()["lora"]
    if limits == "paging":
        assert lora["slots"]["evictions"] > 0, "slot eviction never happened"
        assert lora["host_cache"]["evictions"] > 0 and lora["host_cache"]["loads"] > len(adapters), \
            "host paging never happened"
