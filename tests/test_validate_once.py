"""Each request rule runs once per request (workers/request.py): a chat completion and a text completion go
through the real path, HTTP ingress (its body models) -> replica (LLMServer) -> async front -> engine core,
in one process without Ray (Serve's handle replaced by a direct call of the same replica method), with every
rule function wrapped to count its calls."""
from __future__ import annotations

import asyncio
import collections
import functools
import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request

import deployments.choices as choices
import deployments.protocol as protocol
import workers.engine as engine_module
import workers.request as request_module
import workers.tokenizer as tokenizer_module
from deployments.config import LLMConfig
from deployments.llm_server import LLMServer
from deployments.openai_api import OpenAIIngress
from workers.config import SamplingParams
from workers.engine_process import start_engine

# module -> the rule functions it calls (each rule is one function; its callers import it by name)
RULES = {request_module: ("check_prompt", "check_token_ids", "check_fits", "room_to_generate"),
         tokenizer_module: ("check_prompt_chars",), engine_module: ("check_prompt_chars",),
         choices: ("check_choices",), protocol: ("check_choices",)}


class Ingress(OpenAIIngress):
    def __del__(self):   # Serve's shutdown hook (a coroutine) is for a deployed replica: none here
        pass


class Replica(LLMServer):
    def __del__(self):   # as Ingress's; the fixture closes the engine
        pass


@pytest.fixture(scope="module")
def replica(model_dir):
    """An LLMServer replica's request path on an engine in this process (its step thread), without Serve."""
    config = LLMConfig(model=str(model_dir("qwen3")), device="cpu", max_model_len=256)
    server = object.__new__(Replica)
    server.replica_id = "replica-0"
    server._use_engine(start_engine(config.engine_config(), {}, own_process=False), config)
    ingress = object.__new__(Ingress)
    ingress.base_model, ingress.api_key, ingress.max_request_bytes = config.base_model_name, None, 1 << 20
    handle = SimpleNamespace(render_choices=SimpleNamespace(remote=server.render_choices),
                             render_stream=SimpleNamespace(remote=server.render_stream))
    ingress._handle = lambda adapter, stream=False: handle
    ingress.replica = server   # for the handle calls' edge
    yield ingress
    server.engine.close()


@pytest.fixture
def counts(monkeypatch):
    """rule name -> calls (check_token_ids by what it checks: the prompt's ids and logit_bias are two rules)."""
    calls: collections.Counter = collections.Counter()

    def counted(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls[f"{name}({args[2]})" if name == "check_token_ids" else name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for module, names in RULES.items():
        for name in names:
            monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    monkeypatch.setattr(SamplingParams, "__post_init__", counted("SamplingParams", SamplingParams.__post_init__))
    return calls


def post(ingress, route, body: dict):
    """The ingress's route on an HTTP request of `body`: (status, response body)."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": route, "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]}

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    async def call():
        method = {"/v1/chat/completions": ingress.chat_completions, "/v1/completions": ingress.completions}[route]
        response = await method(Request(scope, receive))
        if hasattr(response, "body_iterator"):
            return response.status_code, "".join([chunk async for chunk in response.body_iterator])
        return response.status_code, response.body.decode()

    return asyncio.run(call())


ONCE = {"check_prompt": 1, "check_token_ids(prompt token ids)": 1, "check_token_ids(logit_bias token ids)": 1,
        "check_fits": 1, "check_prompt_chars": 1, "check_choices": 1, "SamplingParams": 1}


def test_a_streamed_chat_request_runs_each_rule_once(replica, counts):
    status, body = post(replica, "/v1/chat/completions", {
        "model": replica.base_model, "messages": [{"role": "user", "content": "Hello there"}], "stream": True,
        "temperature": 0, "logit_bias": {"5": 1.0}})
    assert status == 200 and body.endswith("data: [DONE]\n\n") and '"finish_reason": "length"' in body
    assert dict(counts) == {**ONCE, "room_to_generate": 1}   # chat: max_tokens defaults to the rest of the context


def test_a_completion_runs_each_rule_once(replica, counts):
    status, body = post(replica, "/v1/completions", {"model": replica.base_model, "prompt": "Once upon",
                                                     "max_tokens": 4, "n": 2, "seed": 7})
    assert status == 200 and len(json.loads(body)["choices"]) == 2
    assert dict(counts) == ONCE   # n = 2: its choices share the request's checks


def test_a_handle_calls_dict_is_built_into_sampling_params_once(replica, counts):
    """The handle API's dict form (docs/serving.md): one SamplingParams, its max_tokens None resolved once."""
    outs = asyncio.run(replica.replica.generate_choices(
        messages=[{"role": "user", "content": "Hello there"}], sampling_params={"temperature": 0, "max_tokens": None},
        n=2))
    assert [out.finish_reason for out in outs] == ["length"] * 2   # the rest of the context: max_model_len reached
    assert len(outs[0].prompt_token_ids) + len(outs[0].token_ids) == 256
    assert dict(counts) == {**ONCE, "room_to_generate": 1}   # n = 2: its choices share the request's checks


def test_a_refused_request_is_refused_by_its_rule(replica, counts):
    status, body = post(replica, "/v1/completions", {"model": replica.base_model, "prompt": "", "max_tokens": 4})
    assert status == 400 and "prompt is empty" in body
    assert counts["check_prompt"] == 1 and "check_fits" not in counts
