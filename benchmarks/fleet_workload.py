"""The fleet workload: request arrivals and lengths from the Azure LLM inference trace 2023, adapters by Zipf.

Source of the arrivals and lengths: the Azure Public Dataset, AzureLLMInferenceTrace_{conv,code}.csv
(Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024; CC-BY 4.0),
a copy in ../shared/data/azure-llm-inference-2023/. The trace has no adapter ids: each request's adapter is
drawn from a Zipf law over `num_adapters` (rank k with probability proportional to 1 / k^s), in one of three
phases:
- steady: the popularity ranks stay fixed;
- drift: every `drift_every_s` the ranks rotate by `drift_shift`, so the top adapters change;
- hotspot: at `hotspot_at_s` one cold adapter (rank num_adapters // 2) ramps linearly to `hotspot_share` of
  the traffic within `hotspot_ramp_s`, then stays there.
Time is scaled so the trace's arrivals keep their burstiness at `rate` requests per second on average;
lengths are scaled down (`prompt_scale`, `output_scale`) and clipped to what a tiny model serves.
Used by benchmarks/fleet.py (the real fleet) and benchmarks/fleet_sim.py (the simulation) alike.
"""
from __future__ import annotations

import csv
import datetime as dt
import functools
import math
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "azure-llm-inference-2023"
TRACE_CITATION = ("Azure LLM inference trace 2023 (Azure Public Dataset; Patel et al., Splitwise, ISCA 2024; "
                  "CC-BY 4.0)")


@dataclass(frozen=True)
class Request:
    at: float            # seconds from the run's start
    adapter: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Phase:
    name: str = "steady"           # steady | drift | hotspot
    zipf_s: float = 1.0
    drift_every_s: float = 20.0
    drift_shift: int = 5
    hotspot_at_s: float = 10.0
    hotspot_ramp_s: float = 10.0
    hotspot_share: float = 0.2


@functools.lru_cache(maxsize=2)
def trace(kind: str = "conv") -> tuple[tuple[float, int, int], ...]:
    """(seconds since the first arrival, context tokens, generated tokens) per request, in arrival order."""
    path = TRACE_DIR / f"{kind}.csv"
    if not path.exists():
        raise FileNotFoundError(f"{path}: the Azure trace (shared/data) is not beside this repository")
    rows = []
    with path.open() as f:
        for row in csv.DictReader(f):
            stamp = dt.datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
            rows.append((stamp.timestamp(), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    start = rows[0][0]
    return tuple((t - start, c, g) for t, c, g in rows)


def adapter_names(num_adapters: int) -> list[str]:
    return [f"fleet-{i:05d}" for i in range(num_adapters)]


def zipf_weights(n: int, s: float) -> list[float]:
    weights = [1.0 / (k ** s) for k in range(1, n + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def make_workload(*, num_adapters: int, rate: float, duration_s: float, phase: Phase = Phase(), seed: int = 0,
                  kind: str = "conv", offset: int = 0, prompt_scale: float = 1 / 16, output_scale: float = 1 / 8,
                  max_prompt: int = 96, max_output: int = 48) -> list[Request]:
    """round(rate x duration_s) requests: the trace's consecutive arrivals from row `offset` (wrapping around),
    their times scaled to span duration_s, so the window's own burstiness is kept at `rate` per second."""
    rows = trace(kind)
    count = max(1, round(rate * duration_s))
    window = [rows[(offset + j) % len(rows)] for j in range(count)]
    times, elapsed = [], 0.0
    for j, (t, _, _) in enumerate(window):
        if j:
            gap = t - window[j - 1][0]
            elapsed += gap if gap >= 0 else 0.0    # the wrap from the trace's end to its start
        times.append(elapsed)
    scale = duration_s / (times[-1] * count / max(1, count - 1)) if times[-1] > 0 else 0.0
    rng = random.Random(seed)
    names = adapter_names(num_adapters)
    ranked = names[:]
    rng.shuffle(ranked)                       # rank -> adapter: popularity unrelated to the names' order
    cumulative = _cumulative(zipf_weights(num_adapters, phase.zipf_s))
    hot = ranked[num_adapters // 2]
    out: list[Request] = []
    for t, (_, context, generated) in zip(times, window):
        at = t * scale
        out.append(Request(at, _draw(rng, ranked, cumulative, phase, at, hot),
                           max(4, min(max_prompt, math.ceil(context * prompt_scale))),
                           max(2, min(max_output, math.ceil(generated * output_scale)))))
    return out


def _cumulative(weights: list[float]) -> list[float]:
    out, acc = [], 0.0
    for w in weights:
        acc += w
        out.append(acc)
    out[-1] = 1.0
    return out


def _draw(rng: random.Random, ranked: list[str], cumulative: list[float], phase: Phase, at: float, hot: str) -> str:
    if phase.name == "hotspot" and at >= phase.hotspot_at_s:
        share = phase.hotspot_share * min(1.0, (at - phase.hotspot_at_s) / phase.hotspot_ramp_s)
        if rng.random() < share:
            return hot
    rank = _bisect(cumulative, rng.random())
    if phase.name == "drift":
        rank = (rank + phase.drift_shift * int(at // phase.drift_every_s)) % len(ranked)
    return ranked[rank]


def _bisect(cumulative: list[float], x: float) -> int:
    lo, hi = 0, len(cumulative) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cumulative[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class FleetSpec:
    """The real fleet benchmark's size (benchmarks/fleet.py), which the simulation replays to validate itself."""
    replicas: int = 4
    num_adapters: int = 200
    adapter_rank: int = 8
    max_num_seqs: int = 16
    max_loras_per_batch: int = 4        # distinct adapters per engine step (the engine's default)
    # host cache per replica: 4 x 48 < 200 adapters, so placement matters (one replica holds a quarter of them);
    # at 32 even an ideal one-home-per-adapter LRU tops out near 0.87 at Zipf 1.0 (benchmarks/RESULTS.md, fleet)
    max_loaded_loras: int = 48
    # Serve's router sends a pinned adapter elsewhere only when its replica rejects at this bound; Ray Serve LLM
    # deploys LLMServer with 1e9 (never rejects): `--fleet '{"max_ongoing_requests": 1000000000}'` measures that
    max_ongoing_requests: int = 32
    rate: float = 16.0                  # requests per second over the fleet: busy, not overloaded, on 2 shared cores
                                        # (20 req/s: TTFT p99 ~0.3 s, steady; benchmarks/RESULTS.md, fleet)
    duration_s: float = 60.0            # per phase
    # before each phase: every adapter once, then this many draws per adapter of the phase's popularity, 8 prompt and
    # 2 output tokens each, at warmup_rate: a short run measures the fleet's steady state, not first-touch misses
    warmup_draws_per_adapter: int = 2
    warmup_rate: float = 30.0


FLEET = FleetSpec()
