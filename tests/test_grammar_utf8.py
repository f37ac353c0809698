"""Constrained JSON strings are well-formed UTF-8 and within their length (no Ray): thousands of outputs drawn at
temperature 1 over a byte-level tokenizer (every byte a token, no merges), so that any ill-formed byte sequence
a grammar lets through (an overlong form, a surrogate, a byte past U+10FFFF) gets drawn; each output is decoded
strictly and validated against its schema, lengths counted in characters. Most are drawn from random logits
through the grammar matchers, batched; the engine's own path (plan bitmask, sampler) draws the rest from a
random model."""
import json

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from deployments.demo_model import SPECIAL_TOKENS, train_tokenizer
from factories import PROMPTS, model_config
from workers import EngineConfig, LLMEngine, SamplingParams
from workers.grammar import TOOL_CALL_END, GrammarCompiler, GrammarError, GrammarMatcher, StructuredSpec, bitmask_width
from workers.grammar import tool_call_begin
from workers.utf8_masks import ERROR, GROUND, Utf8Masks

NUM_BYTE_TOKENS = 256 + len(SPECIAL_TOKENS)
VOCAB = NUM_BYTE_TOKENS + 5        # and padding rows, as a model's vocabulary often has
QUOTE_BIAS = 2.0                   # strings without a maxLength end after ~25 characters, not ~200
MODEL_QUOTE_BIAS = 5.0             # the same for the random model, whose logits spread wider
SPECIAL_BIAS = -100.0              # xgrammar lets <|im_start|> stand for its text in a string: not drawn here
SCHEMA = {"type": "object", "properties": {
    "a": {"type": "string", "maxLength": 12},                      # the failing string
    "b": {"type": "string", "minLength": 2, "maxLength": 5},
    "c": {"type": "string"},
    "d": {"type": "string", "pattern": "^[^a-z]{1,6}$"},         # a class spanning UTF-8 lengths
    "e": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 3}}},   # free keys
    "required": ["a", "b", "c", "d", "e"]}
TOOL = ("lookup", {"type": "object", "properties": {"q": {"type": "string", "maxLength": 12},
                                                      "t": {"type": "string"}}, "required": ["q", "t"]})
SPECS = {"json_schema": (StructuredSpec.json_schema(SCHEMA), SCHEMA),
         "tool_calls": (StructuredSpec.tool_calls([TOOL], parallel=False), TOOL[1]),
         "json_object": (StructuredSpec("json_object"), {"type": "object"})}


