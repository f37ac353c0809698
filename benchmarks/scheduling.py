"""Scheduling under real traffic: a long prompt among decoding streams, and shared prompt prefixes.

    .venv/bin/python -m benchmarks.scheduling [--dtype bfloat16] [--sizes '{"rounds": 3}']

interference  8 streams decode (8 adapters); a 2,000-token prompt arrives (on one of them). Every
              stream's inter-token gaps, and the long prompt's time to first token, for the engine
              with chunked prefill at several token budgets and without it (the whole prompt in one
              step, as before chunking). The default budget is the one marked.
prefixes      64 requests over 8 adapters, each adapter with its own 512-token system prompt plus a
              32-token user part, sent by 4 closed-loop clients through the AsyncLLMEngine; time to
              first token with prefix caching and without, and the cache's hit rate.
Every variant is its own engine on the same checkpoint; rounds interleave them (order rotated) in
one process, each ratio is taken within a round and the median over rounds reported.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, replace

from benchmarks.checkpoint import TINY, build_adapters, build_checkpoint
from benchmarks.common import machine_info, median, set_threads, sizes_dict, write_result
from benchmarks.throughput import adapter_name


@dataclass(frozen=True)
class SchedSizes:
    shape: object = None                 # the bench checkpoint (benchmarks.checkpoint) unless set
    rank: int = 16
    streams: int = 8
    stream_prompt: int = 32
    stream_tokens: int = 64
    warm_tokens: int = 8                 # stream tokens before the long prompt arrives
    long_prompt: int = 2000
    budgets: tuple[int, ...] = (64, 128, 256, 512)
    prefix_adapters: int = 8
    prefix_requests: int = 64
    system_len: int = 512
    user_len: int = 32
    clients: int = 4
    max_tokens: int = 8
    rounds: int = 3
    seed: int = 0
    threads: int = 0                     # 0 = all CPUs


FULL = SchedSizes()
TINY_SCHED = SchedSizes(shape=TINY, rank=8, streams=2, stream_prompt=8, stream_tokens=24, warm_tokens=2,
                        long_prompt=100, budgets=(32,), prefix_adapters=2, prefix_requests=6, system_len=48,
                        user_len=8, clients=2, max_tokens=2, rounds=1)


def make_engine(model, dtype: str, sizes: SchedSizes, paths, **overrides):
    from workers import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, device="cpu", seed=sizes.seed, max_num_seqs=16,
                                    cpu_threads=sizes.threads or None, max_model_len=4096, max_loras_per_batch=8, max_loaded_loras=16,
                                    max_lora_rank=sizes.rank, kv_cache_memory_gb=0.375,   # 12k tokens of the bench model
                                    lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"), **overrides))
    for i, path in enumerate(paths):
        engine.load_adapter(adapter_name(i), str(path))
    return engine


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


def interference(engine, sizes: SchedSizes, vocab: int) -> dict:
    """Step the sync engine; a stream's gap is the time between two of its tokens."""
    from workers import SamplingParams

    rng = random.Random(sizes.seed)
    stream = SamplingParams(max_tokens=sizes.stream_tokens, temperature=0.0, ignore_eos=True, logprobs=False)
    ids = {engine.add_request(_ids(rng, sizes.stream_prompt, vocab), stream, adapter_name(i % 8))
           for i in range(sizes.streams)}
    produced = dict.fromkeys(ids, 0)
    while min(produced.values()) < sizes.warm_tokens:
        for out in engine.step():
            produced[out.request_id] = len(out.token_ids)
    last = dict.fromkeys(ids, time.perf_counter())
    gaps = []
    arrived = time.perf_counter()
    long_id = engine.add_request(_ids(rng, sizes.long_prompt, vocab),
                                 SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), adapter_name(0))
    ttft, steps_after = None, 0
    while ttft is None or steps_after < 2:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == long_id:
                ttft = now - arrived
            elif out.request_id in last:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
        steps_after += ttft is not None
    for rid in ids:
        engine.abort(rid)
    return {"max_gap_ms": max(gaps) * 1e3, "p50_gap_ms": median(gaps) * 1e3, "long_ttft_ms": ttft * 1e3}


