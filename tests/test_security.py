"""Security at the HTTP edge, end to end (local Ray on loopback): the API key (openai client included), hot-load
off by default and bounded by adapter_roots when on, request size limits, OpenAI error bodies with a request id on
every route, and a caller's mistake logged as one WARNING line without traceback.

Two apps: `sec` (api_key, hot-load on, adapter_roots, 64 KiB body limit) and `plain` (defaults).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import openai
import pytest
import requests

from factories import make_adapter
from serve_fixtures import wait_until

APP, BASE, KEY = "sec", "tiny", "sekret-key-1"
MAX_BYTES = 64 * 1024
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTES = [("POST", "/v1/completions", {"model": BASE, "prompt": "Hi", "max_tokens": 2}),
          ("POST", "/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "Hi"}]}),
          ("GET", "/v1/models", None),
          ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}),
          ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"})]
INTERNALS = ("Traceback", "object at 0x", "<class ", "ActorID", "actor_id", "pid=", "namespace", "ray::")


@pytest.fixture(scope="module")
def files(model_dir, tmp_path_factory):
    model = model_dir("qwen3")
    base = tmp_path_factory.mktemp("security")
    root, outside = base / "root", base / "outside"
    files = {"model": model, "root": root, "outside": outside / "x", "fixed": root / "fixed",
             "hot": make_adapter(model, root / "hot", r=4, seed=12),
             "hot2": make_adapter(model, root / "hot2", r=4, seed=13)}
    for copy in ("outside", "fixed"):   # valid adapters; their weights do not matter here
        shutil.copytree(files["hot"], files[copy])
    shutil.copytree(files["hot"], root / "fifo")
    (root / "fifo" / "adapter_config.json").unlink()
    os.mkfifo(root / "fifo" / "adapter_config.json")
    (root / "link-out").symlink_to(files["outside"])
    (root / "a-file").write_text("not an adapter")
    return files


@pytest.fixture(scope="module")
def url(files, shared_serve):
    from ray import serve

    from deployments.app import build_app

    assert "LORASERVE_API_KEY" not in os.environ   # `plain` must run with its defaults
    common = dict(model=str(files["model"]), device="cpu", max_model_len=256)
    secured = build_app(dict(common, served_model_name=BASE, adapters={"fixed": str(files["fixed"])}, api_key=KEY,
                             enable_hotload=True, adapter_roots=[str(files["root"])], max_request_bytes=MAX_BYTES))
    plain = build_app(dict(common, served_model_name="plain"))
    serve.run_many([serve.RunTarget(secured, name=APP, route_prefix="/"),   # started together
                    serve.RunTarget(plain, name="plain", route_prefix="/plain")])
    return shared_serve


def call(url: str, method: str, path: str, body=None, headers=None, **kw) -> requests.Response:
    return requests.request(method, f"{url}{path}", json=body, headers=headers, timeout=60, **kw)


def openai_error(response: requests.Response, status: int, code: str | None = None) -> str:
    """The response is `status` with an OpenAI error body (and a request id); returns the message."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    assert response.headers.get("x-request-id"), response.headers
    if code:
        assert body["error"]["code"] == code, body
    message = body["error"]["message"]
    assert not any(marker in message for marker in INTERNALS), message
    return message


def greedy(url: str, model: str) -> list[float]:
    response = call(url, "POST", "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 6,
                                                     "temperature": 0, "logprobs": 0, "ignore_eos": True}, AUTH)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_the_openai_client_api_key_just_works(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    done = client.completions.create(model=BASE, prompt="Hello", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model=f"{BASE}:fixed", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert {m.id for m in client.models.list()} == {BASE, "fixed"}
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model=BASE, prompt="Hello", max_tokens=4)
    assert info.value.status_code == 401
    assert info.value.response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_v1_route_needs_the_key(url, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
        response = call(url, method, path, body, headers)
        openai_error(response, 401, "invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
    assert call(url, method, path, body, {"Authorization": f"bearer {KEY}"}).status_code != 401
    # the key is checked before the body is read: an oversized body without the key is a 401, not a 413
    if method == "POST":
        openai_error(requests.post(f"{url}{path}", data=b"x" * (2 * MAX_BYTES), timeout=60,
                                   headers={"content-type": "application/json"}), 401)


def test_metrics_are_scrapeable_without_the_key_by_default(url):
    """As vLLM's /metrics, for Prometheus; metrics_require_api_key closes it (test_fuzz_api's app)."""
    response = call(url, "GET", "/metrics")
    assert response.status_code == 200 and '# TYPE vllm:num_requests_running gauge' in response.text


def test_health_stays_open(url):
    assert requests.get(f"{url}/health", timeout=60).json() == {"status": "ok"}


def test_serves_own_routes_answer_without_the_key_and_tell_only_route_prefixes(url):
    """/-/routes and /-/healthz are answered by Serve's HTTP proxy before any application sees the request,
    so no API key gates them (docs/security.md); what they tell is each route prefix's application name."""
    routes = requests.get(f"{url}/-/routes", timeout=60)
    assert routes.status_code == 200 and routes.json() == {"/": APP, "/plain": "plain"}, routes.text
    health = requests.get(f"{url}/-/healthz", timeout=60)
    assert health.status_code == 200 and health.text == "success", health.text


def test_hotload_is_off_by_default(url):
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "/tmp"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "y"})):
        message = openai_error(call(url, "POST", f"/plain{path}", body), 403, "hotload_disabled")
        assert "--enable-hotload" in message and "enable_hotload: true" in message
    assert call(url, "POST", "/plain/v1/completions", {"model": "plain", "prompt": "Hi", "max_tokens": 2}).ok


