"""Grammar-constrained decoding in the engine (no Serve; Ray only for the TP 2 test): every sequence's matcher
follows its own tokens through chunked prefill, prefix-cache hits, several sequences per prompt, preemption,
captured decode and tensor parallelism; EOS only where the grammar accepts; padded vocabulary rows never;
logprobs of the raw distribution; length when cut."""
import json

import jsonschema
import pytest
import torch

from factories import PROMPTS
from workers import EngineConfig, LLMEngine, SamplingParams
from workers.grammar import GrammarError, StructuredSpec

pytestmark = pytest.mark.slow   # make test-fast skips it: grammar-constrained generations

VOCAB = 389   # the tokenizer's 384 + 5 padding rows the grammar must never allow
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "age", "tags"]}
LONG_PROMPT = " ".join(PROMPTS) * 2


@pytest.fixture(scope="module")
def path(model_dir):
    return model_dir("qwen3", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def engine(path):
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_num_seqs=8))
    yield engine
    engine.close()


def params(seed: int, max_tokens: int = 96, schema=SCHEMA, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                          structured=StructuredSpec.json_schema(schema), **kw)


def check_valid(outs, schema=SCHEMA, min_stopped: int = 1):
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= min_stopped, [(o.finish_reason, o.text) for o in outs]
    for out in stopped:
        jsonschema.validate(json.loads(out.text), schema)
    return stopped


def test_outputs_validate_and_one_schema_compiles_once(engine):
    before = engine.grammars.num_compiled
    outs = engine.generate([PROMPTS[1]] * 8, [params(seed) for seed in range(8)])   # shared prompt: prefix hits
    check_valid(outs, min_stopped=6)
    assert engine.grammars.num_compiled - before <= 1
    assert all(t < 384 for o in outs for t in o.token_ids)       # padded rows are never allowed
    assert all(o.token_ids[-1] in engine.eos_token_ids for o in outs if o.finish_reason == "stop")


def test_eos_is_masked_until_the_grammar_accepts(engine):
    """Unconstrained, this model ends "Hello" at once (greedy EOS); with the grammar it cannot before `}`."""
    eos = next(iter(engine.eos_token_ids))
    free = engine.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, logit_bias={eos: 100}))[0]
    assert free.token_ids == [eos]
    digit = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=32, temperature=0.0, logit_bias={eos: 100},
                                                     structured=StructuredSpec.json_schema(digit)))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and len(out.token_ids) > 1
    jsonschema.validate(json.loads(out.text), digit)


