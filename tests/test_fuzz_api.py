"""A generated fuzz of malformed requests over every route (local Ray on loopback, one Serve app, bounded in count
and time): no 5xx, an OpenAI error body with a request id on every error, one WARNING line per error and no
traceback in the log, and the same greedy canary output (and no leaked KV block) afterwards."""
from __future__ import annotations

import concurrent.futures
import json
import random
from pathlib import Path

import pytest
import requests

from factories import make_adapter
from serve_fixtures import wait_until

APP, BASE, KEY = "fuzz", "tiny", "fuzz-key"
MAX_BYTES = 32 * 1024
JSON = {"content-type": "application/json", "Authorization": f"Bearer {KEY}"}
INTERNALS = ("Traceback", "object at 0x", "<class ", "ActorID", "actor_id", "pid=", "namespace", "ray::",
             "site-packages")

VALID = {
    "/v1/completions": {"model": BASE, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": f"{BASE}:fixed", "messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 2},
    "/v1/load_lora_adapter": {"lora_name": "fz", "lora_path": "/nonexistent/adapter"},
    "/v1/unload_lora_adapter": {"lora_name": "nope"},
}
SAMPLING_BAD = {   # values no field of that name accepts (strict types, ranges, context)
    "model": [None, 5, [], {}, "", "nope", f"{BASE}:", f"{BASE}:nope", "x" * 300, "a/b", f"{BASE}:a:b"],
    "max_tokens": ["4", 4.5, True, 0, -1, 10 ** 12, [], {}],
    "temperature": ["1", True, -1, [], {}, None],
    "top_p": [0, -0.5, 2, "x", True],
    "top_k": ["5", 1.5, True, [], 10 ** 30],
    "seed": ["1", 1.5, True, 1 << 70, -(1 << 70)],
    "stop": [5, [5], [""], {"a": 1}, [None]],
    "stop_token_ids": ["1", [True], [1.5], None, {}],
    "ignore_eos": ["true", 1, None],
    "stream": ["true", 1, None, []],
    "stream_options": ["x", {"include_usage": "yes"}, {"foo": 1}, [], {"continuous_usage_stats": True}],
    "logit_bias": [{"x": 1}, {"1": 500}, {"1": "5"}, [], {"999999999": 1}, {str(i): 1 for i in range(301)}],
    "presence_penalty": [3, "0.5", True], "frequency_penalty": [-5, None], "repetition_penalty": [0, 5, "1"],
    "min_p": [2, -1], "min_tokens": [-1, 10 ** 6, 1.5],
    "n": [0, 17, "1", True], "best_of": [0, 17, "3"], "echo": ["yes", 1], "suffix": ["x"], "tools": [[{}]],
    "response_format": [{"type": "xml"}, "json", {"type": "json_schema"}, {"type": "text", "x": 1}],
    "top_logprobs": [21, -1, "3"], "prompt_logprobs": [1],
    "guided_json": [{}], "return_tokens_as_token_ids": ["yes"],
    "nonexistent_field": [1], "": [1], "x" * 100: [None],
}
ROUTE_BAD = {
    "/v1/completions": {"prompt": [None, 5, [], [True], [1.5], [[]], [10 ** 9], {"a": 1}, [[1], ["x"]], "",
                                   ["a"] * 300],
                        "logprobs": [21, -1, True, "1"]},
    "/v1/chat/completions": {
        "messages": [[], None, "hi", [{}], [{"role": "bogus", "content": "x"}], [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                     [{"role": "user", "content": [{"text": "x"}]}], [{"role": "user", "content": "x", "extra": 1}],
                     [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user"}] * 0],
        "max_completion_tokens": ["5", 0, -1, 10 ** 9], "logprobs": [1, "true"]},
    "/v1/load_lora_adapter": {
        "lora_name": ["", "a/b", "..", "x" * 200, BASE, 5, None, "a b", "ok\n", ":x", "../../etc"],
        "lora_path": ["", 5, None, "relative/x", "/nonexistent", "/etc", "/etc/passwd", "/dev/zero", "org/name",
                      "../../../etc", "~/x", "x" * 5000],
        "replace": ["yes", 1, None], "lora_int_id": [1]},
    "/v1/unload_lora_adapter": {"lora_name": ["", 5, None, "nope", "fixed", "x" * 200, "a/b"], "extra": [1]},
}
RAW_BAD = [b"", b"{", b"[]", b"null", b"42", b'"s"', b"\xff\xfe", b'{"model": "\xff"}', b"[" * 5000,
           b'{"model": "tiny", "prompt": "x", "temperature": NaN}', b'{"model": "tiny", "prompt": "x", "top_p": Infinity}',
           b"{'model': 'tiny'}", b'{"model": "tiny",}', b"\x00" * 64, "{\"model\": \"\u2028\"}".encode("utf-16")]
OTHER_ROUTES = [("GET", "/v1/nope"), ("POST", "/v2/completions"), ("GET", "/v1/completions/x"), ("GET", "/%ff"),
                ("GET", "/v1/../etc/passwd"), ("GET", "/openapi.json"), ("GET", "/docs"), ("PUT", "/health"), ("POST", "/health"),
                ("DELETE", "/v1/models"), ("POST", "/metrics"), ("PATCH", "/v1/completions"),
                ("OPTIONS", "/v1/chat/completions"), ("GET", "/v1/load_lora_adapter"), ("GET", "/")]


def generate_cases(rng: random.Random) -> list[tuple[str, str, dict, bytes | None]]:
    """(method, path, headers, body) of every malformed request; seeded, so a failure replays."""
    cases = []
    for path, valid in VALID.items():
        bad = dict(ROUTE_BAD[path], **(SAMPLING_BAD if "completions" in path else {}))
        for field, values in bad.items():
            for value in values:
                cases.append(("POST", path, JSON, json.dumps({**valid, field: value}).encode()))
        for field in valid:   # each field missing
            cases.append(("POST", path, JSON, json.dumps({k: v for k, v in valid.items() if k != field}).encode()))
        for raw in RAW_BAD:
            cases.append(("POST", path, JSON, raw))
        text = json.dumps(valid).encode()
        for _ in range(12):   # byte-level damage of a valid body
            damaged = bytearray(text)
            for _ in range(rng.randint(1, 4)):
                damaged[rng.randrange(len(damaged))] = rng.choice(b'{}[]":,\\\x00\xff0a')
            cases.append(("POST", path, JSON, bytes(damaged)))
        for headers in ({"content-type": "application/json"}, {**JSON, "Authorization": "Bearer nope"},
                        {**JSON, "content-type": "text/plain"}, {"Authorization": JSON["Authorization"]},
                        {**JSON, "content-type": "application/x-www-form-urlencoded"}):
            cases.append(("POST", path, headers, text))
        cases.append(("POST", path, JSON, b'{"model": "' + b"x" * MAX_BYTES + b'"}'))
        cases.append(("GET", path, JSON, None))
    for path in ("/v1/models", "/metrics"):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic Zm9vOmJhcg=="}):
            cases.append(("GET", path, headers, None))
        cases.append(("POST", path, JSON, b"{}"))
    cases += [(method, path, JSON, None) for method, path in OTHER_ROUTES]
    return cases


@pytest.fixture(scope="module")
def url(model_dir, tmp_path_factory, shared_serve):
    from ray import serve

    from deployments.app import build_app

    model = model_dir("qwen3")
    root = tmp_path_factory.mktemp("fuzz_adapters")
    fixed = make_adapter(model, root / "fixed", r=4, seed=21)
    serve.run(build_app(dict(model=str(model), served_model_name=BASE, adapters={"fixed": str(fixed)},
                             device="cpu", max_model_len=128, api_key=KEY, metrics_require_api_key=True,
                             enable_hotload=True, adapter_roots=[str(root)], max_request_bytes=MAX_BYTES)),
              name=APP, route_prefix="/")
    return shared_serve


def canary(url: str) -> list:
    out = []
    for model in (BASE, f"{BASE}:fixed"):
        response = requests.post(f"{url}/v1/completions", headers=JSON, timeout=60, json={
            "model": model, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})
        assert response.status_code == 200, response.text
        out.append(response.json()["choices"][0]["logprobs"]["tokens"])
    return out


def engines_idle() -> bool:
    import ray

    from deployments.adapter_registry import NAMESPACE, registry_name
    stats = ray.get(ray.get_actor(registry_name(APP, BASE), namespace=NAMESPACE).replica_stats.remote())
    engines = [s["engine"] for s in stats.values()]
    return bool(engines) and all(e["running"] == e["waiting"] == 0 and e["free_kv_blocks"] == e["total_kv_blocks"]
                                 for e in engines)


def send(url: str, index: int, case) -> tuple[int, requests.Response]:
    method, path, headers, body = case
    headers = {**headers, "x-request-id": f"fuzz{index:04d}z"}
    return index, requests.request(method, f"{url}{path}", headers=headers, data=body, timeout=60)


def test_metrics_need_the_key_when_the_app_requires_it(url):
    """metrics_require_api_key: /metrics is a /v1 route for the key (open by default: test_security)."""
    assert requests.get(f"{url}/metrics", timeout=30).status_code == 401
    response = requests.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 200 and "# TYPE vllm:request_success_total counter" in response.text


def test_fuzz_of_malformed_requests_over_every_route(url):
    before = canary(url)
    cases = generate_cases(random.Random(1234))
    assert len(cases) >= 200 and {c[1] for c in cases} >= {*VALID, "/v1/models", "/metrics", "/health"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:   # bounded: a fixed list, 4 at a time, 60 s each
        responses = dict(pool.map(lambda item: send(url, *item), enumerate(cases)))

    errors = {}
    for index, response in responses.items():
        case = cases[index]
        assert response.status_code < 500, (case[:2], case[3][:200] if case[3] else None, response.text[:300])
        if response.status_code >= 400:
            body = response.json()
            assert set(body) == {"error"} and all(isinstance(body["error"][k], str)
                                                  for k in ("message", "type", "code")), (case[:2], body)
            assert not any(marker in body["error"]["message"] for marker in INTERNALS), body
            assert len(body["error"]["message"]) <= 1000
            assert response.headers["x-request-id"] == f"fuzz{index:04d}z"
            errors[index] = response.status_code
    assert len(errors) >= 200, f"only {len(errors)} of {len(cases)} cases were refused"
    assert {400, 401, 404, 405, 413, 415} <= set(errors.values()) and 422 not in errors.values()   # no 422s

    assert canary(url) == before
    wait_until(engines_idle, 30, "every engine to be idle with all KV blocks free")
    _one_warning_line_per_error(errors)


def _one_warning_line_per_error(errors: dict[int, int]) -> None:
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"

    def lines() -> list[str]:
        return [line for path in sorted(logs.glob(f"replica_{APP}_*.log")) for line in path.read_text().splitlines()]

    def warned() -> dict[str, int]:
        counts: dict[str, int] = {}
        for line in lines():
            if line.startswith("WARNING") and "fuzz" in line:
                rid = line.split("request ", 1)[-1].split(" ", 1)[0]
                counts[rid] = counts.get(rid, 0) + 1
        return counts

    wait_until(lambda: len(warned()) >= len(errors), 30, "a WARNING line for every refused request")
    counts = warned()
    assert {f"fuzz{i:04d}z": 1 for i in errors} == {rid: n for rid, n in counts.items() if rid.startswith("fuzz")}
    assert not [line for line in lines() if "Traceback" in line or line.startswith("ERROR")]