def load(url: str, name: str, path, **extra) -> requests.Response:
    return call(url, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra}, AUTH)


def test_hot_load_replace_and_configured_adapters(url, files):
    assert load(url, "hot", files["hot"]).status_code == 200
    before = greedy(url, f"{BASE}:hot")
    assert load(url, "hot", files["hot"]).status_code == 200             # the same source again: fine
    message = openai_error(load(url, "hot", files["hot2"]), 400)         # another source: only when asked
    assert '"replace": true' in message
    assert greedy(url, f"{BASE}:hot") == before                          # the refusal changed nothing
    assert load(url, "hot", files["hot2"], replace=True).status_code == 200
    assert greedy(url, f"{BASE}:hot") != before                          # now it serves hot2's weights

    fixed = greedy(url, f"{BASE}:fixed")
    for response in (load(url, "fixed", files["hot"]), load(url, "fixed", files["hot"], replace=True),
                     call(url, "POST", "/v1/unload_lora_adapter", {"lora_name": "fixed"}, AUTH)):
        assert "part of the deployment's configuration" in openai_error(response, 400)
    assert greedy(url, f"{BASE}:fixed") == fixed

    assert call(url, "POST", "/v1/unload_lora_adapter", {"lora_name": "hot"}, AUTH).status_code == 200
    openai_error(call(url, "POST", "/v1/completions", {"model": f"{BASE}:hot", "prompt": "Hi"}, AUTH), 404,
                 "model_not_found")


@pytest.mark.parametrize("name", ["a/b", "..", "a b", "new\nline", "x" * 200, BASE, ":x"])
def test_bad_adapter_names_are_refused_at_the_edge(url, files, name):
    message = openai_error(load(url, name, files["hot"]), 400)
    assert "adapter name" in message and len(message) < 400
    assert name not in [m["id"] for m in call(url, "GET", "/v1/models", headers=AUTH).json()["data"][1:]]


def test_refusals_tell_nothing_about_paths_outside_the_roots(url, files):
    root = files["root"]
    messages = set()
    for source in (files["outside"], root / ".." / "outside" / "x", root / "link-out", root / "missing",
                   root / "a-file", Path("/etc"), Path("/etc/passwd"), Path("/no/such/dir"), Path("/dev/null")):
        message = openai_error(load(url, "probe", source), 400)
        messages.add(message.replace(repr(str(source)), "<source>"))
    assert messages == {"adapter 'probe': <source> is not an adapter directory inside the allowed adapter roots"}
    assert "absolute" in openai_error(load(url, "probe", "hot"), 400)                   # relative: refused
    assert "Hub ids are not allowed" in openai_error(load(url, "probe", "acme/tiny-lora"), 400)
    assert "probe" not in [m["id"] for m in call(url, "GET", "/v1/models", headers=AUTH).json()["data"]]


def test_a_fifo_adapter_file_is_refused_without_blocking(url, files):
    fifo = files["root"] / "fifo" / "adapter_config.json"
    try:
        response = load(url, "fifo", files["root"] / "fifo")
    finally:   # if a load ever opened the FIFO, a writer releases it, so the module can end
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
    assert "is not a regular file" in openai_error(response, 400)
    assert greedy(url, f"{BASE}:fixed")


def test_request_bodies_over_the_limit_get_413_before_parsing(url):
    headers = {**AUTH, "content-type": "application/json"}
    big = b'{"model": "tiny", "prompt": "' + b"x" * MAX_BYTES + b'"}'
    openai_error(requests.post(f"{url}/v1/completions", data=big, headers=headers, timeout=60), 413, "request_too_large")
    openai_error(requests.post(f"{url}/v1/completions", data=b"{" * (MAX_BYTES + 1), headers=headers, timeout=60),
                 413, "request_too_large")   # malformed, but too large is said first: nothing was parsed

    def chunked():   # no Content-Length: counted while it arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(16):
            yield b"x" * 8192
        yield b'"}'

    response = requests.post(f"{url}/v1/chat/completions", data=chunked(), headers=headers, timeout=60)
    assert response.request.headers["Transfer-Encoding"] == "chunked"
    openai_error(response, 413, "request_too_large")
    under = {"model": BASE, "prompt": "x" * (MAX_BYTES - 200), "max_tokens": 1}
    assert "max_model_len" in openai_error(call(url, "POST", "/v1/completions", under, AUTH), 400)