def test_logprobs_are_of_the_raw_distribution(engine):
    """The chosen tokens' logprobs equal the unconstrained model's scores of the same tokens (prompt_logprobs)."""
    eng_prompt = engine.tokenizer(PROMPTS[2]).input_ids
    out = engine.generate(eng_prompt, params(3, max_tokens=24))[0]
    scored = engine.generate(eng_prompt + out.token_ids, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    raw = [entry[0] for entry in scored.prompt_logprobs[len(eng_prompt):]]
    assert max(abs(a - b) for a, b in zip(out.logprobs, raw)) < 1e-4


def test_a_grammar_cut_by_max_tokens_ends_with_length(engine):
    out = engine.generate(PROMPTS[0], params(1, max_tokens=5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_an_invalid_schema_is_refused_before_it_is_queued(engine):
    bad = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}
    with pytest.raises(GrammarError, match="response_format: json_schema is invalid or unsupported.*no-such-type"):
        engine.add_request(PROMPTS[0], params(0, schema=bad))
    assert not engine.controller.waiting
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        params(0, ignore_eos=True)


def test_regex_choice_and_grammar(engine):
    specs = {StructuredSpec("regex", r"[a-c]{2,4}-\d{2}"): r"[a-c]{2,4}-\d{2}",
             StructuredSpec("choice", json.dumps(["yes", "no", "maybe"])): "yes|no|maybe",
             StructuredSpec("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'): r"\(\d+(\+\d+)*\)"}
    import re
    for spec, pattern in specs.items():
        outs = engine.generate([PROMPTS[3]] * 3, [SamplingParams(max_tokens=32, seed=s, structured=spec)
                                                  for s in range(3)])
        for out in outs:
            if out.finish_reason == "stop":
                assert re.fullmatch(pattern, out.text), (spec, out.text)
        assert any(o.finish_reason == "stop" for o in outs)


SCHEDULED = [LONG_PROMPT, PROMPTS[4], LONG_PROMPT + " x", PROMPTS[5]]


@pytest.fixture(scope="module")
def reference(engine):
    """The plain run of SCHEDULED (seeded: the same tokens each time it is run), once for every variant."""
    reference = engine.generate(SCHEDULED, [params(10 + i) for i in range(4)])
    check_valid(reference, min_stopped=2)
    return reference


@pytest.mark.parametrize("variant", ["chunked", "preempted", "cached", "captured"])
def test_matchers_follow_their_tokens_whatever_the_schedule(path, reference, variant):
    """Seeded sampling draws the same tokens whatever the batch: a run chunked, preempted and recomputed, or
    served from the prefix cache, or decoded through captured graphs must give the reference run's outputs
    token for token."""
    prompts = SCHEDULED
    config = dict(model=str(path), device="cpu", dtype="float32", max_num_seqs=8)
    if variant == "chunked":
        config.update(max_num_batched_tokens=16)
    elif variant == "preempted":
        config.update(num_kv_blocks=26, max_model_len=384)
    elif variant == "captured":   # decode replayed from an op tape (graph capture emulated): the mask stays outside
        config.update(emulate_capture=True)
    other = LLMEngine(EngineConfig(**config))
    try:
        if variant == "cached":
            other.generate(prompts, [SamplingParams(max_tokens=1)] * 4)        # the prompts' blocks cached
        outs = other.generate(prompts, [params(10 + i) for i in range(4)])
        stats = other.stats()
    finally:
        other.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in reference]
    if variant == "preempted":
        assert stats["num_preemptions"] > 0
    if variant == "cached":
        assert stats["prefix_cache"]["hit_tokens"] > 0


def test_a_masked_token_never_wins_the_race_even_at_noise_one():
    """Seed 47, step 0, id 862622 draws u = (2**24 - 0.5) / 2**24, which is 1.0 in fp32: a zero Exp(1) draw. The
    masked token's 0 / 0 must not beat the allowed one (it did: NaN wins argmax)."""
    from sampler_rows import step_rows
    from workers.sampler import SamplerState, sample
    vocab, allowed = 862624, 5
    state = SamplerState(1, vocab, 1, "cpu")
    state.load_bitmask(1, [0], torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32))
    state.token_bitmask[0, 0] = 1 << allowed
    tensors, _ = step_rows(SamplingParams(), [47], vocab, state=state, use_grammar=True)
    assert sample(torch.zeros(1, vocab), tensors, state).tokens.tolist() == [allowed]


def test_bitmask_rows_reach_only_the_constrained_rows(engine):
    """A batch mixing constrained and free rows: the plan carries masks for the constrained rows only, and
    the free rows sample as they would alone."""
    free = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    alone = engine.generate(PROMPTS[6], free)[0]
    outs = engine.generate([PROMPTS[1], PROMPTS[6], PROMPTS[2]], [params(1), free, params(2)])
    assert outs[1].token_ids == alone.token_ids
    check_valid([outs[0], outs[2]], min_stopped=1)
    state = engine.executor.sampler_state
    assert state.token_bitmask.shape[1] == (VOCAB + 31) // 32 and state.token_bitmask.dtype == torch.int32


def test_tensor_parallel_ranks_take_the_bitmask_from_the_plan(path, engine, shared_ray):
    """TP 2 (Ray actors): the plan carries the rows to every rank, rank 0 masks; greedy tokens equal TP 1's."""
    small = {"type": "object", "properties": {"c": {"enum": ["red", "green"]},
                                              "n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["c", "n"]}
    requests = [SamplingParams(max_tokens=32, temperature=0.0, structured=StructuredSpec.json_schema(small))] * 3
    want = engine.generate(PROMPTS[:3], requests)
    tp = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_num_seqs=8,
                                tensor_parallel_size=2))
    try:
        got = tp.generate(PROMPTS[:3], requests)
    finally:
        tp.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    check_valid(got, small, min_stopped=3)
