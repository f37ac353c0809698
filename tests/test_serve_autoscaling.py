"""Autoscaling (local Ray on loopback): a burst brings a second LLMServer replica up, which also serves an
adapter hot-loaded before it existed; every request succeeds; the deployment returns to one replica."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import requests

pytestmark = pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")

from factories import PROMPTS, make_adapter
from serve_fixtures import wait_until

APP, BASE = "scale", "tiny"
REPLICA = "x-loraserve-replica"
# metrics_interval_s: Serve 2.60 still pushes autoscaling metrics at this (deprecated) interval, 10 s by
# default; a short test needs them sooner.
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
               "downscale_delay_s": 2, "look_back_period_s": 1, "metrics_interval_s": 0.2}
BURST_WORKERS, BURST_MAX_REQUESTS, BURST_MAX_S = 6, 3000, 90   # bounded in count and in time


@pytest.fixture(scope="module")
def url(model_dir, tmp_path_factory, shared_serve):
    from ray import serve

    from deployments.app import build_app

    model = model_dir("qwen3")
    hot = make_adapter(model, tmp_path_factory.mktemp("scale") / "hot", r=8, seed=5)
    serve.run(build_app(dict(model=str(model), served_model_name=BASE, device="cpu", max_model_len=256,
                             autoscaling_config=AUTOSCALING, max_ongoing_requests=4,
                             registry_sync_interval_s=0.1, enable_hotload=True)), name=APP, route_prefix="/")
    # hot-loaded while only one replica exists: the replica autoscaling adds must still serve it
    load = requests.post(f"{shared_serve}/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(hot)},
                         timeout=120)
    assert load.status_code == 200, load.text
    return shared_serve


def running_replicas() -> dict[str, int]:
    from ray import serve
    return dict(serve.status().applications[APP].deployments["LLMServer"].replica_states)


def test_burst_scales_up_to_two_and_back_to_one(url):
    assert running_replicas() == {"RUNNING": 1}
    stop, sent = threading.Event(), iter(range(BURST_MAX_REQUESTS))
    lock, results = threading.Lock(), []

    def worker():
        deadline = time.monotonic() + BURST_MAX_S
        while not stop.is_set() and time.monotonic() < deadline:
            with lock:
                i = next(sent, None)
            if i is None:
                return
            body = {"model": "hot", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24, "temperature": 0.0,
                    "ignore_eos": True}
            response = requests.post(f"{url}/v1/completions", json=body, timeout=120)
            with lock:
                results.append((response.status_code, response.headers.get(REPLICA), response.text[:200]))

    with concurrent.futures.ThreadPoolExecutor(BURST_WORKERS) as pool:
        futures = [pool.submit(worker) for _ in range(BURST_WORKERS)]
        try:
            # keep the load on until the new replica has answered at least one request of the burst
            wait_until(lambda: len({r[1] for r in results if r[0] == 200}) >= 2, BURST_MAX_S,
                       "a second replica to serve part of the burst", interval=0.5)
        finally:
            stop.set()
            for future in futures:
                future.result()

    assert results and all(status == 200 for status, _, _ in results), [r for r in results if r[0] != 200][:3]
    assert len({replica for _, replica, _ in results}) == 2
    wait_until(lambda: running_replicas() == {"RUNNING": 1}, 90, "the deployment to scale back to one replica",
               interval=1.0)
    response = requests.post(f"{url}/v1/completions", json={"model": "hot", "prompt": "Hello", "max_tokens": 4},
                             timeout=120)
    assert response.status_code == 200
