"""vLLM's metrics without Ray (deployments/vllm_metrics.py): what a replica records from its requests and its
engine's stats, the ingress's text (parsed by prometheus_client, as Prometheus would), and the Grafana
dashboard's queries (every metric it reads is one the ingress exports)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.metrics import ServerMetrics, render_prometheus
from deployments.vllm_metrics import (ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, RequestTimer, VLLMMetrics,
                                      build_1_2_5_buckets, render_vllm)
from workers.sequence import RequestOutput

DASHBOARD = Path(__file__).resolve().parent.parent / "deployments" / "grafana" / "loraserve.json"
# the names the issue and vLLM's dashboards read, with their types
VLLM_TYPES = {"num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
              "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
              "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
              "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
              "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
              "lora_requests_info": "gauge"}


def engine_stats(running=0, waiting=0, free=10, total=10, lora_running=None, lora_waiting=None, preemptions=0):
    return {"running": running, "waiting": waiting, "free_kv_blocks": free, "total_kv_blocks": total,
            "num_preemptions": preemptions, "prefix_cache": {"queried_tokens": 40, "hit_tokens": 16},
            "lora": {"host_cache": {"hits": 3, "misses": 1}, "slots": {"hits": 2, "misses": 1},
                     "requests": {"running": lora_running or {}, "waiting": lora_waiting or {}},
                     "residency": {"device": ["a"], "host": ["a", "b"], "loading": []}}}


def output(tokens: int, queue_time: float | None = None, finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", [], list(range(tokens)), "", [0.0] * tokens, finish, queue_time=queue_time)


def serve_request(metrics: ServerMetrics, adapter: str | None, prompt: int, outputs: list[int], reason: str) -> None:
    """What LLMServer._outputs does for one request whose engine outputs carry these token counts."""
    request = RequestTimer(adapter, prompt)
    for i, count in enumerate(outputs):
        metrics.record_output(request, output(count, queue_time=0.02 if i == 0 else None))
    metrics.record_request(request, reason)


@pytest.fixture
def replicas() -> dict[str, dict]:
    """Two replicas' heartbeats after a few requests (stats() as LLMServer sends them)."""
    one, two = ServerMetrics("tiny", 100, 4), ServerMetrics("tiny", 100, 4)
    serve_request(one, "a", 5, [1, 1, 2], "length")      # 4 tokens: 1 TTFT, 3 inter-token latencies
    serve_request(one, None, 7, [2], "stop")             # 2 tokens arriving together: 1 TTFT + one 0 s ITL
    serve_request(two, "b", 3, [], "abort")               # aborted before its first token
    one.record_adapter_load(0.2, ok=True)
    one.record_engine(engine_stats(running=1, waiting=2, free=4, lora_running={"a": 1}, lora_waiting={"b": 2}))
    two.record_engine(engine_stats(free=9, lora_running={"b": 1}))
    return {name: {"metrics": m.totals(), "vllm": m.vllm.snapshot()} for name, m in (("r1", one), ("r2", two))}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(family, name: str | None = None) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if name is None or s.name == name}


def test_bucket_boundaries_are_vllms():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(512)[-3:] == [100, 200, 500]
    assert (TTFT_BUCKETS[0], TTFT_BUCKETS[-1], len(TTFT_BUCKETS)) == (0.001, 2560.0, 22)
    assert (ITL_BUCKETS[0], ITL_BUCKETS[-1], len(ITL_BUCKETS)) == (0.01, 80.0, 19)
    assert (REQUEST_LATENCY_BUCKETS[0], REQUEST_LATENCY_BUCKETS[-1], len(REQUEST_LATENCY_BUCKETS)) == (0.3, 7680.0, 21)


def test_request_timer_splits_a_gap_among_tokens_that_arrive_together():
    request = RequestTimer("a", 4)
    assert request.tokens(0, 0.5) is False and request.queue_time == 0.5   # an empty output: no token yet
    assert request.tokens(3, None) is True and request.time_to_first_token >= 0
    assert request.inter_token == [0.0, 0.0]                                # came with the first token
    request.last_token -= 1.0                                               # the next output, 1 s later
    assert request.tokens(2, None) is False
    assert request.inter_token[2:] == [pytest.approx(0.5, abs=0.01)] * 2 and request.generated == 5


def test_every_vllm_name_has_help_type_and_the_summed_values(replicas):
    text = render_vllm(replicas, "tiny")
    found = families(text)
    for name, kind in VLLM_TYPES.items():
        assert found[f"vllm:{name}"].type == kind, name
        assert f"# HELP vllm:{name}{'_total' if kind == 'counter' else ''} " in text, name
        assert f"# TYPE vllm:{name}{'_total' if kind == 'counter' else ''} {kind}" in text, name
    base = (("engine", "0"), ("model_name", "tiny"))
    value = {name: samples(found[f"vllm:{name}"]).get(base) for name in VLLM_TYPES}
    assert (value["num_requests_running"], value["num_requests_waiting"]) == (1, 2)
    assert value["kv_cache_usage_perc"] == pytest.approx((6 + 1) / 20)
    assert (value["prompt_tokens"], value["generation_tokens"]) == (15, 6)
    success = {dict(k)["finished_reason"]: v for k, v in samples(found["vllm:request_success"]).items()}
    assert success == {"stop": 1, "length": 1, "abort": 1, "error": 0}
    assert samples(found["vllm:prefix_cache_hits"])[base] == 32               # 16 tokens on each replica


