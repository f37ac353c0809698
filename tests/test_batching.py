"""Acceptance: continuous batching and preemption under KV pressure keep every request's tokens."""
import pytest

from factories import PROMPTS
from workers import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow   # make test-fast skips it: whole engines under KV pressure

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def alone(engine, prompts, params=GREEDY):
    return [engine.generate(p, params)[0].token_ids for p in prompts]


def test_requests_added_mid_decode_match_solo_runs(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu"))
    expected = alone(engine, PROMPTS)
    ids = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    results = {}
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:        # a new request joins every third step
            i, prompt = pending.pop(0)
            ids[engine.add_request(prompt, GREEDY)] = i
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out.token_ids
        steps += 1
        assert steps < 2000
    assert [results[i] for i in range(len(PROMPTS))] == expected
    assert engine.stats()["free_kv_blocks"] == engine.stats()["total_kv_blocks"]


def test_preemption_under_kv_pressure_keeps_tokens(model_dir):
    path = str(model_dir("llama"))
    roomy = LLMEngine(EngineConfig(model=path, device="cpu", kv_block_size=4, max_model_len=64))
    expected = [o.token_ids for o in roomy.generate(PROMPTS, GREEDY)]
    # 20 usable blocks of 4 tokens: enough for one sequence, far from all eight at once.
    tight = LLMEngine(EngineConfig(model=path, device="cpu", kv_block_size=4, max_model_len=64, num_kv_blocks=21))
    outs = tight.generate(PROMPTS, GREEDY)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    assert tight.stats()["free_kv_blocks"] == 20


def test_abort_frees_blocks_and_others_finish(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu"))
    expected = alone(engine, PROMPTS[:2])
    a = engine.add_request(PROMPTS[0], GREEDY)
    b = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    engine.step()
    engine.abort(b)
    done = {}
    for _ in range(100):
        for out in engine.step():
            done[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert done[a].token_ids == expected[0] and b not in done
    assert engine.stats()["free_kv_blocks"] == engine.stats()["total_kv_blocks"]


def test_max_num_seqs_bounds_the_batch(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", max_num_seqs=2))
    for p in PROMPTS[:5]:
        engine.add_request(p, GREEDY)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.stats()["running"])
    assert peak == 2


def test_failed_step_ends_its_requests_and_engine_recovers(model_dir, monkeypatch):
    engine = LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu"))
    expected = alone(engine, PROMPTS[:1])[0]
    rid = engine.add_request(PROMPTS[0], GREEDY)

    def broken(plan):                       # fault injection: the device step raises once
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.executor, "execute", broken)
    try:
        engine.step()
        raise AssertionError("the step should have raised")
    except RuntimeError as exc:
        assert "device lost" in str(exc)
    monkeypatch.undo()
    assert not engine.has_unfinished() and rid not in engine._seqs
    assert engine.stats()["free_kv_blocks"] == engine.stats()["total_kv_blocks"]
    assert alone(engine, PROMPTS[:1])[0] == expected
