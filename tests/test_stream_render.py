"""Responses rendered in the replica (deployments/render.py) and its stream batched per window
(deployments/render.py `batched`), without Ray (the end-to-end check that a streamed answer crosses Ray in
fewer items than it has events runs on test_openai_fields' app)."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from starlette.responses import JSONResponse

from deployments import responses as rs
from deployments.served_output import ServedOutput
from deployments.render import DONE, RenderSpec, StreamRenderer, join_body, render_choices
from deployments.render import batched
from sse import events

NAMES = {5: ("He", b"He"), 6: ("llo", b"llo"), 7: ("!", b"!"), 9: ("x", b"x")}


def item(token_ids, text, index=0, finish=None, logprobs=None, top=None, prompt_text=None, prompt_ids=(),
         prompt_logprobs=None):
    out = ServedOutput("r", list(prompt_ids), list(token_ids), text,
                       logprobs if logprobs is not None else [-0.5] * len(token_ids), finish,
                       num_cached_tokens=2, top_logprobs=top, prompt_logprobs=prompt_logprobs, num_prompt_tokens=4,
                       replica_id="rep", index=index, prompt_text=prompt_text, token_names=dict(NAMES))
    return out


def test_chat_stream_role_chunk_deltas_finish_usage_done():
    spec = RenderSpec(chat=True, model="m:a", include_usage=True)
    renderer = StreamRenderer(spec)
    out = "".join(renderer.feed(i) for i in (item([5], "He"), item([6], ""), item([7], "llo!", finish="length")))
    got = events(out + renderer.finish())
    assert [e["choices"][0]["delta"] for e in got[:3]] == [{"role": "assistant", "content": ""}, {"content": "He"},
                                                           {"content": "llo!"}]   # the held-back token: no event
    assert got[2]["choices"][0]["finish_reason"] == "length" and got[1]["choices"][0]["finish_reason"] is None
    assert {e["id"] for e in got[:4]} == {renderer.response_id} and renderer.response_id.startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == "m:a" for e in got[:4])
    assert "usage" not in got[0] and got[3]["choices"] == []
    assert got[3]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                               "prompt_tokens_details": {"cached_tokens": 2}}
    assert got[4] == "[DONE]" and renderer.finish().endswith(DONE)


def test_completion_stream_echo_logprobs_offsets_and_choice_numbering():
    spec = RenderSpec(chat=False, model="m", logprobs=True, echo=True, first_index=0)
    renderer = StreamRenderer(spec)
    first = item([5], "He", prompt_text="ab", prompt_ids=[9, 9], prompt_logprobs=[None, (-1.0, [])])
    got = events(renderer.feed(first) + renderer.feed(item([6], "llo", finish="stop")) + renderer.finish())
    assert [e["choices"][0]["text"] for e in got[:2]] == ["abHe", "llo"]
    assert got[0]["choices"][0]["logprobs"] == {"tokens": ["x", "x", "He"], "token_logprobs": [None, -1.0, -0.5],
                                                "top_logprobs": None, "text_offset": [0, 1, 2]}
    assert got[1]["choices"][0]["logprobs"]["text_offset"] == [4]   # after the echoed prompt and "He"
    assert got[1]["choices"][0]["finish_reason"] == "stop" and got[2] == "[DONE]"   # no usage unless asked
    spec = RenderSpec(chat=False, model="m", first_index=6, token_ids_as_names=True, logprobs=True)
    [event] = events(StreamRenderer(spec).feed(item([7], "!", index=1)))
    assert event["choices"][0]["index"] == 7 and event["choices"][0]["logprobs"]["tokens"] == ["token_id:7"]


def test_continuous_usage_on_every_chunk_counts_the_tokens_so_far():
    renderer = StreamRenderer(RenderSpec(chat=True, model="m", include_usage=True, continuous_usage=True))
    out = "".join(renderer.feed(i) for i in (item([5], "He"), item([6, 7], "llo!", finish="stop")))
    got = events(out + renderer.finish())
    assert [e["usage"]["completion_tokens"] for e in got[:-1]] == [0, 1, 3, 3]   # role chunk, 2 deltas, usage
    assert all(e["usage"]["prompt_tokens"] == 4 and e["usage"]["total_tokens"] == 4 + e["usage"]["completion_tokens"]
               for e in got[:-1])


def test_a_scored_prompt_shows_the_prompt_and_no_generated_token():
    spec = RenderSpec(chat=False, model="m", logprobs=True, echo=True, score_prompt=True)
    scored = item([5], "He", finish="length", prompt_text="ab", prompt_ids=[9, 9], prompt_logprobs=[None, (-1.0, [])])
    [choice] = json.loads("[" + render_choices([scored], spec, "rep").choices_json + "]")
    assert choice["text"] == "ab" and choice["logprobs"]["tokens"] == ["x", "x"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0]
    assert render_choices([scored], spec, "rep").completion_tokens == 0
    renderer = StreamRenderer(dataclasses.replace(spec, include_usage=True))
    got = events(renderer.feed(scored) + renderer.finish())
    assert got[0]["choices"][0]["text"] == "ab" and got[0]["choices"][0]["logprobs"]["tokens"] == ["x", "x"]
    assert got[1]["usage"]["completion_tokens"] == 0


def test_chat_stream_tool_call_held_until_complete():
    spec = RenderSpec(chat=True, model="m", tool_calls=True)
    renderer = StreamRenderer(spec)
    parts = ["Hi <tool", '_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>']
    out = renderer.feed(item([5], parts[0])) + renderer.feed(item([6], parts[1], finish="stop"))
    got = events(out)
    assert [e["choices"][0]["delta"] for e in got[:2]] == [{"role": "assistant", "content": ""}, {"content": "Hi "}]
    [call] = got[2]["choices"][0]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert got[2]["choices"][0]["finish_reason"] == "tool_calls"


def test_whole_body_is_what_jsonresponse_made_from_the_same_choices():
    spec = RenderSpec(chat=False, model="m", logprobs=True)
    prompt0 = [item([5, 6], "Hello", finish="length", index=i) for i in range(2)]
    prompt1 = [item([7], "!", finish="stop", index=i) for i in range(2)]
    parts = [render_choices(prompt0, spec, "r0"),
             render_choices(prompt1, RenderSpec(chat=False, model="m", logprobs=True, first_index=2), "r1")]
    raw = join_body(spec, parts)
    body = json.loads(raw)
    choices = [rs.completion_choice(i, o.text, rs.finish_reason(o), rs.completion_logprobs(o))
               for i, o in enumerate(prompt0 + prompt1)]
    expected = rs.completion_body(body["id"], "m", choices, rs.usage(8, 6, 4))
    expected["created"] = body["created"]
    assert raw == JSONResponse(expected).body   # byte for byte, key order and encoding included
    chat = render_choices([item([5], "ünï <tool_call>{\"name\": \"g\"}</tool_call>", finish="stop")],
                          RenderSpec(chat=True, model="m", tool_calls=True), "r")
    [choice] = json.loads(join_body(RenderSpec(chat=True, model="m"), [chat]))["choices"]
    assert choice["message"]["content"] == "ünï" and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "g", "arguments": "{}"}


async def _source(items, delays, fail=None, closed=None):
    try:
        for value, delay in zip(items, delays):
            if delay:
                await asyncio.sleep(delay)
            yield value
        if fail:
            raise fail
    finally:
        if closed is not None:
            closed.append(True)


def collect(gen, limit=None):
    async def run():
        out = []
        async for value in gen:
            out.append(value)
            if limit and len(out) == limit:
                await gen.aclose()
                break
        return out
    return asyncio.run(run())


def test_batched_first_alone_then_joined_per_window():
    # first at once (even empty: it says "accepted"); b, c, d within one window join; e after a gap
    got = collect(batched(_source(["", "b", "c", "d", "e"], [0, 0.01, 0.001, 0.001, 0.3]), window_s=0.05))
    assert got == ["", "bcd", "e"]
    # window 0: what is ready together still joins; nothing is lost or reordered
    got = collect(batched(_source(list("abcdef"), [0] * 6), window_s=0.0))
    assert "".join(got) == "abcdef" and len(got) < 6


def test_batched_keeps_what_arrives_and_ends_while_the_caller_holds_an_item():
    # the caller takes its time with "a"; meanwhile the source yields "b" and ends: "b" still comes
    async def run():
        out = []
        async for value in batched(_source(["a", "b"], [0, 0.01]), window_s=0.0):
            out.append(value)
            await asyncio.sleep(0.05)
        return out
    assert "".join(asyncio.run(run())) == "ab"


def test_batched_error_after_what_came_before_and_early_close_closes_source():
    async def run():
        seen = []
        with pytest.raises(RuntimeError, match="engine died"):
            async for value in batched(_source(["a", "b"], [0, 0.01], RuntimeError("engine died")), 0.05):
                seen.append(value)
        return seen
    assert asyncio.run(run()) == ["a", "b"]
    closed = []
    assert collect(batched(_source(["a", "b", "c"], [0, 0.05, 10], closed=closed), 0.0), limit=2) == ["a", "b"]
    assert closed == [True]   # the source (a request's stream) was closed, so its request is aborted
