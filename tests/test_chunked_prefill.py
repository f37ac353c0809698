"""Acceptance (scheduling): chunked prefill mixed with decodes, and adapter-aware prefix caching, are exact.

Greedy tokens equal HF transformers + PEFT in fp32 (max |dlogprob| < 1e-3) for base and mixed-adapter
batches, with budgets of 16 and 64 tokens per step (every long prompt runs in several chunks beside
other requests' decodes), with the second request of a prompt served from the prefix cache, and with a
prompt cached under one adapter asked for under another (no hit: different weights, different KV).
"""
import shutil

import pytest

from factories import PROMPTS, make_adapter
from lora_fixtures import ADAPTERS, PeftOracle
from workers import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow   # make test-fast skips it: PEFT oracles under chunking

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
NAMES = [None, "r4_all", "r16_emb_head"]
LONG = [" ".join(PROMPTS), PROMPTS[5] + " " + PROMPTS[3], PROMPTS[3] + " " + PROMPTS[2] + " " + PROMPTS[6]]
PROMPTS_ALL = LONG + PROMPTS[:4]
REQUESTS = [(p, NAMES[i % 3]) for i, p in enumerate(PROMPTS_ALL)] + [(LONG[0], "r4_all"), (LONG[1], None)]


@pytest.fixture(scope="module")
def setup(model_dir, tmp_path_factory):
    path = model_dir("qwen3")
    out = tmp_path_factory.mktemp("chunk-adapters")
    adapters = {name: make_adapter(path, out / name, seed=i, **ADAPTERS[name]) for i, name in enumerate(NAMES[1:])}
    oracle = PeftOracle(path, adapters)
    expected = {(p, a): oracle.greedy(p, a, MAX_TOKENS) for p in PROMPTS_ALL for a in NAMES}
    return path, adapters, oracle, expected


def make_engine(path, adapters, **kw):
    kw.setdefault("max_model_len", 256)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_lora_rank=16, **kw))
    for name, source in adapters.items():
        engine.load_adapter(name, str(source))
    return engine


def run(engine, requests):
    return engine.generate([p for p, _ in requests], GREEDY, adapters=[a for _, a in requests])


def assert_exact(requests, outs, expected):
    for (prompt, adapter), out in zip(requests, outs):
        tokens, logprobs = expected[(prompt, adapter)]
        assert out.token_ids == tokens, (prompt[:30], adapter)
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-3, (prompt[:30], adapter)


@pytest.mark.parametrize("budget", [16, 64])
def test_chunked_prefill_with_mixed_adapters_matches_peft(setup, budget):
    path, adapters, oracle, expected = setup
    engine = make_engine(path, adapters, max_num_batched_tokens=budget, max_num_seqs=8,
                         enable_prefix_caching=False)
    longest = max(len(oracle.tokenizer(p).input_ids) for p in LONG)
    assert longest > budget, "the long prompts must need several chunks"
    assert_exact(REQUESTS, run(engine, REQUESTS), expected)
    stats = engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"] and stats["lora"]["host_cache"]["referenced"] == 0


def test_decodes_keep_running_while_a_long_prompt_is_chunked(setup):
    path, adapters, _, expected = setup
    engine = make_engine(path, adapters, max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=False)
    short = engine.add_request(PROMPTS[1], GREEDY, adapter="r4_all")
    engine.step()                                   # the short prompt is prefilled, then decodes
    long_id = engine.add_request(LONG[0], GREEDY, adapter="r16_emb_head")
    progress = []
    outs = {}
    while engine.has_unfinished():
        step = {o.request_id: o for o in engine.step()}
        outs.update(step)
        progress.append((short in step, long_id in step))
    # while the long prompt was still prefilling (no token yet), the short request got a token every step
    prefilling = [s for s, l in progress[:progress.index(next(p for p in progress if p[1]))]]
    assert len(prefilling) >= 3 and all(prefilling[:MAX_TOKENS - 1])
    assert_exact([(PROMPTS[1], "r4_all"), (LONG[0], "r16_emb_head")], [outs[short], outs[long_id]], expected)


