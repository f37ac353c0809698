"""The reasoning parser (vLLM's --reasoning-parser qwen3): the reasoning apart from the answer, whole and
streamed in any pieces, nothing split when the prompt closed the think block (enable_thinking false), tool
calls parsed from the answer; and the engine's grammar waiting for the reasoning's end (the slow test: a
tiny thinking model whose output is scripted by logit_bias and a frequency penalty). The end to end check
with the openai client runs on test_openai_fields' app."""
from __future__ import annotations

import json

import jsonschema
import pytest

from deployments.reasoning import ReasoningParser, split_reasoning
from deployments.render import RenderSpec, StreamRenderer, join_body, render_choices
from deployments.served_output import ServedOutput
from factories import make_tokenizer, thinking_model
from sse import events
from workers import EngineConfig, LLMEngine, SamplingParams
from workers.grammar import StructuredSpec
from workers.reasoning import ReasoningGate, ThinkTokens, think_tokens

TAGS = ThinkTokens("<think>", "</think>", 90, 91)
THINKING, CLOSED = [1, 2], [1, 90, 3, 91, 3]   # prompts: thinking on, and the block closed (enable_thinking false)
CALL = '<tool_call>\n{"name": "g", "arguments": {"ok": true}}\n</tool_call>'


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("prompt, text, expected", [
    (THINKING, "a <b</think>{}", ("a <b", "{}")),
    (THINKING, "<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),   # a generated <think> dropped
    (THINKING, "cut in its reasoning </thi", ("cut in its reasoning </thi", "")),
    (CLOSED, "all </think> answer", (None, "all </think> answer")),
    ([1, 91, 90], "x</think>y", ("x", "y")),                              # the last tag counts: open again
])
def test_whole_and_streamed_in_any_pieces_split_the_same(prompt, text, expected):
    assert split_reasoning(TAGS, prompt, text) == expected
    for size in (1, 2, 3, 7):
        parser, got = ReasoningParser(TAGS, prompt), ["", ""]
        for piece in pieces(text, size) + [None]:
            reasoning, content = parser.feed(piece) if piece is not None else parser.finish()
            assert "</think>" not in reasoning and (expected[0] is None or "<think>" not in reasoning)
            got = [got[0] + reasoning, got[1] + content]
        assert (got[0] or None, got[1]) == expected, size


def item(text, prompt_ids=(), finish=None, index=0):
    return ServedOutput("r", list(prompt_ids), [5], text, [-0.5], finish, num_prompt_tokens=2, replica_id="rep",
                        index=index)


def stream(spec: RenderSpec, texts: list[str], prompt) -> list[dict]:
    renderer = StreamRenderer(spec, TAGS)
    last = len(texts) - 1
    out = "".join(renderer.feed(item(t, prompt if i == 0 else (), "stop" if i == last else None))
                  for i, t in enumerate(texts))
    return [e["choices"][0]["delta"] for e in events(out + renderer.finish())[:-1]]


def test_stream_deltas_carry_reasoning_then_content_and_tool_calls_after_it():
    deltas = stream(RenderSpec(chat=True, model="m", tool_calls=True),
                    ["I will", " call </th", "ink>", CALL[:15], CALL[15:]], THINKING)
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1:3] == [{"reasoning_content": "I will", "reasoning": "I will"},
                           {"reasoning_content": " call ", "reasoning": " call "}]   # "</th" held: maybe the tag
    [call] = deltas[3]["tool_calls"]            # the tag's own piece and the call's start: nothing to show
    assert len(deltas) == 4 and "content" not in deltas[3] and json.loads(call["function"]["arguments"]) == {"ok": True}
    off = stream(RenderSpec(chat=True, model="m"), ["x</think>", "y"], CLOSED)
    assert off[1:] == [{"content": "x</think>"}, {"content": "y"}]   # enable_thinking false: nothing split
    hidden = stream(RenderSpec(chat=True, model="m", include_reasoning=False), ["x", "</think>y"], THINKING)
    assert hidden[1:] == [{"content": "y"}]


