"""vLLM's Prometheus metrics, under vLLM's names, so vLLM's dashboards, autoscalers and gateways read us as they
read vLLM.

Names, types, HELP texts, label names and bucket boundaries are those of vLLM's PrometheusStatLogger
(vllm/v1/metrics/loggers.py). Each LLMServer replica records into one `VLLMMetrics`, which keeps:

- a plain copy (counters, gauges, histogram bucket counts: `snapshot()`) that travels with the replica's
  registry heartbeat; the ingress's `GET /metrics` (`render_vllm`) presents the application as one vLLM
  server: counters, gauges and histogram buckets summed over the live replicas, labelled
  `model_name=<served model>` and `engine="0"`;
- `ray.serve.metrics` instruments, which Ray's metrics agent exports per replica. Ray allows no ':' in a
  name (as vLLM's own Ray metrics, vllm/v1/metrics/ray_wrappers.py, it becomes '_'), and prefixes `ray_`:
  a Prometheus scraping Ray's metrics port sees `ray_vllm_time_to_first_token_seconds_bucket`,
  `ray_vllm_prompt_tokens_total`, ... with the Serve tags application / deployment / replica beside
  model_name and engine. Ray rebuilds a histogram's `_sum` from its buckets' midpoints: exact sums are the
  ingress's.

`vllm:lora_requests_info` is vLLM's gauge whose value is a Unix time and whose labels carry the adapters:
`running_lora_adapters` and `waiting_lora_adapters` (comma-joined names) and `max_lora` (adapters a step may
run). vLLM sets a series per label combination at every step and keeps the old ones; a reader (llm-d's and the
Gateway API inference extension's LoRA-affinity scorers) takes the series with the largest value and ignores
those with both lists empty. Here each replica samples its engine at every heartbeat and keeps its last
`LORA_INFO_HISTORY` distinct combinations.
"""
from __future__ import annotations

import bisect
import time
from collections import OrderedDict

from ray.serve.metrics import Counter, Gauge, Histogram

# vLLM's boundaries (loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort", "error")   # vLLM's FinishReason, every one exported from 0
LORA_INFO_HISTORY = 16
LABELS = ("model_name", "engine")

GAUGES = {"num_requests_running": "Number of requests in model execution batches.",
          "num_requests_waiting": "Number of requests waiting to be processed.",
          "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage."}
COUNTERS = {"prompt_tokens": "Number of prefill tokens processed.",
            "generation_tokens": "Number of generation tokens processed.",
            "request_success": "Count of successfully processed requests.",
            "num_preemptions": "Cumulative number of preemption from the engine.",
            "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
            "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens."}
HISTOGRAMS = {"time_to_first_token_seconds": "Histogram of time to first token in seconds.",
              "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
              "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
              "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
              "request_prompt_tokens": "Number of prefill tokens processed.",
              "request_generation_tokens": "Number of generation tokens processed."}
LORA_INFO_HELP = "Running stats on lora requests."
# engine stats() counters under vLLM's names: (stats path, name)
ENGINE_COUNTERS = [(("num_preemptions",), "num_preemptions"),
                   (("prefix_cache", "queried_tokens"), "prefix_cache_queries"),
                   (("prefix_cache", "hit_tokens"), "prefix_cache_hits")]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count boundaries: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def stat_at(stats: dict, path: tuple[str, ...]):
    """stats[path[0]][path[1]]..., None where a key is missing."""
    for key in path:
        if not isinstance(stats, dict) or key not in stats:
            return None
        stats = stats[key]
    return stats


def _tagged(metric, tags: dict[str, str]):
    metric.set_default_tags(dict(tags))   # Serve's adds its own tags to the dict it is given, and returns None
    return metric


class RequestTimer:
    """One request's latencies as its replica sees them, from its hand-off to the engine (after tokenization and
    the adapter's load into the engine) to its end. Tokens that arrive together (one output) split the time
    since the previous token evenly; the first output's extra tokens came with the first (0 s)."""

    def __init__(self, adapter: str | None, num_prompt_tokens: int):
        self.adapter, self.num_prompt_tokens = adapter, num_prompt_tokens
        self.arrival = self.last_token = time.monotonic()
        self.time_to_first_token: float | None = None
        self.inter_token: list[float] = []
        self.queue_time: float | None = None
        self.generated = 0

    def tokens(self, count: int, queue_time: float | None) -> bool:
        """Record an output of `count` tokens; True when it carries the request's first token."""
        if queue_time is not None:
            self.queue_time = queue_time
        if not count:
            return False
        now, first = time.monotonic(), self.time_to_first_token is None
        if first:
            self.time_to_first_token = now - self.arrival
            self.inter_token += [0.0] * (count - 1)
        else:
            self.inter_token += [(now - self.last_token) / count] * count
        self.last_token, self.generated = now, self.generated + count
        return first


