"""Grammar-constrained decoding: what a json_schema costs a decode step, compile times, and TTFT beside compiles.

    .venv/bin/python -m benchmarks.structured [--rounds 3] [--threads 2]

The model is the benchmark shape (Qwen3-0.6B-like, 8 layers, random) with a byte-level BPE tokenizer
trained here on Python's own standard library sources (so tokens spell JSON as a real vocabulary does)
and 32000 vocabulary rows (the rows past the tokenizer's are padding, masked by every grammar).

1. TPOT at batch 8: eight requests with a json_schema (temperature 1, seeded) against the same eight
   unconstrained, alternating in each round; decode step time per token. Target <= 1.15x.
2. Grammar compile time p50 / p99 over the test schemas (tests/test_serve_structured.py SCHEMAS), each
   compiled cold (a fresh compiler, so nothing is cached).
3. TTFT of 8 unconstrained requests arriving just after a burst of 8 requests with new schemas (each
   compiled cold), against the same requests after a burst of 8 unconstrained requests of the same shape
   (AsyncLLMEngine: compiles run on the grammar thread, not the step thread), and alone.
Writes results/structured_<dtype>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from benchmarks.checkpoint import QWEN3_0_6B_8L, cache_root
from benchmarks.common import machine_info, set_threads, write_result

TARGET = 1.15
VOCAB_ROWS, TOKENIZER_VOCAB = 32000, 16000
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}


def build_model(dtype: str) -> Path:
    """The bench shape with a byte-level BPE trained on the stdlib (cached under .cache/bench)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    from deployments.demo_model import CHAT_TEMPLATE, SPECIAL_TOKENS

    path = cache_root() / f"structured-h{QWEN3_0_6B_8L.hidden_size}-v{VOCAB_ROWS}-{dtype}"
    if (path / "config.json").is_file():
        return path
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((f.read_text(errors="replace") for f in files), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)
    tmp = path.with_name(path.name + ".tmp")
    fast.save_pretrained(tmp)
    s = QWEN3_0_6B_8L
    config = Qwen3Config(vocab_size=VOCAB_ROWS, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                         num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                         num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(tmp)
    tmp.rename(path)
    return path


def tpot(engine, prompts, structured, seed: int) -> tuple[float, int]:
    """Decode seconds per decode step (batch 8) and steps, one batch of requests."""
    from workers import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=seed + i, logprobs=False,
                                                  structured=structured))
    decode_s, steps = 0.0, 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.last_step = (0, 0)
        engine.step()
        decodes, prefills = engine.last_step
        if decodes == len(prompts) and not prefills:   # full-batch decode steps only
            decode_s += time.perf_counter() - t0
            steps += 1
    return decode_s / max(steps, 1), steps


def compile_times(path: Path) -> list[float]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_serve_structured import SCHEMAS

    from workers.grammar import GrammarCompiler, StructuredSpec

    times = []
    GrammarCompiler(path, VOCAB_ROWS, [0]).compile_now(StructuredSpec("json_object"))   # import + tokenizer info
    for schema in SCHEMAS:
        compiler = GrammarCompiler(path, VOCAB_ROWS, [0])
        compiler.compile_now(StructuredSpec("json_object"))        # tokenizer info built, not timed
        t0 = time.perf_counter()
        compiler.compile_now(StructuredSpec.json_schema(schema))
        times.append(time.perf_counter() - t0)
        compiler.close()
    return times


async def ttft(engine, prompts, burst: str, round_: int) -> list[float]:
    """TTFT of the unconstrained prompts, submitted just after a burst of 8 requests ("schemas": each with a
    schema never seen before; "free": unconstrained; "none": no burst)."""
    from workers import SamplingParams
    from workers.grammar import StructuredSpec

    async def first_token(prompt, params) -> float:
        t0 = time.perf_counter()
        async for _ in engine.generate(prompt, params):
            return time.perf_counter() - t0

    def burst_params(i: int) -> SamplingParams:
        if burst == "free":
            return SamplingParams(max_tokens=1)
        return SamplingParams(max_tokens=1, structured=StructuredSpec.json_schema({**SCHEMA, "title": f"r{round_}-{i}"}))

    constrained = [asyncio.create_task(first_token(prompts[0], burst_params(i)))
                   for i in range(0 if burst == "none" else 8)]
    await asyncio.sleep(0.001)
    times = await asyncio.gather(*(first_token(p, SamplingParams(max_tokens=1, seed=i)) for i, p in enumerate(prompts)))
    await asyncio.gather(*constrained)
    return list(times)


