"""Acceptance (issue 20): Qwen3-MoE with LoRA, exact against HF transformers 5.24 + PEFT 0.21 in fp32.

Tiny random Qwen3-MoE checkpoints, top-2 of 8 experts, sparse and dense layers (mlp_only_layers and
decoder_sparse_step), norm_topk_prob both ways, both checkpoint layouts. Adapters: attention only,
PEFT target_parameters on the fused experts (+ q_proj), per-expert 2-D keys, a dense-layer MLP; all
mixed with the base in one batch. TP 2 is tests/test_moe_tp.py.
"""
import pytest
import torch

from deployments.errors import classify
from factories import PROMPTS, engine_with_adapters, make_adapter
from lora.errors import AdapterError
from moe_factories import (MergedOracle, PerAdapterOracle, make_expert_adapter, make_moe_model, write_dense_mlp_adapter,
                           write_per_expert_adapter)
from workers import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow   # make test-fast skips it: Qwen3-MoE engines against HF + PEFT

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
NAMES = [None, "attn", "experts", "per_expert", "dense_mlp"]
REQUESTS = [(PROMPTS[i // len(NAMES)], NAMES[i % len(NAMES)]) for i in range(4 * len(NAMES))]   # each prompt x each
EVERYTHING = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                  repetition_penalty=1.2, min_tokens=4, logit_bias={3: 5.0, 7: -100.0}, top_logprobs=3)


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """(model path, adapters) of the reference model."""
    out = tmp_path_factory.mktemp("moe")
    path = make_moe_model(out / "model")
    adapters = {
        "attn": make_adapter(path, out / "attn", r=8, alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], seed=1),
        "experts": make_expert_adapter(path, out / "experts", r=4, alpha=8, target_modules=["q_proj"], seed=2),
        "per_expert": write_per_expert_adapter(path, out / "per_expert", r=8, alpha=16, seed=3)[0],
        "dense_mlp": write_dense_mlp_adapter(path, out / "dense_mlp", layers=(1,), r=8, alpha=16, seed=4),
    }
    return path, adapters


@pytest.fixture(scope="module")
def oracles(moe_files):
    """The HF oracle of each adapter name (None: the base), loaded once for the module."""
    path, adapters = moe_files
    peft = PerAdapterOracle(path, {name: adapters[name] for name in ("attn", "experts")})
    return {None: peft, "attn": peft, "experts": peft, "per_expert": MergedOracle(path, adapters["per_expert"]),
            "dense_mlp": MergedOracle(path, adapters["dense_mlp"])}


@pytest.fixture(scope="module")
def moe(moe_files, oracles):
    """(model path, adapters, expected greedy (tokens, logprobs) per request) on the reference model."""
    path, adapters = moe_files
    expected = [oracles[a].greedy(p, a, MAX_TOKENS) for p, a in REQUESTS]
    base = {p: tokens for (p, a), (tokens, _) in zip(REQUESTS, expected) if a is None}
    for name in adapters:   # every adapter changes some output, so parity is not trivial
        assert any(t != base[p] for (p, a), (t, _) in zip(REQUESTS, expected) if a == name), name
    return path, adapters, expected


def make_engine(path, adapters, **kw) -> LLMEngine:
    return engine_with_adapters(path, adapters, max_lora_rank=16, max_model_len=256,
                                **{"max_loras_per_batch": 4, **kw})


def generate(engine, requests=REQUESTS, params=GREEDY):
    return engine.generate([p for p, _ in requests], params, adapters=[a for _, a in requests])


def assert_matches(outs, expected, requests=REQUESTS, tolerance=1e-3):
    for (prompt, adapter), out, (tokens, logprobs) in zip(requests, outs, expected):
        assert out.token_ids == tokens, (prompt, adapter)
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < tolerance, (prompt, adapter)


@pytest.mark.parametrize("layout", [
    dict(),                                                                    # per-expert keys, renormalised top-k
    dict(fused=True, norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2),   # fused keys, layer 1 sparse
])
def test_base_matches_hf(tmp_path, hf_model, layout):
    path = make_moe_model(tmp_path / "model", seed=5, **layout)
    model, tokenizer = hf_model(path)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", enable_lora=False))
    sparse = [i for i, layer in enumerate(engine.executor.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse == ([1] if layout else [0, 2])
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        ref = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        tokens = ref.sequences[0, ids.shape[1]:].tolist()
        assert out.token_ids == tokens, prompt
        logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(ref.logits, tokens)]
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-3, prompt


@pytest.mark.parametrize("options", [dict(), dict(lora_backend="torch_native"), dict(emulate_capture=True),
                                     dict(max_loras_per_batch=2, max_loaded_loras=3), dict(max_expert_loras=1),
                                     dict(max_expert_loras=1, emulate_capture=True)])
def test_mixed_batch_matches_hf_and_peft(moe, options):
    """Base, attention-only, target_parameters experts, per-expert 2-D and dense-MLP adapters in one batch."""
    path, adapters, expected = moe
    engine = make_engine(path, adapters, **options)
    try:
        assert_matches(generate(engine), expected)
        if options.get("emulate_capture"):
            assert engine.executor.graph_runner.graphs, "no decode graph was captured"
        if "max_loaded_loras" in options:
            assert engine.stats()["lora"]["slots"]["evictions"] > 0, "slot eviction never happened"
        if "max_expert_loras" in options:   # two adapters with experts share one expert slot; the others need none
            slots = engine.stats()["lora"]["expert_slots"]
            assert slots["num_slots"] == 1 and slots["evictions"] > 0, slots
    finally:
        engine.close()


def test_chunked_prefill_and_prefix_cache_hits(moe, oracles):
    path, adapters, _ = moe
    long = " ".join(PROMPTS)
    requests = [(long, a) for a in NAMES]
    expected = [oracles[a].greedy(p, a, MAX_TOKENS) for p, a in requests]
    engine = make_engine(path, adapters, max_num_batched_tokens=16, max_num_seqs=8, kv_block_size=4)
    try:
        for _ in range(2):   # the second time from the prefix cache
            assert_matches(generate(engine, requests), expected, requests)
        assert engine.stats()["prefix_cache"]["hit_tokens"] > 100
    finally:
        engine.close()


def test_sampler_options_logprobs_and_n_under_capture(moe):
    """Every sampler option, top logprobs and several samples of one prompt: the captured decode (CPU op tape)
    gives exactly the eager engine's output on a MoE model with expert adapters."""
    path, adapters, _ = moe
    prompts = [PROMPTS[1]] * 3 + PROMPTS[2:5]                       # n = 3 of one prompt, with other seeds
    names = ["experts", "experts", "experts", "per_expert", None, "attn"]
    params = [SamplingParams(max_tokens=10, seed=i, **EVERYTHING) for i in range(len(prompts))]
    outs = []
    for options in (dict(), dict(emulate_capture=True)):
        engine = make_engine(path, adapters, **options)
        try:
            outs.append(engine.generate(prompts, params, adapters=names))
        finally:
            engine.close()
    eager, captured = outs
    assert [o.token_ids for o in eager] == [o.token_ids for o in captured]
    assert len({tuple(o.token_ids) for o in eager[:3]}) > 1, "three seeds of one prompt gave one sample"
    for a, b in zip(eager, captured):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert all(len(top) == 3 for top in a.top_logprobs)


def test_router_as_a_target_is_refused_naming_it(moe, tmp_path):
    path, adapters, _ = moe
    engine = make_engine(path, {})
    try:
        with pytest.raises(AdapterError, match=r"router \(mlp.gate\)") as info:
            engine.load_adapter("router", str(make_expert_adapter(path, tmp_path / "router", target_modules=["q_proj"],
                                                                 parameters=["mlp.gate.weight", "mlp.experts.down_proj"])))
        assert classify(info.value)[0] == 400
        assert engine.list_adapters() == {}
    finally:
        engine.close()
