"""Serve end to end (local Ray on loopback, the two LLMServer replicas of tests/api_app.py's app): the openai
client, DeploymentHandle calls, hot-load / unload across replicas, errors, client disconnects (health, models
and metrics: test_serve_metrics.py)."""
from __future__ import annotations

import concurrent.futures

import pytest
import requests

from api_app import BASE, MAX_MODEL_LEN, MAX_RANK, client, files, url  # noqa: F401 (fixtures)
from factories import PROMPTS
from serve_fixtures import wait_until
from workers import EngineConfig, LLMEngine, SamplingParams

APP = "api"
REPLICA = "x-loraserve-replica"


@pytest.fixture(scope="module")
def reference(files):
    engine = LLMEngine(EngineConfig(model=str(files["model"]), device="cpu", max_model_len=MAX_MODEL_LEN,
                                    max_lora_rank=MAX_RANK))
    engine.load_adapter("a", str(files["a"]))
    return engine


def ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def replica_stats() -> dict[str, dict]:
    """Every live replica's last heartbeat (engine stats, loaded adapters, metric totals)."""
    import ray

    from deployments.adapter_registry import NAMESPACE, registry_name
    registry = ray.get_actor(registry_name(APP, BASE), namespace=NAMESPACE)
    return ray.get(registry.replica_stats.remote())


def complete(url: str, model: str, **kw) -> requests.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0, **kw}
    return requests.post(f"{url}/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize("model, adapter", [(BASE, None), (f"{BASE}:a", "a")])
def test_openai_client_greedy_equals_engine_generate(url, reference, model, adapter):
    c, prompt, n = client(url), PROMPTS[1], 8
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}

    expected = reference.generate(prompt, params, [adapter])[0]
    done = c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=1, extra_body=extra)
    assert ids(done.choices[0].logprobs.tokens) == expected.token_ids
    assert done.choices[0].text == expected.text and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(expected.prompt_token_ids), n)
    chunks = [ch.choices[0] for ch in c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                                           logprobs=1, stream=True, extra_body=extra)]
    assert sum((ids(ch.logprobs.tokens) for ch in chunks), []) == expected.token_ids
    assert "".join(ch.text for ch in chunks) == expected.text and chunks[-1].finish_reason == "length"

    messages = [{"role": "user", "content": prompt}]
    chat_prompt = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference.generate(chat_prompt, params, [adapter])[0]
    chat = c.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0, logprobs=True,
                                     extra_body=extra)
    assert ids([t.token for t in chat.choices[0].logprobs.content]) == expected.token_ids
    assert chat.choices[0].message.content == expected.text
    chunks = [ch.choices[0] for ch in c.chat.completions.create(model=model, messages=messages, max_tokens=n,
                                                                temperature=0, stream=True, extra_body=extra)]
    assert "".join(ch.delta.content or "" for ch in chunks) == expected.text
    assert chunks[0].delta.role == "assistant" and chunks[-1].finish_reason == "length"


def test_handle_generate_and_generate_stream_agree(url, reference):
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name=APP)
    params = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    out = handle.options(multiplexed_model_id="a").generate.remote(PROMPTS[2], params).result(timeout_s=120)
    deltas = list(handle.options(multiplexed_model_id="a", stream=True).generate_stream.remote(PROMPTS[2], params))
    assert sum((d.token_ids for d in deltas), []) == out.token_ids
    assert "".join(d.text for d in deltas) == out.text and deltas[-1].finish_reason == out.finish_reason == "length"
    assert out.token_ids == reference.generate(PROMPTS[2], SamplingParams(**params), ["a"])[0].token_ids
    assert out.adapter == "a" and out.replica_id
    # a SamplingParams object works as well as a dict
    again = handle.options(multiplexed_model_id="a").generate.remote(PROMPTS[2], SamplingParams(**params))
    assert again.result(timeout_s=120).token_ids == out.token_ids