@pytest.mark.parametrize("budget", [16, 64])
def test_prefix_cache_hits_are_exact_and_never_cross_adapters(setup, budget):
    path, adapters, _, expected = setup
    engine = make_engine(path, adapters, max_num_batched_tokens=budget, max_num_seqs=8, kv_block_size=4)
    first = run(engine, [(LONG[0], "r4_all")])
    assert first[0].num_cached_tokens == 0
    again = [(LONG[0], "r4_all"), (LONG[0], "r4_all"), (LONG[0], None), (LONG[0], "r16_emb_head")]
    outs = run(engine, again)
    assert_exact(again, outs, expected)
    n = len(first[0].prompt_token_ids)
    assert outs[0].num_cached_tokens == outs[1].num_cached_tokens == (n - 1) // 4 * 4   # all full blocks
    assert outs[2].num_cached_tokens == 0 and outs[3].num_cached_tokens == 0         # other weights: no hit
    # the base and the other adapter now have their own cached copies, and hit them
    outs = run(engine, [(LONG[0], None), (LONG[0], "r16_emb_head")])
    assert [o.num_cached_tokens for o in outs] == [(n - 1) // 4 * 4] * 2
    assert_exact([(LONG[0], None), (LONG[0], "r16_emb_head")], outs, expected)
    cache = engine.stats()["prefix_cache"]
    assert cache["hit_tokens"] == 4 * ((n - 1) // 4 * 4) and cache["queried_tokens"] == 7 * n


@pytest.mark.parametrize("budget", [16, 256])
def test_a_burst_of_one_prompt_computes_it_once(setup, budget):
    """Requests admitted in the same step as the one computing their prefix reuse its blocks at once."""
    path, adapters, _, expected = setup
    engine = make_engine(path, adapters, max_num_batched_tokens=budget, max_num_seqs=8, kv_block_size=4)
    burst = [(LONG[1], "r4_all")] * 3
    outs = run(engine, burst)
    assert_exact(burst, outs, expected)
    n = len(outs[0].prompt_token_ids)
    assert outs[0].num_cached_tokens == 0 and all(o.num_cached_tokens == (n - 1) // 4 * 4 for o in outs[1:])


def test_a_cached_prefix_serves_a_longer_prompt(setup):
    path, adapters, _, expected = setup
    engine = make_engine(path, adapters, max_num_batched_tokens=64, kv_block_size=4)
    run(engine, [(PROMPTS[3], "r16_emb_head")])
    requests = [(LONG[2], "r16_emb_head"), (PROMPTS[3], "r16_emb_head")]   # LONG[2] starts with PROMPTS[3]
    outs = run(engine, requests)
    assert outs[0].num_cached_tokens > 0 and outs[1].num_cached_tokens > 0
    assert_exact(requests, outs, expected)


def test_kv_pressure_with_cached_blocks_stays_exact(setup):
    path, adapters, _, expected = setup
    # 40 usable blocks of 4 tokens: the long prompts and their cached copies cannot all stay
    engine = make_engine(path, adapters, max_num_batched_tokens=32, max_num_seqs=8, kv_block_size=4,
                         num_kv_blocks=41, max_model_len=128)
    assert_exact(REQUESTS, run(engine, REQUESTS), expected)
    # the long prompts arrived last, so were admitted last (arrival order) and finished last: their blocks are
    # the ones still cached
    again = REQUESTS[-2:]
    outs = run(engine, again)
    assert_exact(again, outs, expected)
    assert all(o.num_cached_tokens > 0 for o in outs)
    stats = engine.stats()
    cache = stats["prefix_cache"]
    assert stats["num_preemptions"] > 0 and cache["hit_tokens"] > 0 and cache["evicted_blocks"] > 0
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_unchunked_engine_still_prefills_whole_prompts(setup):
    path, adapters, _, expected = setup
    engine = make_engine(path, adapters, enable_chunked_prefill=False, enable_prefix_caching=False)
    assert engine.max_num_batched_tokens >= engine.runtime.max_model_len
    assert_exact(REQUESTS, run(engine, REQUESTS), expected)
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        make_engine(path, {}, enable_chunked_prefill=False, max_num_batched_tokens=128)


@pytest.mark.parametrize("how", ["reloaded", "loaded_again", "paged_in_again"])
def test_an_adapter_read_again_from_new_files_never_hits_its_old_kv(setup, tmp_path, how):
    """A new version (unload + load, or load again over changed files) is new KV; a version paged back in
    after eviction must be the one that was checked: changed files then fail its requests, clearly."""
    path, adapters, _, _ = setup
    source = tmp_path / "x"
    shutil.copytree(adapters["r4_all"], source)
    engine = make_engine(path, {"x": source, "other": adapters["r16_emb_head"]}, kv_block_size=4,
                         max_loras_per_batch=1, max_loaded_loras=1)
    prompt = LONG[0]
    run(engine, [(prompt, "x")])
    assert engine.load_adapter("x", str(source)) == "unchanged"
    make_adapter(path, source, seed=99, **ADAPTERS["r4_all"])        # retrained, saved over the old files
    if how == "reloaded":
        engine.unload_adapter("x")
        assert engine.load_adapter("x", str(source)) == "loaded"
    elif how == "loaded_again":
        assert engine.load_adapter("x", str(source)) == "replaced"
    else:                                                             # evicted from host memory, read again
        run(engine, [(PROMPTS[0], "other")])
        assert not engine.adapters.cache.is_resident(engine.adapters.current("x"))
        [out] = run(engine, [(prompt, "x")])
        assert out.finish_reason == "error" and "its files changed since it was loaded" in out.error
        return
    [out] = run(engine, [(prompt, "x")])
    assert out.num_cached_tokens == 0
    tokens, logprobs = PeftOracle(path, {"x": source}).greedy(prompt, "x", MAX_TOKENS)
    assert out.token_ids == tokens and max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-3
    [again] = run(engine, [(prompt, "x")])                            # the new weights' KV is cached in turn
    assert again.num_cached_tokens > 0 and again.token_ids == tokens
