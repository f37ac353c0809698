"""Acceptance (OpenAI API completeness, over HTTP): n and best_of, logprobs with real token names and
top alternatives, echo with prompt logprobs, /tokenize, /detokenize, /v1/models/{id}, usage in streams; and a
stream rendered in the replica crosses Ray in fewer items than it has events (deployments/render.py `batched`).
vLLM's fields the clients send: continuous_usage_stats, chat_template_kwargs (a template with Qwen3's thinking
switch), reasoning_effort, max_tokens 0 scoring a prompt; every caller error a 400 body; readiness (the first
answer of /v1/models lists the configured adapter) and /version. The reasoning parser (--reasoning-parser
qwen3, on a model with Qwen3's think tokens): reasoning_content apart from the content, streamed and whole,
a JSON schema or a tool call after the thinking, nothing split with enable_thinking false.

Logprobs are checked against plain torch on Hugging Face's fp32 logits (|dlogprob| < 1e-3); the
official openai client parses every response and stream.
"""
from __future__ import annotations

import importlib.metadata
import json

import jsonschema
import pytest
import requests
import torch

from deployments.render import RenderSpec
from workers.config import SamplingParams
from factories import PROMPTS
from fields_app import ANSWER, BASE, FIRST_MODELS, MAX_MODEL_LEN, client, files, hf, scripted, url  # noqa: F401 (fixtures)
from sse import events

APP = "fields"