@pytest.mark.parametrize("what, method, path, kwargs, status, code", [
    ("unknown route", "GET", "/v1/nope", {}, 404, "not_found"),
    ("unknown root route", "POST", "/openapi.json", {}, 404, "not_found"),
    ("wrong method", "GET", "/v1/completions", {}, 405, "method_not_allowed"),
    ("wrong method on GET", "DELETE", "/v1/models", {}, 405, "method_not_allowed"),
    ("invalid UTF-8", "POST", "/v1/completions", {"data": b'{"model": "\xff\xfe"}'}, 400, "invalid_utf8"),
    ("not JSON media type", "POST", "/v1/completions", {"data": b"{}", "ctype": "text/plain"}, 415,
     "unsupported_media_type"),
    ("malformed JSON", "POST", "/v1/chat/completions", {"data": b'{"model": '}, 400, "invalid_json"),
    ("schema", "POST", "/v1/completions", {"json": {"model": BASE}}, 400, "invalid_request"),
    ("strict type", "POST", "/v1/completions", {"json": {"model": BASE, "prompt": "Hi", "max_tokens": "4"}}, 400,
     "invalid_request"),
    ("unknown field", "POST", "/v1/completions", {"json": {"model": BASE, "prompt": "Hi", "best_effort": 1}}, 400,
     "unknown_parameter"),
    ("unsupported field", "POST", "/v1/chat/completions",
     {"json": {"model": BASE, "messages": [{"role": "user", "content": "Hi"}],
               "functions": [{"name": "f"}]}}, 400, "unsupported_parameter"),
])
def test_every_error_is_an_openai_body_with_a_request_id(url, what, method, path, kwargs, status, code):
    headers = {**AUTH}
    if "data" in kwargs:
        headers["content-type"] = kwargs.get("ctype", "application/json")
    response = requests.request(method, f"{url}{path}", data=kwargs.get("data"), json=kwargs.get("json"),
                                headers=headers, timeout=60)
    message = openai_error(response, status, code)
    if code in ("unknown_parameter", "unsupported_parameter", "invalid_request") and "json" in kwargs:
        field = {"schema": "prompt", "strict type": "max_tokens", "unknown field": "best_effort",
                 "unsupported field": "functions"}[what]
        assert field in message, message
    echoed = requests.get(f"{url}/v1/nope", headers={**AUTH, "x-request-id": "client-chosen-id"}, timeout=60)
    assert echoed.headers["x-request-id"] == "client-chosen-id"


def test_logits_processors_reach_the_engine(url):
    body = {"model": BASE, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "logit_bias": {"7": 100}, "return_tokens_as_token_ids": True}
    response = call(url, "POST", "/v1/completions", body, AUTH)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:7"] * 4
    assert "logit_bias" in openai_error(call(url, "POST", "/v1/completions", {**body, "logit_bias": {"7": 101}},
                                             AUTH), 400)


def test_models_show_no_server_paths(url, files):
    text = call(url, "GET", "/v1/models", headers=AUTH).text
    assert '"fixed"' in text and "root" not in text and str(files["root"]) not in text


def _serve_log_lines(app: str) -> list[str]:
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return [line for path in sorted(logs.glob(f"replica_{app}_*.log")) for line in path.read_text().splitlines()]


def test_a_callers_mistake_is_one_warning_line_without_traceback(url):
    probes = {"sec-probe-engine": ("POST", "/v1/completions", {"model": BASE, "prompt": "Hi", "max_tokens": 4096}),
              "sec-probe-stream": ("POST", "/v1/completions",
                                   {"model": f"{BASE}:fixed", "prompt": "Hi", "max_tokens": 4096, "stream": True}),
              "sec-probe-route": ("GET", "/v1/nope", None),
              "sec-probe-adapter": ("POST", "/v1/load_lora_adapter", {"lora_name": "p", "lora_path": "/etc"})}
    for rid, (method, path, body) in probes.items():
        openai_error(call(url, method, path, body, {**AUTH, "x-request-id": rid}), 404 if "route" in rid else 400)

    def lines_of(rid: str) -> list[str]:
        return [line for line in _serve_log_lines(APP) if rid in line and "WARNING" in line]

    for rid in probes:
        wait_until(lambda: lines_of(rid), 30, f"the WARNING line of {rid}")
    lines = _serve_log_lines(APP)
    for rid in probes:
        mine = [line for line in lines if rid in line]
        assert len([line for line in mine if "WARNING" in line]) == 1, mine
        assert not [line for line in mine if line.startswith("ERROR")], mine
    # every request of this module so far was a caller's mistake or a success: not one traceback in its replicas
    assert not [line for line in lines if "Traceback" in line or line.startswith("ERROR")]
