"""Incremental detokenization and stop strings (workers/output.py) against decoding everything at once."""
import random

import pytest

from factories import make_tokenizer
from workers import SamplingParams
from workers.output import IncrementalDetokenizer, RequestState
from workers.sequence import TokenDelta


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


UNICODE = "naïve café — 東京 🙂 ok"   # multi-byte characters split across byte-level tokens


def token_streams(tokenizer, count=30, length=60):
    """Random ids (special tokens, stray bytes of UTF-8 characters) and real text's ids."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    streams = [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]
    return streams + [tokenizer(UNICODE, add_special_tokens=False).input_ids]


@pytest.mark.parametrize("generic", [False, True])
def test_incremental_text_equals_decoding_all_at_once(tokenizer, generic):
    for ids in token_streams(tokenizer):
        detok = IncrementalDetokenizer(tokenizer, generic=generic)
        pieces = [detok.add([t]) for t in ids]
        text = "".join(pieces) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True), ids
    assert "".join(pieces) == UNICODE   # valid text: no piece ever showed half a character


def feed(state, ids, per_delta=1, last_reason="length"):
    """Deltas as the engine would send them; returns the index at which a stop string ended the request."""
    chunks = [ids[i:i + per_delta] for i in range(0, len(ids), per_delta)]
    for n, chunk in enumerate(chunks):
        done = n == len(chunks) - 1
        if state.update(TokenDelta("r", chunk, [-0.5] * len(chunk), last_reason if done else None)):
            return n
    return None


@pytest.mark.parametrize("per_delta", [1, 3])
def test_stop_string_cuts_the_text_and_drops_later_tokens(tokenizer, per_delta):
    ids = tokenizer("alpha beta gamma delta epsilon", add_special_tokens=False).input_ids
    state = RequestState("r", [1, 2], SamplingParams(stop=["zzz", "ma del"]), tokenizer)
    assert feed(state, ids, per_delta) is not None
    assert state.finish_reason == "stop" and state.text == "alpha beta gam"
    full = tokenizer.decode(state.token_ids, skip_special_tokens=True)
    assert "ma del" in full and "ma del" not in full[:-1]          # no token kept past the one ending it
    assert len(state.token_ids) == len(state.logprobs) < len(ids)


def test_stop_string_in_the_held_back_tail_at_the_end(tokenizer):
    ids = tokenizer("one two three", add_special_tokens=False).input_ids
    state = RequestState("r", [], SamplingParams(stop=["three"]), tokenizer)
    feed(state, ids, per_delta=len(ids), last_reason="length")
    assert state.finish_reason == "stop" and state.text == "one two "


def test_deltas_hold_back_a_possible_stop_and_add_up_to_the_text(tokenizer):
    ids = tokenizer("the cat sat on the mat and then", add_special_tokens=False).input_ids
    for stops, final in ((["on the m"], "the cat sat "), (["xyz"], "the cat sat on the mat and then")):
        state = RequestState("r", [7, 8], SamplingParams(stop=stops), tokenizer)
        streamed, prompts = [], []
        for n, t in enumerate(ids):
            stopped = state.update(TokenDelta("r", [t], [0.0], "length" if n == len(ids) - 1 else None))
            out = state.output(delta=True)
            streamed.append(out.text)
            prompts.append(out.prompt_token_ids)
            assert not any(s in "".join(streamed) for s in stops)   # never shown, not even in part, then cut
            if stopped or state.finished:
                break
        assert "".join(streamed) == state.text == final and state.finished
        assert prompts[0] == [7, 8] and not any(prompts[1:])
        cumulative = state.output()
        assert cumulative.text == final and cumulative.token_ids == state.token_ids


def test_finish_without_stop_strings_keeps_the_engines_reason(tokenizer):
    state = RequestState("r", [], SamplingParams(), tokenizer)
    state.update(TokenDelta("r", [5, 6], [0.1, 0.2], None))
    assert not state.finished
    state.update(TokenDelta("r", [], [], "error", error="boom"))
    assert (state.finish_reason, state.error, state.token_ids) == ("error", "boom", [5, 6])
