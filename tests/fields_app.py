"""The app test_openai_fields.py and test_openai_responses.py drive over HTTP: a tiny Qwen3 with Qwen3's think
tokens (thinking_model), one adapter "a", --reasoning-parser qwen3, served under the importing module's APP name;
and the scripted request both use (a few thinking tokens, then the answer)."""
from __future__ import annotations

import openai
import pytest
import requests

from deployments.app import build_app
from factories import make_adapter, thinking_model
from serve_fixtures import wait_until

BASE = "tiny"
MAX_MODEL_LEN = 1024
FIRST_MODELS: dict[str, dict] = {}   # app name -> its first answer to GET /v1/models
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def files(model_dir, tmp_path_factory):
    # room for a prompt with tools (the template's tool instructions) and a scripted thinking answer after it
    model = thinking_model(model_dir("qwen3", max_position_embeddings=MAX_MODEL_LEN),
                           tmp_path_factory.mktemp("fields") / "qwen3")
    return {"model": model, "a": make_adapter(model, tmp_path_factory.mktemp("fields") / "a", r=8, seed=4)}


@pytest.fixture(scope="module")
def url(request, files, shared_serve):
    from ray import serve

    name = request.module.APP
    # stream_batch_interval_ms: a 20 ms window (10 by default) for test_openai_fields' stream that crosses Ray in
    # batches
    app = build_app(dict(model=str(files["model"]), served_model_name=BASE, adapters={"a": str(files["a"])},
                         device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, max_lora_rank=8, num_replicas=1,
                         stream_batch_interval_ms=20, reasoning_parser="qwen3"))
    # not waiting for the app to be RUNNING, as `loraserve serve`'s port is open before: the first answer counts
    serve.run_many([serve.RunTarget(app, name=name, route_prefix="/")], wait_for_applications_running=False)

    def models():
        response = requests.get(f"{shared_serve}/v1/models", timeout=60)
        return response.json() if response.status_code == 200 else None

    FIRST_MODELS[name] = wait_until(models, 180, "the app's first answer", interval=0.02)
    return shared_serve


@pytest.fixture(scope="module")
def hf(files, hf_model):
    return hf_model(files["model"])


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def scripted(tokenizer) -> dict:
    """Greedy sampling that thinks "ox" a few times, then writes </think>: "ox" leads by 10 until the frequency
    penalty (2 per use) brings it under </think>, which leads every other token by ~20; after </think> a
    request's grammar, where it has one, leaves only its own tokens."""
    ox, end = tokenizer.encode(" fox")[-1], tokenizer.convert_tokens_to_ids("</think>")
    return dict(model=BASE, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=40,
                logit_bias={str(ox): 30, str(end): 20}, frequency_penalty=2.0)
