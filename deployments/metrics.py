"""Serving metrics: Ray Serve / Prometheus instruments per replica, and a `/metrics` text rendering.

Each LLMServer replica records into `ray.serve.metrics` instruments, which Ray's
metrics agent exports to Prometheus (as `ray_loraserve_*`, with the Serve tags
application / deployment / replica added), and into vLLM's metrics (vllm_metrics.py).
The same totals travel with the replica's registry heartbeat, so the ingress can
answer `GET /metrics` for the whole application without a Prometheus server.
Ray tags stay low-cardinality: `kind` is base or lora, never the adapter name; the
per-adapter gauges (requests running / waiting, residency on the device and in host
memory) exist only in the ingress's text, one series per adapter a replica holds.
"""
from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

from deployments.vllm_metrics import RequestTimer, VLLMMetrics, label_set, stat_at
from workers.sequence import RequestOutput

LOAD_SECONDS_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0]
# engine stats() counters exported as Prometheus counters: (stats path, metric name)
ENGINE_COUNTERS = [
    (("lora", "host_cache", "hits"), "lora_host_cache_hits"),
    (("lora", "host_cache", "misses"), "lora_host_cache_misses"),
    (("lora", "host_cache", "loads"), "lora_host_cache_loads"),
    (("lora", "host_cache", "evictions"), "lora_host_cache_evictions"),
    (("lora", "slots", "hits"), "lora_slot_hits"),
    (("lora", "slots", "misses"), "lora_slot_misses"),
    (("lora", "slots", "evictions"), "lora_slot_evictions"),
    (("num_preemptions",), "preemptions"),
    (("prefix_cache", "queried_tokens"), "prefix_cache_queried_tokens"),
    (("prefix_cache", "hit_tokens"), "prefix_cache_hit_tokens"),
]
ENGINE_GAUGES = [
    (("running",), "num_running"), (("waiting",), "num_waiting"),
    (("free_kv_blocks",), "kv_cache_free_blocks"), (("total_kv_blocks",), "kv_cache_blocks"),
    (("lora", "host_cache", "resident"), "lora_host_cache_resident"),
    (("lora", "host_cache", "referenced"), "lora_host_cache_referenced"),
    (("prefix_cache", "cached_blocks"), "prefix_cache_blocks"),
]


class ServerMetrics:
    """One replica's instruments; `totals()` is the same data as a flat dict (name -> number)."""

    def __init__(self, model_name: str, max_model_len: int, max_lora: int):
        self.vllm = VLLMMetrics(model_name, max_model_len, max_lora)
        self._requests = Counter("loraserve_requests", "Requests ended, by kind (base|lora) and outcome.",
                                 tag_keys=("kind", "outcome"))
        self._prompt_tokens = Counter("loraserve_prompt_tokens", "Prompt tokens of admitted requests.",
                                      tag_keys=("kind",))
        self._generated_tokens = Counter("loraserve_generated_tokens", "Tokens generated.", tag_keys=("kind",))
        self._adapter_loads = Counter("loraserve_adapter_loads", "Adapter loads into a replica's engine.",
                                      tag_keys=("outcome",))
        self._load_seconds = Histogram("loraserve_adapter_load_seconds", "Adapter load latency into a replica.",
                                       boundaries=LOAD_SECONDS_BUCKETS)
        self._engine_counters = {name: Counter(f"loraserve_{name}", f"Engine counter {'.'.join(path)}.")
                                 for path, name in ENGINE_COUNTERS}
        self._engine_gauges = {name: Gauge(f"loraserve_{name}", f"Engine state {'.'.join(path)}.")
                               for path, name in ENGINE_GAUGES}
        self._totals: dict[str, float] = {}
        self._adapters: dict[str, float] = {}   # the engine's per-adapter state at the last heartbeat

    def _add(self, name: str, value: float, **labels: str) -> None:
        if labels:
            name += label_set(**dict(sorted(labels.items())))
        self._totals[name] = self._totals.get(name, 0) + value

    def record_output(self, request: RequestTimer, out: RequestOutput) -> None:
        if request.tokens(len(out.token_ids), out.queue_time):
            self.vllm.first_token(request)

    def record_request(self, request: RequestTimer, outcome: str) -> None:
        kind = "lora" if request.adapter else "base"
        prompt_tokens, generated_tokens = request.num_prompt_tokens, request.generated
        self._requests.inc(tags={"kind": kind, "outcome": outcome})
        self._add("requests_total", 1, kind=kind, outcome=outcome)
        if prompt_tokens:
            self._prompt_tokens.inc(prompt_tokens, tags={"kind": kind})
            self._add("prompt_tokens_total", prompt_tokens, kind=kind)
        if generated_tokens:
            self._generated_tokens.inc(generated_tokens, tags={"kind": kind})
            self._add("generated_tokens_total", generated_tokens, kind=kind)
        self.vllm.finished(request, outcome)

    def record_adapter_load(self, seconds: float | None, ok: bool) -> None:
        outcome = "ok" if ok else "error"
        self._adapter_loads.inc(tags={"outcome": outcome})
        self._add("adapter_loads_total", 1, outcome=outcome)
        if seconds is not None:
            self._load_seconds.observe(seconds)
            self._add("adapter_load_seconds_sum", seconds)
            self._add("adapter_load_seconds_count", 1)

    def record_engine(self, stats: dict) -> None:
        """Engine stats are cumulative: counters advance by the difference since the last call."""
        for path, name in ENGINE_COUNTERS:
            value = stat_at(stats, path)
            if value is None:
                continue
            key = f"{name}_total"
            delta = value - self._totals.get(key, 0)
            if delta > 0:
                self._engine_counters[name].inc(delta)
            self._totals[key] = value
        for path, name in ENGINE_GAUGES:
            value = stat_at(stats, path)
            if value is not None:
                self._engine_gauges[name].set(value)
                self._totals[name] = value
        self.vllm.record_engine(stats)
        self._adapters = {}
        lora = stats.get("lora", {})
        for state, counts in lora.get("requests", {}).items():
            for adapter, count in counts.items():
                self._adapters["adapter_requests" + label_set(adapter=adapter, state=state)] = count
        for where in ("device", "host", "loading"):
            for adapter in lora.get("residency", {}).get(where, []):
                self._adapters["adapter_resident" + label_set(adapter=adapter, where=where)] = 1

    def totals(self) -> dict[str, float]:
        return {**self._totals, **self._adapters}


def render_prometheus(per_replica: dict[str, dict], model: str) -> str:
    """Prometheus text format: every replica's totals, labelled with the model and the replica."""
    samples: dict[str, list[str]] = {}
    for replica, stats in sorted(per_replica.items()):
        for key, value in sorted(stats.get("metrics", {}).items()):
            name, _, labels = key.partition("{")
            labels = ",".join(filter(None, [label_set(model=model, replica=replica)[1:-1], labels.rstrip("}")]))
            samples.setdefault(name, []).append(f"loraserve_{name}{{{labels}}} {value}")
    lines = []
    for name, rows in sorted(samples.items()):
        kind = "counter" if name.endswith(("_total", "_sum", "_count")) else "gauge"
        lines += [f"# TYPE loraserve_{name} {kind}", *rows]
    return "\n".join(lines) + "\n"