def shared_prefixes(aengine, sizes: SchedSizes, vocab: int) -> dict:
    """Closed-loop clients through the AsyncLLMEngine; TTFT = submit to first token, as a client sees it."""
    from workers import SamplingParams

    rng = random.Random(sizes.seed + 1)
    systems = [_ids(rng, sizes.system_len, vocab) for _ in range(sizes.prefix_adapters)]
    requests = [(systems[i % sizes.prefix_adapters] + _ids(rng, sizes.user_len, vocab),
                 adapter_name(i % sizes.prefix_adapters)) for i in range(sizes.prefix_requests)]
    params = SamplingParams(max_tokens=sizes.max_tokens, temperature=0.0, ignore_eos=True, logprobs=False)

    async def client(queue: asyncio.Queue, ttfts: list):
        while not queue.empty():
            prompt, adapter = queue.get_nowait()
            start, first = time.perf_counter(), None
            async for _ in aengine.generate(prompt, params, adapter, delta=True):
                first = first or time.perf_counter()
            ttfts.append(first - start)

    async def main():
        queue, ttfts = asyncio.Queue(), []
        for item in requests:
            queue.put_nowait(item)
        before = (await aengine.stats())["prefix_cache"]
        await asyncio.gather(*(client(queue, ttfts) for _ in range(sizes.clients)))
        return ttfts, before, (await aengine.stats())["prefix_cache"]

    ttfts, before, after = asyncio.run(main())
    queried = after["queried_tokens"] - before["queried_tokens"]
    hits = after["hit_tokens"] - before["hit_tokens"]
    return {"ttft_p50_ms": median(ttfts) * 1e3, "ttft_max_ms": max(ttfts) * 1e3,
            "hit_rate": hits / queried if queried else 0.0}


def run(sizes: SchedSizes = FULL, dtype: str = "bfloat16", log=print) -> dict:
    from benchmarks.checkpoint import QWEN3_0_6B_8L

    shape = sizes.shape or QWEN3_0_6B_8L
    sizes = replace(sizes, shape=shape)
    model = build_checkpoint(dtype, shape)
    paths = build_adapters(max(8, sizes.prefix_adapters), shape, sizes.rank)
    from workers.device import DEFAULT_MAX_NUM_BATCHED_TOKENS
    default_budget = DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    if sizes.threads:
        set_threads(sizes.threads)
    variants = {"unchunked": dict(enable_chunked_prefill=False, max_num_batched_tokens=4096)}
    variants |= {f"chunked_{b}": dict(max_num_batched_tokens=b) for b in sizes.budgets}
    engines = {name: make_engine(model, dtype, sizes, paths, enable_prefix_caching=False, **kw)
               for name, kw in variants.items()}
    from workers.async_engine import AsyncLLMEngine
    prefix = {"cache_on": AsyncLLMEngine(make_engine(model, dtype, sizes, paths)),
              "cache_off": AsyncLLMEngine(make_engine(model, dtype, sizes, paths, enable_prefix_caching=False))}
    rounds = []
    for r in range(sizes.rounds):
        result = {}
        names = list(engines) + list(prefix)
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in engines:
                result[name] = interference(engines[name], sizes, shape.vocab_size)
            else:
                result[name] = shared_prefixes(prefix[name], sizes, shape.vocab_size)
            log(f"[scheduling {dtype}] round {r + 1}/{sizes.rounds} {name:>12}: " +
                ", ".join(f"{k} {v:.1f}" for k, v in result[name].items()))
        rounds.append(result)
    for engine in (*engines.values(), *prefix.values()):
        engine.close()
    return summarize(sizes, dtype, rounds, default_budget)