class _Buckets:
    """A histogram's state in plain numbers: per-bucket counts (the last is +Inf) and the sum."""

    def __init__(self, bounds: list[float]):
        self.bounds, self.counts, self.sum = list(bounds), [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1   # le: a value on a bound is in its bucket
        self.sum += value

    def snapshot(self) -> dict:
        return {"bounds": self.bounds, "counts": list(self.counts), "sum": self.sum}


class VLLMMetrics:
    """One replica's vLLM metrics: recorded here, exported through Ray, and summed by the ingress."""

    def __init__(self, model_name: str, max_model_len: int, max_lora: int):
        tags = {"model_name": model_name, "engine": "0"}
        self.max_lora = max_lora
        token_buckets = build_1_2_5_buckets(max_model_len)
        bounds = {"time_to_first_token_seconds": TTFT_BUCKETS, "inter_token_latency_seconds": ITL_BUCKETS,
                  "e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
                  "request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
                  "request_prompt_tokens": token_buckets, "request_generation_tokens": token_buckets}
        self.histograms = {name: _Buckets(bounds[name]) for name in HISTOGRAMS}
        self.counters = {name: 0.0 for name in COUNTERS if name != "request_success"}
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.gauges = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_used_blocks": 0,
                       "kv_cache_blocks": 0}
        self.lora_info: OrderedDict[tuple[str, str], float] = OrderedDict()   # (running, waiting) -> time
        self._ray_histograms = {name: _tagged(Histogram(f"vllm_{name}", help, boundaries=bounds[name],
                                                        tag_keys=LABELS), tags) for name, help in HISTOGRAMS.items()}
        self._ray_counters = {name: _tagged(Counter(f"vllm_{name}", help, tag_keys=LABELS), tags)
                              for name, help in COUNTERS.items() if name != "request_success"}
        self._ray_success = _tagged(Counter("vllm_request_success", COUNTERS["request_success"],
                                            tag_keys=(*LABELS, "finished_reason")), tags)
        self._ray_gauges = {name: _tagged(Gauge(f"vllm_{name}", help, tag_keys=LABELS), tags)
                            for name, help in GAUGES.items()}
        self._ray_lora_info = Gauge("vllm_lora_requests_info", LORA_INFO_HELP,
                                    tag_keys=("max_lora", "waiting_lora_adapters", "running_lora_adapters"))

    def _observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)
        self._ray_histograms[name].observe(value)

    def _count(self, name: str, value: float) -> None:
        if value > 0:
            self.counters[name] += value
            self._ray_counters[name].inc(value)

    def first_token(self, request: RequestTimer) -> None:
        self._observe("time_to_first_token_seconds", request.time_to_first_token)

    def finished(self, request: RequestTimer, finish_reason: str) -> None:
        """A request ended (any reason: vLLM's request_success counts every finish reason)."""
        reason = finish_reason if finish_reason in self.success else "error"
        self.success[reason] += 1
        self._ray_success.inc(tags={"finished_reason": reason})
        self._count("prompt_tokens", request.num_prompt_tokens)
        self._count("generation_tokens", request.generated)
        for latency in request.inter_token:
            self._observe("inter_token_latency_seconds", latency)
        self._observe("e2e_request_latency_seconds", time.monotonic() - request.arrival)
        if request.queue_time is not None:
            self._observe("request_queue_time_seconds", request.queue_time)
        self._observe("request_prompt_tokens", request.num_prompt_tokens)
        self._observe("request_generation_tokens", request.generated)

    def record_engine(self, stats: dict) -> None:
        """The engine's state (a heartbeat's stats()): gauges, its cumulative counters, the adapters it runs."""
        used, total = stats["total_kv_blocks"] - stats["free_kv_blocks"], stats["total_kv_blocks"]
        self.gauges.update(num_requests_running=stats["running"], num_requests_waiting=stats["waiting"],
                           kv_cache_used_blocks=used, kv_cache_blocks=total)
        for name, value in (("num_requests_running", stats["running"]),
                            ("num_requests_waiting", stats["waiting"]),
                            ("kv_cache_usage_perc", used / total if total else 0.0)):
            self._ray_gauges[name].set(value)
        for path, name in ENGINE_COUNTERS:
            value = stat_at(stats, path)
            if value is not None:
                self._count(name, value - self.counters[name])
        requests = stat_at(stats, ("lora", "requests"))
        if requests is not None:
            self._record_lora_info(",".join(sorted(requests.get("running", {}))),
                                   ",".join(sorted(requests.get("waiting", {}))))

    def _record_lora_info(self, running: str, waiting: str) -> None:
        now = time.time()
        self.lora_info[(running, waiting)] = now
        self.lora_info.move_to_end((running, waiting))
        while len(self.lora_info) > LORA_INFO_HISTORY:
            self.lora_info.popitem(last=False)
        self._ray_lora_info.set(now, tags={"max_lora": str(self.max_lora), "running_lora_adapters": running,
                                           "waiting_lora_adapters": waiting})

    def snapshot(self) -> dict:
        """Plain numbers for the heartbeat (what `render_vllm` reads)."""
        return {"counters": dict(self.counters), "request_success": dict(self.success), "gauges": dict(self.gauges),
                "histograms": {name: h.snapshot() for name, h in self.histograms.items()},
                "lora_requests_info": {"max_lora": self.max_lora,
                                       "series": [[r, w, t] for (r, w), t in self.lora_info.items()]}}


