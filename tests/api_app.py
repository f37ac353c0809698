"""The app test_serve_api.py and test_serve_metrics.py drive: a tiny Qwen3 on two LLMServer replicas behind Serve's
HTTP proxy, adapter "a" configured and the others (hot, too_big, v1, v2) on disk for hot-load, served under the
importing module's APP name (each module deploys its own: the shared cluster is reset between modules)."""
from __future__ import annotations

import openai
import pytest

from factories import make_adapter

BASE = "tiny"
MAX_MODEL_LEN, MAX_RANK = 512, 8


@pytest.fixture(scope="module")
def files(model_dir, tmp_path_factory):
    model = model_dir("qwen3")
    root = tmp_path_factory.mktemp("serve_adapters")
    return {"model": model,
            "a": make_adapter(model, root / "a", r=8, seed=1),
            "hot": make_adapter(model, root / "hot", r=4, seed=2, target_modules=("q_proj", "o_proj", "up_proj")),
            "too_big": make_adapter(model, root / "too_big", r=16, seed=3),
            "v1": make_adapter(model, root / "v1", r=8, seed=4), "v2": make_adapter(model, root / "v2", r=8, seed=5)}


@pytest.fixture(scope="module")
def url(request, files, shared_serve):
    from ray import serve

    from deployments.app import build_app

    # max_ongoing_requests=2: a burst overflows the replica holding an adapter, so both replicas serve.
    # A 0.1 s heartbeat: the disconnect test must see, in the replicas' stats, a stream that lasts ~2 s here
    serve.run(build_app(dict(model=str(files["model"]), served_model_name=BASE, adapters={"a": str(files["a"])},
                             device="cpu", max_model_len=MAX_MODEL_LEN, max_lora_rank=MAX_RANK, num_replicas=2,
                             max_ongoing_requests=2, enable_hotload=True, registry_sync_interval_s=0.1)),
              name=request.module.APP, route_prefix="/")
    return shared_serve


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