def post(url: str, path: str, body: dict) -> dict:
    response = requests.post(f"{url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@torch.no_grad()
def raw_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the distribution of the token after ids[:i + 1]."""
    model, _ = hf
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def prefix_hits(url: str) -> int:
    from ray import serve
    stats = serve.get_deployment_handle("LLMServer", app_name=APP).stats.remote().result(timeout_s=60)
    return stats["engine"]["prefix_cache"]["hit_tokens"]


def test_n_choices_are_seeded_reproducible_and_share_the_prompt(url):
    prompt = " ".join(PROMPTS)   # several KV blocks long: the choices after the first reuse them
    args = dict(model=BASE, prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3)
    before = prefix_hits(url)
    first = client(url).completions.create(**args)
    hits = prefix_hits(url) - before
    again = client(url).completions.create(**args)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert hits >= 2 * 16 * 2                               # 2 choices x at least 2 full 16-token blocks
    assert first.usage.prompt_tokens == again.usage.prompt_tokens and first.usage.completion_tokens == 24
    stream = client(url).completions.create(**args, stream=True, stream_options={"include_usage": True})
    streamed, usage = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert [streamed[i] for i in range(3)] == texts and usage.completion_tokens == 24


def test_best_of_returns_the_likeliest_choice(url):
    args = dict(model=BASE, prompt=PROMPTS[2], max_tokens=6, temperature=1.0, seed=11, logprobs=0)
    every = client(url).completions.create(**args, n=3).choices
    [best] = client(url).completions.create(**args, n=1, best_of=3).choices
    scores = [sum(c.logprobs.token_logprobs) for c in sorted(every, key=lambda c: c.index)]
    assert best.text == sorted(every, key=lambda c: c.index)[scores.index(max(scores))].text


def test_completion_logprobs_and_echo_match_torch(url, hf):
    _, tokenizer = hf
    prompt = PROMPTS[3]
    out = client(url).completions.create(model=BASE, prompt=prompt, max_tokens=6, temperature=0, logprobs=5,
                                         echo=True, extra_body={"ignore_eos": True})
    choice, prompt_ids = out.choices[0], tokenizer(prompt).input_ids
    names = post(url, "/tokenize", {"model": BASE, "prompt": prompt, "return_token_strs": True})["token_strs"]
    lp, n = choice.logprobs, len(prompt_ids)
    assert choice.text.startswith(prompt) and len(lp.tokens) == n + 6
    assert lp.tokens[:n] == names and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = raw_logprobs(hf, prompt_ids)
    compared = 0
    for i in range(1, n):                                    # prompt tokens, scored by what precedes them
        assert abs(lp.token_logprobs[i] - reference[i - 1, prompt_ids[i]].item()) < 1e-3
        top = reference[i - 1].topk(5)
        named = [(names_of(tokenizer, t), v) for t, v in zip(top.indices.tolist(), top.values.tolist())]
        unique = [(name, v) for name, v in named if [x for x, _ in named].count(name) == 1]   # a dict keeps one
        assert all(abs(lp.top_logprobs[i][name] - v) < 1e-3 for name, v in unique)
        compared += len(unique)
    assert compared >= n
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets


def names_of(tokenizer, token_id: int) -> str:
    from workers.output import TokenNames
    return TokenNames(tokenizer)(token_id)[0]


def test_chat_logprobs_name_tokens_by_text_and_bytes(url, hf):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    no_thinking = {"enable_thinking": False}   # all of the output is content (the reasoning parser is on)
    out = client(url).chat.completions.create(model=f"{BASE}:a", messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3,
                                              extra_body={"ignore_eos": True, "chat_template_kwargs": no_thinking})
    content = out.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", errors="replace").startswith(
        out.choices[0].message.content[:1])
    for t in content:                                        # the sampled (greedy) token is the likeliest
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob


def test_sampled_logprobs_match_torch(url, hf):
    _, tokenizer = hf
    prompt = PROMPTS[5]
    out = post(url, "/v1/completions", {"model": BASE, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                        "ignore_eos": True, "logprobs": 3, "return_tokens_as_token_ids": True})
    lp = out["choices"][0]["logprobs"]
    generated = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    ids = tokenizer(prompt).input_ids
    reference = raw_logprobs(hf, ids + generated)
    for i, token in enumerate(generated):
        row = reference[len(ids) - 1 + i]
        assert abs(lp["token_logprobs"][i] - row[token].item()) < 1e-3
        values, top = row.topk(3)
        got = lp["top_logprobs"][i]
        assert [int(k.removeprefix("token_id:")) for k in got] == top.tolist()
        assert max(abs(a - b) for a, b in zip(got.values(), values.tolist())) < 1e-3


def test_tokenize_detokenize_and_model_cards(url, hf):
    _, tokenizer = hf
    ids = post(url, "/tokenize", {"model": BASE, "prompt": PROMPTS[2]})
    assert ids["tokens"] == tokenizer(PROMPTS[2]).input_ids and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == MAX_MODEL_LEN and ids["token_strs"] is None
    messages = [{"role": "user", "content": "Hi"}]
    chat = post(url, "/tokenize", {"model": f"{BASE}:a", "messages": messages})["tokens"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == tokenizer(text, add_special_tokens=False).input_ids
    assert post(url, "/detokenize", {"model": BASE, "tokens": ids["tokens"]})["prompt"] == PROMPTS[2]
    bad = requests.post(f"{url}/detokenize", json={"model": BASE, "tokens": [10 ** 9]}, timeout=60)
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    assert client(url).models.retrieve(BASE).id == BASE
    card = requests.get(f"{url}/v1/models/a", timeout=60).json()
    assert (card["id"], card["parent"]) == ("a", BASE)
    missing = requests.get(f"{url}/v1/models/nope", timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_penalties_and_min_tokens_reach_the_sampler_over_http(url):
    base = dict(model=BASE, prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = client(url).completions.create(**base).choices[0].text
    penalized = client(url).completions.create(**base, frequency_penalty=2.0, presence_penalty=1.5).choices[0].text
    assert penalized != plain
    stopped = client(url).completions.create(**base, stop=[plain[:1]])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("", "stop")
    at_least = stopped.usage.completion_tokens + 3        # the stop string counts only after min_tokens
    floor = client(url).completions.create(**{**base, "extra_body": {"ignore_eos": True, "min_tokens": at_least}},
                                           stop=[plain[:1]])
    assert floor.usage.completion_tokens >= at_least


def test_end_to_end_stream_crosses_ray_in_fewer_items_than_events(url):
    """Through Serve: 4 choices of one prompt, 6 tokens each, arrive as fewer items than events (the
    choices' tokens of one step travel together), and the events are those of a full response: every
    token of every choice once (an event carries one token, or several where the replica's loop read a
    choice's deltas of several steps at once)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name=APP).options(stream=True)
    spec = RenderSpec(chat=False, model=BASE, include_usage=True, logprobs=True)   # an event per token
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)   # as the ingress builds them
    items = list(handle.render_stream.remote([5, 6, 7, 8], params, spec, n=4))
    replica_id, first = items[0]
    text = first + "".join(items[1:])
    got = events(text)
    assert replica_id and got[-1] == "[DONE]" and got[-2]["usage"]["completion_tokens"] == 24
    tokens = {i: [] for i in range(4)}
    for event in got[:-2]:
        [choice] = event["choices"]
        tokens[choice["index"]] += choice["logprobs"]["tokens"]
    assert all(len(t) == 6 for t in tokens.values()) and len({tuple(t) for t in tokens.values()}) == 1, tokens
    assert len(items) < len(got) - 2, (len(items), len(got))


def test_ready_only_with_the_configured_adapters_listed_and_version(url):
    assert [card["id"] for card in FIRST_MODELS[APP]["data"]] == [BASE, "a"]
    assert requests.get(f"{url}/version", timeout=60).json() == {"version": importlib.metadata.version("loraserve")}


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(url):
    chunks = list(client(url).chat.completions.create(
        model=f"{BASE}:a", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert all(chunk.usage.prompt_tokens == chunks[0].usage.prompt_tokens > 0 for chunk in chunks)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 5 and len(chunks) >= 4, counts
    assert chunks[-1].choices == []   # include_usage's last chunk, as without continuous_usage_stats


def test_chat_template_kwargs_render_qwen3s_thinking_switch(url, hf):
    _, tokenizer = hf
    messages = [{"role": "user", "content": "Hi"}]

    def prompt_tokens(**extra) -> int:
        out = client(url).chat.completions.create(model=BASE, messages=messages, max_tokens=1, temperature=0,
                                                  extra_body=extra)
        return out.usage.prompt_tokens

    def rendered(**kwargs) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    off = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert off == rendered(enable_thinking=False) > rendered() == prompt_tokens()
    # what the template does not read changes nothing: reasoning_effort here, as in vLLM
    assert prompt_tokens(reasoning_effort="low", chat_template_kwargs={"enable_thinking": True}) == rendered()
    refused = requests.post(f"{url}/v1/chat/completions", json={
        "model": BASE, "messages": messages, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, timeout=60)
    assert refused.status_code == 400 and "chat_template" in refused.json()["error"]["message"]


def test_max_tokens_0_with_echo_scores_the_prompt(url, hf):
    _, tokenizer = hf
    prompt = PROMPTS[2]
    args = dict(model=BASE, prompt=prompt, echo=True, logprobs=1, temperature=0)
    scored = client(url).completions.create(**args, max_tokens=0)
    [choice], n = scored.choices, len(tokenizer(prompt).input_ids)
    assert choice.text == prompt and len(choice.logprobs.tokens) == n
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == n
    generated = client(url).completions.create(**args, max_tokens=1).choices[0].logprobs
    assert choice.logprobs.token_logprobs == generated.token_logprobs[:n] and choice.logprobs.token_logprobs[1:]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, None),        # 0 only with echo
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 99}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "include_stop_str_in_output": True},
     "include_stop_str_in_output"),
])
def test_every_caller_error_is_a_400_with_openais_body(url, path, body, param):
    response = requests.post(f"{url}{path}", json={"model": BASE, **body}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "BadRequestError" and error["message"], response.text
    assert set(error) == {"message", "type", "code", "param"} and error["param"] == param


def test_reasoning_parser_splits_the_thinking_and_the_grammar_waits_for_its_end(url, hf):
    _, tokenizer = hf
    args = scripted(tokenizer)
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    whole = client(url).chat.completions.create(**args, response_format=schema).choices[0]
    reasoning = whole.message.reasoning_content
    assert reasoning and set(reasoning.split("ox")) == {""} and whole.message.reasoning == reasoning
    jsonschema.validate(json.loads(whole.message.content), ANSWER)   # the schema held only after </think>
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client(url).chat.completions.create(**args, response_format=schema, stream=True):
        for field in streamed:
            streamed[field] += getattr(chunk.choices[0].delta, field, None) or ""
    assert streamed == {"reasoning_content": reasoning, "content": whole.message.content}

    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    free = client(url).chat.completions.create(**args, extra_body=no_thinking).choices[0].message
    assert "</think>" in free.content and getattr(free, "reasoning_content", None) is None   # nothing split
    answer = client(url).chat.completions.create(**args, response_format=schema, extra_body=no_thinking)
    jsonschema.validate(json.loads(answer.choices[0].message.content), ANSWER)   # the grammar from token 1

    tool = {"type": "function", "function": {"name": "report", "parameters": ANSWER}}
    called = client(url).chat.completions.create(**{**args, "max_tokens": 96}, tools=[tool],
                                                 tool_choice="required").choices[0]
    assert called.finish_reason == "tool_calls" and set(called.message.reasoning_content.split("ox")) == {""}, called
    [call] = called.message.tool_calls
    assert call.function.name == "report"
    jsonschema.validate(json.loads(call.function.arguments), ANSWER)
