"""Serve end to end, what operators read: /health, /v1/models, /metrics with loraserve's series and vLLM's
(summed over the two replicas of tests/api_app.py's app), and vllm:lora_requests_info as llm-d reads it."""
from __future__ import annotations

import concurrent.futures
import time

import requests

from api_app import BASE, MAX_MODEL_LEN, client, files, url  # noqa: F401 (fixtures)
from factories import PROMPTS
from serve_fixtures import wait_until

APP = "api-metrics"


def test_health_models_and_metrics(url, files):
    assert requests.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
    models = requests.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [BASE, "a"] and models[1]["parent"] == BASE
    # counters show once they count: a hot-loaded adapter read from disk, and requests of the base model, "a" and
    # it on both replicas (base-model requests go to the least-loaded replica, an adapter's past its home's floor)
    load = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(files["hot"])},
                         timeout=120)
    assert load.status_code == 200, load.text
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        done = list(pool.map(lambda m: client(url).completions.create(model=m, prompt="Hello", max_tokens=4),
                             [BASE, f"{BASE}:a", f"{BASE}:hot"] * 2))
    assert all(c.usage.completion_tokens == 4 for c in done)
    names = ("requests_total", "generated_tokens_total", "adapter_loads_total", "adapter_load_seconds_count",
             "lora_host_cache_hits_total", "lora_host_cache_misses_total", "lora_slot_hits_total",
             "lora_slot_misses_total", "kv_cache_free_blocks")

    def complete_metrics() -> bool:   # the replicas' series reach /metrics with their next heartbeats
        text = requests.get(f"{url}/metrics", timeout=30).text
        # every series, and each of the nine with both replicas' labelled samples
        return all(f"# TYPE loraserve_{n} " in text for n in names) and text.count(f'model="{BASE}",replica=') >= 2 * 9
    wait_until(complete_metrics, 30, f"{', '.join(names)} from both replicas in /metrics")
    unload = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "hot"}, timeout=120)
    assert unload.status_code == 200, unload.text


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """GET /metrics as Prometheus parses it: sample name -> {sorted labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def vllm_value(metrics: dict, name: str, **labels: str) -> float:
    """A sample of the application's vLLM series (model_name, engine "0")."""
    return metrics.get(f"vllm:{name}", {}).get(tuple(sorted(dict(model_name=BASE, engine="0", **labels).items())), 0)


def test_vllm_metrics_count_the_requests_made(url):
    """vLLM's names, summed over both replicas: counters and histogram counts advance by what was served."""
    def ended(metrics: dict) -> float:
        return sum(vllm_value(metrics, "request_success_total", finished_reason=r)
                   for r in ("stop", "length", "abort", "error"))

    def settled() -> dict | None:   # every earlier request counted: two heartbeats agree
        first = scrape(url)
        time.sleep(0.3)
        second = scrape(url)
        return second if ended(first) == ended(second) else None

    before, c, k = wait_until(settled, 30, "the replicas' counts to settle"), client(url), 6
    usage = []
    for i, model in enumerate([BASE, f"{BASE}:a", BASE, f"{BASE}:a"]):
        kw = dict(model=model, prompt=PROMPTS[i], max_tokens=k, temperature=0.0, extra_body={"ignore_eos": True})
        if i % 2:
            usage.append(list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))[-1].usage)
        else:
            usage.append(c.completions.create(**kw).usage)
    assert [u.completion_tokens for u in usage] == [k] * 4
    after = wait_until(lambda: m if ended(m := scrape(url)) >= ended(before) + 4 else None, 30, "4 more ends")

    def delta(name: str, **labels: str) -> float:
        return vllm_value(after, name, **labels) - vllm_value(before, name, **labels)

    assert (ended(after) - ended(before), delta("request_success_total", finished_reason="length")) == (4, 4)
    assert delta("generation_tokens_total") == 4 * k
    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    for name, count in [("time_to_first_token_seconds", 4), ("e2e_request_latency_seconds", 4),
                        ("request_queue_time_seconds", 4), ("request_prompt_tokens", 4),
                        ("request_generation_tokens", 4), ("inter_token_latency_seconds", 4 * (k - 1))]:
        assert delta(f"{name}_count") == count, name
        assert delta(f"{name}_bucket", le="+Inf") == count, name
    assert (delta("request_generation_tokens_bucket", le="5.0"), delta("request_generation_tokens_bucket", le="10.0"),
            delta("request_generation_tokens_sum")) == (0, 4, 4 * k)
    assert delta("e2e_request_latency_seconds_sum") >= delta("time_to_first_token_seconds_sum") > 0
    assert 0 <= vllm_value(after, "kv_cache_usage_perc") <= 1 and "vllm:num_requests_waiting" in after


def test_lora_requests_info_shows_a_running_adapter_and_keeps_it_after(url):
    """What llm-d's LoRA-affinity scorer reads: the vllm:lora_requests_info series with the latest value."""
    def now() -> dict[str, str]:
        info = scrape(url)["vllm:lora_requests_info"]
        return dict(max(info, key=info.get))

    stream = client(url).completions.create(model=f"{BASE}:a", prompt="Hello", max_tokens=MAX_MODEL_LEN - 16,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    running = wait_until(lambda: info if (info := now())["running_lora_adapters"] == "a" else None, 30,
                         "the application's series to name the running adapter")
    stream.close()
    assert "replica" not in running and int(running["max_lora"]) > 0
    wait_until(lambda: now()["running_lora_adapters"] == "", 30, "the adapter to stop running")
    kept = [dict(k) for k in scrape(url)["vllm:lora_requests_info"]]
    assert any(k.get("replica") and k["running_lora_adapters"] == "a" and 2 * int(k["max_lora"]) ==
               int(running["max_lora"]) for k in kept), kept