def test_whole_answer_message_reasoning_content_and_tool_calls():
    def message(text, prompt, **spec):
        part = render_choices([item(text, prompt, "stop")], RenderSpec(chat=True, model="m", **spec), "rep", TAGS)
        [choice] = json.loads(join_body(RenderSpec(chat=True, model="m"), [part]))["choices"]
        return choice["message"], choice["finish_reason"]

    assert message("why</think>{}", THINKING) == (
        {"role": "assistant", "content": "{}", "reasoning_content": "why", "reasoning": "why"}, "stop")
    called, finish = message("why</think>\n" + CALL, THINKING, tool_calls=True)
    assert (called["content"], called["reasoning_content"], finish) == (None, "why", "tool_calls")
    assert called["tool_calls"][0]["function"]["name"] == "g"
    assert message("still thinking", THINKING)[0]["content"] is None         # cut before </think>: no answer
    assert message("x</think>y", CLOSED)[0] == {"role": "assistant", "content": "x</think>y"}
    assert message("x</think>y", THINKING, include_reasoning=False)[0] == {"role": "assistant", "content": "y"}
    plain = render_choices([item("x</think>y", THINKING, "stop")], RenderSpec(chat=True, model="m"), "rep")
    assert json.loads(plain.choices_json)["message"]["content"] == "x</think>y"   # no parser: as generated


class Recorder:
    """Stands for a GrammarMatcher: what the gate let through."""

    def __init__(self):
        self.accepted, self.filled = [], []

    def accept(self, token):
        self.accepted.append(token)
        return True

    def fill_bitmask(self, bitmask, row):
        self.filled.append(row)
        bitmask[row] = 0


def test_the_gate_keeps_the_grammar_out_of_the_reasoning():
    import torch
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    grammar = Recorder()
    gate = ReasoningGate(grammar, TAGS.end_id, TAGS.reasoning_ended(THINKING))
    gate.fill_bitmask(bitmask, 1)
    assert bitmask[1].tolist() == [-1, -1, -1] and not grammar.filled      # reasoning: every token allowed
    assert all(gate.accept(t) for t in (7, TAGS.start_id, 8, TAGS.end_id)) and grammar.accepted == []
    gate.fill_bitmask(bitmask, 1)
    assert gate.accept(9) and grammar.accepted == [9] and grammar.filled == [1] and bitmask[1].tolist() == [0, 0, 0]
    closed = ReasoningGate(grammar, TAGS.end_id, TAGS.reasoning_ended(CLOSED))
    assert closed.accept(4) and grammar.accepted == [9, 4]               # enable_thinking false: from the start


def test_the_flag_reaches_the_engine_and_a_parser_needs_its_tags(tmp_path):
    from deployments.cli import config_from_args, parse_args
    from deployments.config import LLMConfig

    assert config_from_args(parse_args(["serve", "--demo", "--reasoning-parser", "qwen3"])).engine.reasoning_parser \
        == "qwen3" == LLMConfig(reasoning_parser="qwen3").engine.reasoning_parser
    assert config_from_args(parse_args(["serve", "--demo"])).engine.reasoning_parser is None
    assert think_tokens(None, object()) is None
    with pytest.raises(ValueError, match="</think>"):
        think_tokens("qwen3", make_tokenizer(tmp_path))
    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineConfig(model="m", reasoning_parser="deepseek_r1")


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking(model_dir, tmp_path_factory):
    return thinking_model(model_dir("qwen3"), tmp_path_factory.mktemp("thinking") / "qwen3")


def scripted(tokenizer) -> dict:
    """Greedy sampling that writes "ox" a few times, then </think>: "ox" leads by 10 until the frequency penalty
    (2 per use) brings it under </think>, which leads every other token by ~20 (a random model's logits are
    within a few units); after </think> only the grammar's tokens remain."""
    ox, end = tokenizer.encode(" fox")[-1], tokenizer.convert_tokens_to_ids("</think>")
    assert tokenizer.decode([ox]) == "ox"
    return dict(temperature=0.0, max_tokens=40, logit_bias={ox: 30.0, end: 20.0}, frequency_penalty=2.0)


@pytest.mark.slow   # an engine (a tiny model and xgrammar)
def test_the_engines_grammar_applies_after_the_reasoning(thinking):
    engine = LLMEngine(EngineConfig(model=str(thinking), device="cpu", dtype="float32", max_num_seqs=4,
                                    reasoning_parser="qwen3"))
    try:
        tokenizer, messages = engine.tokenizer, [{"role": "user", "content": "Hi"}]

        def prompt(**kwargs):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            return tokenizer(text, add_special_tokens=False).input_ids

        params = SamplingParams(structured=StructuredSpec.json_schema(SCHEMA), **scripted(tokenizer))
        on, off = engine.generate([prompt(), prompt(enable_thinking=False)], [params, params])
        reasoning, content = split_reasoning(engine.think, on.prompt_token_ids, on.text)
        assert reasoning and set(reasoning.split("ox")) == {""} and on.finish_reason == "stop", on.text
        jsonschema.validate(json.loads(content), SCHEMA)
        assert split_reasoning(engine.think, off.prompt_token_ids, off.text) == (None, off.text)   # from token 1
        jsonschema.validate(json.loads(off.text), SCHEMA)
    finally:
        engine.close()
