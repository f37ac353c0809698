"""Acceptance: seeded sampling is reproducible whatever else is in the batch; sampler maths."""
import math

import torch

from factories import PROMPTS
from workers import EngineConfig, LLMEngine, SamplingParams
from sampler_rows import step_rows
from workers.sampler import sample


def test_seeded_request_is_batch_independent(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu"))
    mine = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    solo = engine.generate(PROMPTS[2], mine)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=t, seed=s, ignore_eos=True)
              for n, t, s in [(5, 1.0, 1), (30, 0.0, None), (12, 0.7, None), (24, 1.3, 9)]]
    crowd = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[5]],
                            [others[0], others[1], mine, others[2], others[3]])
    assert crowd[2].token_ids == solo
    other_seed = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert engine.generate(PROMPTS[2], other_seed)[0].token_ids != solo


def _tensors(n, temperature=1.0, top_k=-1, top_p=1.0, vocab=6, seed0=0):
    return step_rows(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
                     list(range(seed0, seed0 + n)), vocab)[0]


def test_sampling_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    tokens = sample(logits.expand(n, -1), _tensors(n)).tokens
    freq = torch.bincount(tokens, minlength=6).float() / n
    probs = torch.softmax(logits, -1)
    assert torch.all((freq - probs).abs() < 4 * torch.sqrt(probs * (1 - probs) / n) + 1e-3)


def test_top_k_top_p_and_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 4000
    result = sample(logits.expand(n, -1), _tensors(n, top_k=2))
    tokens, logprobs = result.tokens, result.logprobs
    assert set(tokens.tolist()) == {0, 1}
    # logprobs are of the model's own (untempered, unfiltered) distribution
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[tokens])
    probs = torch.softmax(logits, -1)
    tokens = sample(logits.expand(n, -1), _tensors(n, top_p=float(probs[0] + probs[1] / 2))).tokens
    assert set(tokens.tolist()) == {0, 1}
    tokens = sample(logits.expand(n, -1), _tensors(n, temperature=0.05)).tokens
    assert (tokens == 0).float().mean() > 0.99
    greedy = sample(logits.expand(3, -1), _tensors(3, temperature=0.0)).tokens
    assert greedy.tolist() == [0, 0, 0]


def test_noise_is_uniform_and_keyed_by_seed_and_step():
    from workers.sampler import uniform_noise
    u = uniform_noise(torch.tensor([7, 7, 8]), torch.tensor([0, 1, 0]), 5000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = uniform_noise(torch.tensor([7]), torch.tensor([0]), 5000)
    assert torch.equal(again[0], u[0])
    assert math.isclose(u.var().item(), 1 / 12, rel_tol=0.05)


def test_greedy_without_logprobs_reads_the_logits_as_they_are():
    """A greedy step no row of which asks for logprobs takes the argmax of the logits in their own dtype (no fp32
    copy) and computes no logprobs; asking for them gives the same tokens and the raw distribution's logprobs."""
    logits = (torch.randn(5, 1001, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    logits[1, 10] = logits[1, 900] = logits.max() + 1   # a tie: the first maximum, as torch's argmax
    quiet = step_rows(SamplingParams(temperature=0.0, logprobs=False), list(range(5)), 1001)[0]
    asked = step_rows(SamplingParams(temperature=0.0), list(range(5)), 1001)[0]
    assert not quiet.wants_logprobs and asked.wants_logprobs
    fast = sample(logits, quiet)
    assert fast.logprobs is None and torch.equal(fast.tokens, logits.float().argmax(-1))
    full = sample(logits, asked)
    assert torch.equal(full.tokens, fast.tokens) and fast.tokens[1] == 10
    torch.testing.assert_close(full.logprobs, torch.log_softmax(logits.float(), -1).gather(-1, full.tokens[:, None])[:, 0])
    top = step_rows(SamplingParams(temperature=0.0, logprobs=False, top_logprobs=2), list(range(5)), 1001)[0]
    assert top.wants_logprobs and sample(logits, top).top_ids.shape == (5, 2)   # alternatives asked: computed
