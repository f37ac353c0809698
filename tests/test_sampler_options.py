"""Acceptance (OpenAI API completeness, engine side): penalties, logit_bias, min_tokens, min_p, top and
prompt logprobs against a plain-torch computation on Hugging Face's fp32 logits (|dlogprob| < 1e-3),
each request's options in one mixed batch beside requests without them."""
import pytest
import torch

from factories import PROMPTS
from workers import EngineConfig, LLMEngine, SamplingParams
from sampler_rows import step_rows
from workers.sampler import sample

STEPS = 12


@pytest.fixture(scope="module")
def setup(model_dir, hf_model):
    path = model_dir("qwen3")
    model, tokenizer = hf_model(path)
    return path, model, tokenizer


def penalize(logits, prompt, output, presence=0.0, frequency=0.0, repetition=1.0):
    """vLLM's definitions, written out: repetition over prompt and output tokens, then OpenAI's two."""
    counts = torch.zeros_like(logits)
    for t in output:
        counts[t] += 1
    seen = counts > 0
    seen[prompt] = True
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * (counts > 0).float()


@torch.no_grad()
def reference(model, prompt, params: SamplingParams, eos: set[int]):
    """Greedy decoding on HF logits with the request's processors; returns tokens, raw logprobs, top-k."""
    ids, out, logprobs, tops = list(prompt), [], [], []
    for _ in range(STEPS):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        raw = torch.log_softmax(logits, -1)
        if len(out) < params.min_tokens:
            logits[sorted(eos | set(params.stop_token_ids))] = float("-inf")
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        logits = penalize(logits, prompt, out, params.presence_penalty, params.frequency_penalty,
                          params.repetition_penalty)
        token = int(logits.argmax())
        out.append(token)
        logprobs.append(raw[token].item())
        values, top_ids = raw.topk(max(params.top_logprobs, 1))
        tops.append(list(zip(top_ids.tolist(), values.tolist()))[:params.top_logprobs])
        ids.append(token)
        if token in eos and not params.ignore_eos:
            break
    return out, logprobs, tops


def greedy(**options):
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, **options)


CASES = {
    "presence": greedy(presence_penalty=1.5),
    "frequency": greedy(frequency_penalty=1.2),
    "repetition": greedy(repetition_penalty=1.8),
    "all_penalties": greedy(presence_penalty=-0.7, frequency_penalty=0.6, repetition_penalty=1.3, top_logprobs=5),
    "logit_bias": greedy(logit_bias={11: 9.0, 42: 4.0, 5: -100.0}, top_logprobs=2),
    "top_logprobs": greedy(top_logprobs=20),
    "plain": greedy(),
}


@pytest.mark.slow   # a whole batch against a torch reference
def test_processors_match_a_plain_torch_reference_in_one_batch(setup):
    path, model, tokenizer = setup
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(CASES))]
    outs = engine.generate(prompts, list(CASES.values()))
    plain = [o.token_ids for o in engine.generate(prompts, CASES["plain"])]
    for (name, params), prompt, out, alone in zip(CASES.items(), prompts, outs, plain):
        assert (out.token_ids != alone) == (name not in ("top_logprobs", "plain")), name   # each option matters
        tokens, logprobs, tops = reference(model, tokenizer(prompt).input_ids, params, set())
        assert out.token_ids == tokens, name
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-3, name
        if params.top_logprobs:
            for got, want in zip(out.top_logprobs, tops):
                assert [t for t, _ in got] == [t for t, _ in want], name
                assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-3, name
        else:
            assert out.top_logprobs is None


def test_min_tokens_holds_back_eos_and_stop_tokens(setup):
    path, model, tokenizer = setup
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    free = engine.generate(PROMPTS[1], greedy())[0].token_ids
    engine.eos_token_ids = {free[0]}                         # the first greedy token is "EOS"
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, min_tokens=4, stop_token_ids=[free[1]])
    out = engine.generate(PROMPTS[1], params)[0]
    tokens, _, _ = reference(model, tokenizer(PROMPTS[1]).input_ids, params, {free[0]})
    assert out.token_ids == tokens and len(tokens) >= 4
    assert not set(tokens[:4]) & {free[0], free[1]}
    assert engine.generate(PROMPTS[1], SamplingParams(max_tokens=STEPS, temperature=0.0))[0].token_ids == [free[0]]


@pytest.mark.parametrize("budget", [8, 256])
def test_prompt_logprobs_match_the_reference_across_chunks(setup, budget):
    path, model, tokenizer = setup
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_num_batched_tokens=budget,
                                    max_num_seqs=8, kv_block_size=4))
    prompt = PROMPTS[5]
    ids = tokenizer(prompt).input_ids
    engine.generate(prompt, greedy())                        # cached: a prompt-logprobs request must not use it
    out = engine.generate(prompt, greedy(prompt_logprobs=3))[0]
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i, (logprob, top) in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(logprob - raw[i - 1, ids[i]].item()) < 1e-3
        values, top_ids = raw[i - 1].topk(3)
        assert [t for t, _ in top] == top_ids.tolist()
        assert max(abs(a - b) for (_, a), b in zip(top, values.tolist())) < 1e-3


def test_min_p_keeps_only_tokens_near_the_likeliest():
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0, -3.0, -5.0])
    n = 4000
    probs = torch.softmax(logits, -1)
    tensors, _ = step_rows(SamplingParams(min_p=0.5), list(range(n)), 6)
    tokens = sample(logits.expand(n, -1), tensors).tokens
    allowed = set((probs >= 0.5 * probs.max()).nonzero().flatten().tolist())
    assert set(tokens.tolist()) == allowed == {0, 1}
    shares = torch.bincount(tokens, minlength=6)[:2].float() / n
    expected = probs[:2] / probs[:2].sum()                   # renormalised over what min-p keeps
    assert torch.all((shares - expected).abs() < 0.03)


def test_invalid_options_name_the_field():
    for kwargs, field in ((dict(presence_penalty=3.0), "presence_penalty"), (dict(repetition_penalty=0.0),
                          "repetition_penalty"), (dict(min_p=1.5), "min_p"), (dict(top_logprobs=21), "top_logprobs"),
                          (dict(min_tokens=99), "min_tokens"), (dict(logit_bias={1: 101}), "logit_bias"),
                          (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
                          (dict(prompt_logprobs=-1), "prompt_logprobs")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