def test_histograms_sum_buckets_over_replicas(replicas):
    found = families(render_vllm(replicas, "tiny"))
    counts = {"time_to_first_token_seconds": 2, "inter_token_latency_seconds": 4, "e2e_request_latency_seconds": 3,
              "request_queue_time_seconds": 2, "request_prompt_tokens": 3, "request_generation_tokens": 3}
    for name, count in counts.items():
        family = found[f"vllm:{name}"]
        buckets = [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
        assert [v for _, v in buckets] == sorted(v for _, v in buckets), name     # cumulative
        assert buckets[-1] == (float("inf"), count) and samples(family, f"vllm:{name}_count") == {
            (("engine", "0"), ("model_name", "tiny")): count}, name
    generation = found["vllm:request_generation_tokens"]
    assert {s.labels["le"]: s.value for s in generation.samples if s.name.endswith("_bucket")}["2.0"] == 2  # 0, 2
    assert samples(generation, "vllm:request_generation_tokens_sum") == {(("engine", "0"), ("model_name", "tiny")): 6}
    queue = samples(found["vllm:request_queue_time_seconds"], "vllm:request_queue_time_seconds_sum")
    assert list(queue.values()) == [pytest.approx(0.04)]


def test_lora_requests_info_the_application_now_and_each_replicas_recent_series(replicas):
    series = samples(families(render_vllm(replicas, "tiny"))["vllm:lora_requests_info"])
    now = [dict(k) for k in series if "replica" not in dict(k)]
    assert now == [{"max_lora": "8", "running_lora_adapters": "a,b", "waiting_lora_adapters": "b"}]
    assert {(d["replica"], d["running_lora_adapters"], d["waiting_lora_adapters"], d["max_lora"])
            for d in map(dict, series) if "replica" in d} == {("r1", "a", "b", "4"), ("r2", "b", "", "4")}
    # the latest value is the application's series: the one llm-d's scorer takes
    assert max(series, key=series.get) == tuple(sorted(now[0].items()))


def test_a_replica_keeps_an_adapter_in_its_history_after_it_finished():
    metrics = VLLMMetrics("tiny", 64, 2)
    metrics.record_engine(engine_stats(lora_running={"a": 1}))
    metrics.record_engine(engine_stats())   # idle: both lists empty, the newest series
    metrics.record_engine(engine_stats())
    series = metrics.snapshot()["lora_requests_info"]["series"]
    assert [(r, w) for r, w, _ in series] == [("a", ""), ("", "")] and series[0][2] <= series[1][2]


def test_our_per_replica_metrics_stay_beside_them(replicas):
    text = render_prometheus(replicas, "tiny")
    found = families(text)
    assert samples(found["loraserve_adapter_requests"])[
        (("adapter", "b"), ("model", "tiny"), ("replica", "r1"), ("state", "waiting"))] == 2
    assert samples(found["loraserve_adapter_resident"])[
        (("adapter", "b"), ("model", "tiny"), ("replica", "r2"), ("where", "host"))] == 1
    assert samples(found["loraserve_requests"])[
        (("kind", "lora"), ("model", "tiny"), ("outcome", "length"), ("replica", "r1"))] == 1


def test_label_values_are_escaped():
    text = render_vllm({"r1": {"vllm": VLLMMetrics('a"b\\c', 16, 1).snapshot()}}, 'a"b\\c')
    assert {s.labels["model_name"] for f in text_string_to_metric_families(text) for s in f.samples} == {'a"b\\c'}


def test_the_grafana_dashboard_queries_only_metrics_we_export(replicas):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exported = set()
    for family in text_string_to_metric_families(render_vllm(replicas, "tiny") + render_prometheus(replicas, "t")):
        exported |= {s.name for s in family.samples}
    queried = {name for expr in exprs for name in re.findall(r"\b(?:vllm:|loraserve_)[a-z0-9_:]+", expr)}
    assert len(exprs) >= 12 and queried - exported == set()
    vllm = {name.removeprefix("vllm:").removesuffix("_bucket").removesuffix("_total") for name in queried
            if name.startswith("vllm:")}
    assert vllm >= set(VLLM_TYPES), set(VLLM_TYPES) - vllm     # every vLLM metric we export has a panel
    assert any("histogram_quantile(0.99" in e for e in exprs)