def test_hot_load_is_served_by_every_replica_and_unload_reaches_all(url, files):
    load = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(files["hot"])},
                         timeout=120)
    assert load.status_code == 200, load.text
    assert "hot" in [m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]]

    def burst(model: str, count: int = 12) -> list[requests.Response]:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            return list(pool.map(lambda i: complete(url, model, prompt=PROMPTS[i % 8], max_tokens=12), range(count)))

    served_by: set[str] = set()
    for _ in range(3):   # bounded: each burst overflows the holder's 2 slots, so the other replica takes some
        responses = burst(f"{BASE}:hot")
        assert [r.status_code for r in responses] == [200] * len(responses), responses[0].text
        served_by |= {r.headers[REPLICA] for r in responses}
        if len(served_by) == 2:
            break
    assert len(served_by) == 2
    # stats are each replica's last heartbeat (every registry_sync_interval_s): the serving replica's may lag
    wait_until(lambda: all("hot" in s["adapters_loaded"] for s in replica_stats().values()), 10,
               "both replicas' heartbeats to report the hot adapter loaded")

    unload = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "hot"}, timeout=120)
    assert unload.status_code == 200, unload.text
    assert not any("hot" in s["adapters_loaded"] for s in replica_stats().values())   # no wait: unload waited
    after = burst(f"{BASE}:hot", count=8)
    assert {r.status_code for r in after} == {404}
    assert after[0].json()["error"]["code"] == "model_not_found"
    assert "hot" not in [m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]]
    assert complete(url, f"{BASE}:a").status_code == 200


def test_replace_under_streaming_clients_keeps_each_stream_on_its_version(url, files):
    """8 streams on version 1; a replace (200 "replaced") while they run: each of them finishes on version 1,
    every request started after the replace returned runs on version 2 (references: the engine)."""
    n, extra = 40, {"ignore_eos": True, "return_tokens_as_token_ids": True}
    reference = {}
    for version in ("v1", "v2"):
        engine = LLMEngine(EngineConfig(model=str(files["model"]), device="cpu", max_model_len=MAX_MODEL_LEN,
                                        max_lora_rank=MAX_RANK))
        engine.load_adapter("ver", str(files[version]))
        reference[version] = [o.token_ids for o in engine.generate(
            PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), adapters=["ver"] * 8)]
    load = lambda version, **kw: requests.post(f"{url}/v1/load_lora_adapter", timeout=120, json={  # noqa: E731
        "lora_name": "ver", "lora_path": str(files[version]), **kw})
    assert load("v1").json()["status"] == "loaded"
    started = [concurrent.futures.Future() for _ in PROMPTS]

    def stream(i: int) -> list[int]:
        tokens = []
        for chunk in client(url).completions.create(model=f"{BASE}:ver", prompt=PROMPTS[i], max_tokens=n,
                                                    temperature=0, logprobs=1, stream=True, extra_body=extra):
            tokens += ids(chunk.choices[0].logprobs.tokens)
            if tokens and not started[i].done():
                started[i].set_result(True)
        return tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        old = [pool.submit(stream, i) for i in range(8)]
        concurrent.futures.wait(started, timeout=120)
        replaced = load("v2", replace=True)
        assert replaced.status_code == 200 and replaced.json()["status"] == "replaced", replaced.text
        new = [pool.submit(stream, i) for i in range(8)]
        assert [f.result(timeout=300) for f in old] == reference["v1"]
        assert [f.result(timeout=300) for f in new] == reference["v2"]
    assert load("v2").json()["status"] == "unchanged"
    assert requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ver"}, timeout=120).status_code == 200