def percentile(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run(dtype: str = "bfloat16", rounds: int = 3, threads: int = 2, log=print) -> dict:
    from workers import EngineConfig, LLMEngine
    from workers.async_engine import AsyncLLMEngine
    from workers.grammar import StructuredSpec

    set_threads(threads)
    path = build_model(dtype)
    make = lambda: LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cpu", max_num_seqs=8,  # noqa: E731
                                          max_model_len=512, enable_lora=False, cpu_threads=threads))
    engine = make()
    prompts = [engine.tokenizer(f"Describe person number {i} as JSON:").input_ids for i in range(8)]
    spec = StructuredSpec.json_schema(SCHEMA)
    engine.grammars.compile_now(spec)
    tpot(engine, prompts, None, 0)                                  # warm-up
    ratios, free_s, json_s = [], [], []
    for r in range(rounds):
        free, n_free = tpot(engine, prompts, None, 100 * r)
        constrained, n_json = tpot(engine, prompts, spec, 100 * r)
        free_s.append(free)
        json_s.append(constrained)
        ratios.append(constrained / free)
        log(f"round {r}: TPOT free {free * 1e3:.1f} ms ({n_free} steps), json_schema {constrained * 1e3:.1f} ms "
            f"({n_json} steps): {constrained / free:.3f}x")
    engine.close()
    compiles = compile_times(path)
    log(f"compile p50 {percentile(compiles, 0.5) * 1e3:.1f} ms, p99 {percentile(compiles, 0.99) * 1e3:.1f} ms")
    async_engine = AsyncLLMEngine(make())

    async def ttfts():
        times = {"none": [], "free": [], "schemas": []}
        for r in range(rounds):
            for burst in times:                   # alternating
                times[burst] += await ttft(async_engine, prompts, burst, r)
        return times

    ttft_s = asyncio.run(ttfts())
    async_engine.close()
    alone, free_burst, beside = ttft_s["none"], ttft_s["free"], ttft_s["schemas"]
    log(f"TTFT p50 alone {statistics.median(alone) * 1e3:.1f} ms, after a burst of 8 unconstrained requests "
        f"{statistics.median(free_burst) * 1e3:.1f} ms, after a burst of 8 new schemas "
        f"{statistics.median(beside) * 1e3:.1f} ms")
    result = {"machine": machine_info(), "dtype": dtype, "batch": 8, "max_tokens": 64, "target": TARGET,
              "tpot_ratio_median": statistics.median(ratios), "tpot_ratios": ratios,
              "tpot_free_ms": [t * 1e3 for t in free_s], "tpot_json_ms": [t * 1e3 for t in json_s],
              "compile_ms_p50": percentile(compiles, 0.5) * 1e3, "compile_ms_p99": percentile(compiles, 0.99) * 1e3,
              "compile_ms": [t * 1e3 for t in compiles],
              "ttft_ms_p50_alone": statistics.median(alone) * 1e3,
              "ttft_ms_p50_after_free_burst": statistics.median(free_burst) * 1e3,
              "ttft_ms_p50_after_schema_burst": statistics.median(beside) * 1e3,
              "ttft_ms_p99_after_free_burst": percentile(free_burst, 0.99) * 1e3,
              "ttft_ms_p99_after_schema_burst": percentile(beside, 0.99) * 1e3,
              "ttft_ratio_p50_schemas_vs_free_burst": statistics.median(beside) / statistics.median(free_burst)}
    write_result(f"structured_{dtype}", result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    run(args.dtype, args.rounds, args.threads)


if __name__ == "__main__":
    main()