def summarize(sizes: SchedSizes, dtype: str, rounds: list[dict], default_budget: int) -> dict:
    def med(name, key):
        return median([r[name][key] for r in rounds])

    chunked = [k for k in rounds[0] if k.startswith("chunked_")]
    default = f"chunked_{default_budget}" if f"chunked_{default_budget}" in chunked else chunked[0]
    table = {name: {key: med(name, key) for key in rounds[0][name]} for name in rounds[0]}
    gap_ratios = [r[default]["max_gap_ms"] / r["unchunked"]["max_gap_ms"] for r in rounds]
    ttft_ratios = [r["cache_off"]["ttft_p50_ms"] / r["cache_on"]["ttft_p50_ms"] for r in rounds]
    data = {"benchmark": "scheduling", "dtype": dtype, "sizes": sizes_dict(sizes), "machine": machine_info(), "default_budget": default_budget, "default_variant": default,
            "variants": table, "rounds": rounds,
            "max_gap_chunked_over_unchunked": median(gap_ratios), "gap_ratios_per_round": gap_ratios,
            "ttft_p50_off_over_on": median(ttft_ratios), "ttft_ratios_per_round": ttft_ratios}
    return data


def main(argv=None) -> dict:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--sizes", default=None, help="JSON overrides of SchedSizes")
    args = parser.parse_args(argv)
    overrides = json.loads(args.sizes) if args.sizes else {}
    if "budgets" in overrides:
        overrides["budgets"] = tuple(overrides["budgets"])
    data = run(replace(FULL, **overrides), args.dtype)
    print(write_result(f"scheduling_{args.dtype}", data))
    return data


if __name__ == "__main__":
    main()


# ---- report (benchmarks/report.py renders these) ------------------------------------------------------
GAP_TARGET, TTFT_TARGET = 0.25, 3.0   # issue: largest gap <= 1/4 of the unchunked stall; TTFT p50 >= 3x


def target_rows(d: dict, spread, verdict) -> list[tuple[str, str, str, str]]:
    gap, ttft = d["max_gap_chunked_over_unchunked"], d["ttft_p50_off_over_on"]
    gap_rounds, ttft_rounds = d["gap_ratios_per_round"], d["ttft_ratios_per_round"]
    inverted = [1 / x for x in gap_rounds]   # judged as "at least 4x smaller", so one verdict rule serves
    return [(f"long prompt among {d['sizes']['streams']} streams: largest inter-token gap, chunked "
             f"({d['default_budget']} tokens/step) / unchunked", spread(gap, gap_rounds), f"<= {GAP_TARGET}",
             verdict(1 / gap, 1 / GAP_TARGET, inverted)),
            (f"shared {d['sizes']['system_len']}-token prefixes: TTFT p50 without / with prefix caching",
             spread(ttft, ttft_rounds), f">= {TTFT_TARGET}", verdict(ttft, TTFT_TARGET, ttft_rounds))]


def section(d: dict, table, fmt) -> str:
    s, v = d["sizes"], d["variants"]
    inter = [[name.replace("_", " ") + (" (default)" if name == d["default_variant"] else ""),
              fmt(x["max_gap_ms"], ".0f"), fmt(x["p50_gap_ms"], ".1f"), fmt(x["long_ttft_ms"], ".0f")]
             for name, x in v.items() if "max_gap_ms" in x]
    prefix = [[name.replace("_", " "), fmt(x["ttft_p50_ms"], ".0f"), fmt(x["ttft_max_ms"], ".0f"),
               fmt(x["hit_rate"])] for name, x in v.items() if "ttft_p50_ms" in x]
    return "\n".join([
        f"### Scheduling: chunked prefill and prefix caching, {d['dtype']}",
        "",
        f"{s['streams']} streams ({s['stream_prompt']}-token prompts, one adapter each) decoding when a "
        f"{s['long_prompt']}-token prompt arrives; every variant is its own engine, {len(d['rounds'])} "
        "interleaved rounds, medians. `unchunked` prefills the whole prompt in one step (the engine before "
        "chunking); `chunked N` runs N tokens a step, decodes first.",
        "",
        table(["engine", "largest stream gap ms", "p50 gap ms", "long prompt TTFT ms"], inter),
        "",
        f"{s['prefix_requests']} requests over {s['prefix_adapters']} adapters, each adapter's own "
        f"{s['system_len']}-token system prompt plus a {s['user_len']}-token user part, {s['max_tokens']} output "
        f"tokens, {s['clients']} closed-loop clients through the AsyncLLMEngine:",
        "",
        table(["engine", "TTFT p50 ms", "TTFT max ms", "prefix hit rate"], prefix),
        ""])