def _bytes_of_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a ByteLevel BPE's tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A random tiny Qwen3 over a byte-level tokenizer without merges, and each token id's bytes."""
    from transformers import AutoModelForCausalLM
    path = tmp_path_factory.mktemp("bytes")
    tokenizer = train_tokenizer(path, NUM_BYTE_TOKENS)
    config = model_config("qwen3", vocab_size=VOCAB)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    chars = _bytes_of_chars()
    token_bytes = {i: bytes([chars[t]]) for t, i in tokenizer.get_vocab().items() if t not in SPECIAL_TOKENS}
    assert len(token_bytes) == 256 and sorted(token_bytes.values()) == [bytes([b]) for b in range(256)]
    return path, tokenizer, token_bytes


@pytest.fixture(scope="module")
def compiler(byte_model):
    path, tokenizer, _ = byte_model
    compiler = GrammarCompiler(path, VOCAB, [tokenizer.eos_token_id])
    yield compiler
    compiler.close()


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def invalid(raw: bytes, kind: str, schema: dict) -> str | None:
    """Why the output is not a well-formed UTF-8 text whose JSON validates, or None."""
    try:
        text = raw.decode("utf-8")                # strict: an overlong form or a surrogate raises
        if kind == "tool_calls":
            begin = tool_call_begin(TOOL[0])
            assert text.startswith(begin) and text.endswith(TOOL_CALL_END), text
            text = text[len(begin):-len(TOOL_CALL_END)]   # the arguments
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")   # no lone surrogate written as a \\u escape
        jsonschema.validate(value, schema)
    except (UnicodeError, ValueError, AssertionError, jsonschema.ValidationError) as exc:
        return f"{raw!r}: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def special_ids(token_bytes: dict[int, bytes], eos: int) -> set[int]:
    return set(range(NUM_BYTE_TOKENS)) - token_bytes.keys() - {eos}


def draw(compiled, eos: int, token_bytes: dict[int, bytes], num: int, max_tokens: int, seed: int) -> list[bytes]:
    """`num` outputs of the grammar, sampled at temperature 1 from random logits; those that ended (EOS)."""
    rng = np.random.default_rng(seed)
    bias = np.zeros(VOCAB, dtype=np.float32)
    bias[list(special_ids(token_bytes, eos))] = SPECIAL_BIAS
    bias[next(i for i, b in token_bytes.items() if b == b'"')] = QUOTE_BIAS
    matchers = [GrammarMatcher(compiled) for _ in range(num)]
    outputs, ended = [bytearray() for _ in range(num)], []
    live = list(range(num))
    bitmask = torch.zeros(num, bitmask_width(VOCAB), dtype=torch.int32)
    for _ in range(max_tokens):
        for row, i in enumerate(live):
            matchers[i].fill_bitmask(bitmask, row)
        # Gumbel-max over random logits: a draw at temperature 1 (numpy's: torch's small ops are slower here)
        scores = rng.standard_normal((len(live), VOCAB), dtype=np.float32) + rng.gumbel(size=(len(live), VOCAB))
        scores = torch.from_numpy((scores + bias).astype(np.float32))
        xgr.apply_token_bitmask_inplace(scores, bitmask[:len(live)])
        tokens = scores.numpy().argmax(-1).tolist()
        for i, token in zip(list(live), tokens):
            assert matchers[i].accept(token)
            if token == eos:
                ended.append(bytes(outputs[i]))
                live.remove(i)
            else:
                outputs[i] += token_bytes[token]
        if not live:
            break
    return ended


def test_the_masks_allow_exactly_what_a_strict_decoder_accepts():
    """From each state a token reaches, a token is allowed iff the bytes so far are the start of well-formed UTF-8
    (all 1- and 2-byte tokens, random longer ones of mostly non-ASCII bytes; pairs of them chained)."""
    import codecs
    import itertools
    rng = np.random.default_rng(0)
    tokens = [bytes([b]) for b in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    tokens += [rng.integers(0x70, 0x100, rng.integers(3, 7), dtype=np.uint8).tobytes() for _ in range(20_000)]
    masks = Utf8Masks(tokens, len(tokens) + 3)
    # ends that complete any started character (CPython's incremental decoder lets `ED A0` wait for a third byte)
    ends = [bytes(end) for k in range(4) for end in itertools.product((0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF), repeat=k)]

    def accepts(data: bytes) -> bool:
        try:
            codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
        except UnicodeDecodeError:
            return False
        return any(_decodes(data + end) for end in ends)

    assert [masks.next_state[GROUND, t] != ERROR for t in range(len(tokens))] == [accepts(t) for t in tokens]
    firsts, seconds = rng.integers(0, len(tokens), (2, 20_000))
    for first, second in zip(firsts.tolist(), seconds.tolist()):
        state = masks.next_state[GROUND, first]
        if state != ERROR:
            assert (masks.next_state[state, second] != ERROR) == accepts(tokens[first] + tokens[second])
            assert bool(masks.bitmask[state, second // 32] >> (second % 32) & 1) == accepts(tokens[first] + tokens[second])
    assert not masks.bitmask[:, -1].any()     # the padding rows


@pytest.mark.parametrize("kind, num, seed", [("json_schema", 900, 1), ("tool_calls", 700, 2), ("json_object", 700, 3)])
def test_sampled_outputs_decode_strictly_and_validate(byte_model, compiler, kind, num, seed):
    """2,000 ended outputs at least over the three kinds (before the UTF-8 masks, ~8% of them had an overlong
    form or an encoded surrogate)."""
    _, tokenizer, token_bytes = byte_model
    spec, schema = SPECS[kind]
    ended = draw(compiler.compile_now(spec), tokenizer.eos_token_id, token_bytes, num, 400, seed)
    assert len(ended) >= num * 0.9
    failures = [reason for raw in ended if (reason := invalid(raw, kind, schema))]
    assert not failures, f"{len(failures)} of {len(ended)} invalid, e.g. {failures[:3]}"
    assert any(max(raw) >= 0xF0 for raw in ended)        # four-byte characters were drawn where allowed


@pytest.mark.slow   # make test-fast skips it: a random model's constrained generations
def test_the_engine_samples_only_well_formed_strings(byte_model):
    """The engine's own path (the plan's bitmask rows, the sampler's masking) from a random model."""
    path, tokenizer, token_bytes = byte_model
    quote = next(i for i, b in token_bytes.items() if b == b'"')
    bias = {quote: MODEL_QUOTE_BIAS, **dict.fromkeys(special_ids(token_bytes, tokenizer.eos_token_id), SPECIAL_BIAS)}
    params = [SamplingParams(max_tokens=400, temperature=1.0, seed=seed, logit_bias=bias, structured=SPECS[kind][0])
              for seed in range(40) for kind in SPECS]
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_num_seqs=48))
    try:
        outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    finally:
        engine.close()
    ended = [(out, p.structured.kind) for out, p in zip(outs, params) if out.finish_reason == "stop"]
    assert len(ended) >= len(params) * 0.8, [o.finish_reason for o in outs]
    failures = []
    for out, kind in ended:
        raw = b"".join(token_bytes[t] for t in out.token_ids[:-1])       # the last is EOS
        reason = invalid(raw, kind, SPECS[kind][1])
        if reason or out.text != raw.decode("utf-8"):
            failures.append(reason or f"text {out.text!r}")
    assert not failures, f"{len(failures)} of {len(ended)} invalid, e.g. {failures[:3]}"


def test_lengths_beside_a_pattern_are_refused_not_ignored(compiler):
    """xgrammar 0.2.9 drops minLength / maxLength next to a pattern or format: a 400 naming the field."""
    for extra in ({"pattern": "^x+$"}, {"format": "email"}):
        spec = StructuredSpec.json_schema({"type": "string", "maxLength": 3, **extra})
        with pytest.raises(GrammarError, match="response_format: json_schema .*maxLength together with a pattern"):
            compiler.compile_now(spec)