BAD_REQUESTS = [  # (what, path, json body or raw text, status, a word of the message)
    ("unknown adapter", "/v1/completions", {"model": f"{BASE}:nope", "prompt": "Hi"}, 404, "nope"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]},
     404, "gpt-4"),
    ("malformed JSON", "/v1/completions", '{"model": "tiny", "prompt": ', 400, "JSON"),
    ("missing field", "/v1/completions", {"model": BASE}, 400, "prompt"),
    ("unsupported suffix", "/v1/completions", {"model": BASE, "prompt": "Hi", "suffix": "x"}, 400, "suffix"),
    ("max_tokens beyond context", "/v1/completions", {"model": BASE, "prompt": "Hi", "max_tokens": 4096}, 400,
     "max_model_len"),
    ("streamed, beyond context", "/v1/completions",
     {"model": f"{BASE}:a", "prompt": "Hi", "max_tokens": 4096, "stream": True}, 400, "max_model_len"),
    ("chat beyond context", "/v1/chat/completions",
     {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4096}, 400, "max_model_len"),
    ("negative temperature", "/v1/completions", {"model": BASE, "prompt": "Hi", "temperature": -1}, 400,
     "temperature"),
    ("adapter path missing", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"}, 400,
     "/no/such/adapter"),
    ("adapter rank too big", "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": "{too_big}"}, 400,
     "max_lora_rank"),
    ("bad adapter name", "/v1/load_lora_adapter", {"lora_name": "a:b", "lora_path": "{too_big}"}, 400, "a:b"),
    ("1 MB adapter path", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/" + "x" * (1 << 20)}, 400,
     "lora_path: 1048577 characters, over the limit of 4096"),
    ("unload unknown", "/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "nope"),
]


@pytest.mark.parametrize("what, path, body, status, word", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_errors_are_openai_bodies_and_the_service_keeps_serving(url, files, what, path, body, status, word):
    if isinstance(body, dict):
        body = {k: v.format(too_big=files["too_big"]) if isinstance(v, str) else v for k, v in body.items()}
        response = requests.post(f"{url}{path}", json=body, timeout=120)
    else:
        response = requests.post(f"{url}{path}", data=body, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert word in error["message"] and error["type"] and error["code"]
    assert complete(url, f"{BASE}:a").status_code == 200
    assert complete(url, BASE).status_code == 200


def test_client_disconnect_mid_stream_aborts_and_releases(url):
    def totals(key: str) -> float:
        return sum(v for s in replica_stats().values() for k, v in s["metrics"].items() if k.startswith(key))

    aborted_before = totals('requests_total{kind="lora",outcome="abort"')
    stream = client(url).completions.create(model=f"{BASE}:a", prompt="Hello", max_tokens=MAX_MODEL_LEN - 16,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    wait_until(lambda: any(s["engine"]["running"] == 1 and s["engine"]["lora"]["host_cache"]["referenced"] == 1
                           for s in replica_stats().values()), 30, "the stream to hold KV blocks and its adapter")
    stream.close()

    def released() -> bool:
        engines = [s["engine"] for s in replica_stats().values()]
        return all(e["running"] == e["waiting"] == 0 and e["free_kv_blocks"] == e["total_kv_blocks"]
                   and e["lora"]["host_cache"]["referenced"] == 0 for e in engines)

    wait_until(released, 30, "KV blocks and adapter references to be released on every replica")
    # the replica counts the abort once its handler has seen the cancellation: maybe a heartbeat after the engine's
    aborted = 'requests_total{kind="lora",outcome="abort"'
    wait_until(lambda: totals(aborted) >= aborted_before + 1, 10, "the abort to be counted")
    assert totals(aborted) == aborted_before + 1


def test_hotload_without_adapter_roots_warns_at_start(url):
    """This app enables hot-load with no adapter_roots: its ingress says so in its log when it starts."""
    from pathlib import Path

    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    ingress_logs = [p.read_text() for p in logs.glob(f"replica_{APP}_OpenAIIngress_*.log")]
    assert ingress_logs and all("WARNING" in text and "hot-load is enabled without adapter_roots" in text
                                for text in ingress_logs)