def label_set(**labels: str) -> str:
    """`{k="v",...}` with Prometheus' escapes (backslash, double quote, newline)."""
    escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, escaped)) + "}"


def _number(value: float) -> str:
    return repr(float(value))


def render_vllm(per_replica: dict[str, dict], model_name: str) -> str:
    """The application as one vLLM server, in Prometheus' text format: every live replica's snapshot summed
    (histogram buckets too); `vllm:lora_requests_info` once for the application (the adapters running or
    waiting on any replica now, `max_lora` summed) and each replica's recent series with a `replica` label."""
    snapshots = {replica: stats["vllm"] for replica, stats in sorted(per_replica.items()) if stats.get("vllm")}
    if not snapshots:
        return ""
    base = dict(model_name=model_name, engine="0")
    lines: list[str] = []

    def family(name: str, kind: str, help: str) -> None:
        lines.extend([f"# HELP vllm:{name} {help}", f"# TYPE vllm:{name} {kind}"])

    def total(section: str, key: str) -> float:
        return sum(snapshot[section][key] for snapshot in snapshots.values())

    used, blocks = total("gauges", "kv_cache_used_blocks"), total("gauges", "kv_cache_blocks")
    gauges = {"num_requests_running": total("gauges", "num_requests_running"),
              "num_requests_waiting": total("gauges", "num_requests_waiting"),
              "kv_cache_usage_perc": used / blocks if blocks else 0.0}
    for name, help in GAUGES.items():
        family(name, "gauge", help)
        lines.append(f"vllm:{name}{label_set(**base)} {_number(gauges[name])}")
    for name, help in COUNTERS.items():
        family(f"{name}_total", "counter", help)
        if name == "request_success":
            lines += [f"vllm:{name}_total{label_set(**base, finished_reason=reason)} "
                      f"{_number(total('request_success', reason))}" for reason in FINISH_REASONS]
        else:
            lines.append(f"vllm:{name}_total{label_set(**base)} {_number(total('counters', name))}")
    for name, help in HISTOGRAMS.items():
        parts = [snapshot["histograms"][name] for snapshot in snapshots.values()]
        # replicas of one application share their bounds (a rollout that changes max_model_len may not: its
        # other replicas' token histograms are left out until they are gone)
        parts = [part for part in parts if part["bounds"] == parts[-1]["bounds"]]
        counts = [sum(column) for column in zip(*(part["counts"] for part in parts))]
        family(name, "histogram", help)
        cumulative = 0
        for bound, count in zip([*map(_number, parts[-1]["bounds"]), "+Inf"], counts):
            cumulative += count
            lines.append(f"vllm:{name}_bucket{label_set(**base, le=bound)} {_number(cumulative)}")
        lines += [f"vllm:{name}_sum{label_set(**base)} {_number(sum(part['sum'] for part in parts))}",
                  f"vllm:{name}_count{label_set(**base)} {_number(cumulative)}"]
    lines += _render_lora_info(snapshots)
    return "\n".join(lines) + "\n"


def _render_lora_info(snapshots: dict[str, dict]) -> list[str]:
    infos = {replica: s["lora_requests_info"] for replica, s in snapshots.items() if s["lora_requests_info"]["series"]}
    if not infos:
        return []
    def now(column: int) -> str:   # the adapters in each replica's latest series, joined
        return ",".join(sorted({name for info in infos.values() for name in info["series"][-1][column].split(",")
                                if name}))

    labels = label_set(max_lora=sum(info["max_lora"] for info in infos.values()), waiting_lora_adapters=now(1),
                       running_lora_adapters=now(0))
    lines = [f"# HELP vllm:lora_requests_info {LORA_INFO_HELP}", "# TYPE vllm:lora_requests_info gauge",
             f"vllm:lora_requests_info{labels} {_number(time.time())}"]
    for replica, info in infos.items():
        for running, waiting, seen in info["series"]:
            labels = label_set(max_lora=info["max_lora"], waiting_lora_adapters=waiting,
                               running_lora_adapters=running, replica=replica)
            lines.append(f"vllm:lora_requests_info{labels} {_number(seen)}")
    return lines
