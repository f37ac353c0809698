"""Shared benchmark plumbing: sizes, the engine factory, a timed step loop, results files."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from benchmarks.checkpoint import ALL7, QWEN3_0_6B_8L, TINY, ModelShape

RESULTS = Path(__file__).resolve().parent / "results"

# The targets, shared by the report and its analysis.
TARGETS = {"one": 0.95, "eight": 0.85, "eight_byte_points": 0.05, "many_vs_eight": 0.90, "peft": 3.0,
           "bound_fraction": 0.50}


@dataclass(frozen=True)
class Sizes:
    """One benchmark run's sizes; `full` is what `make bench` runs, `tiny` what the harness test runs."""
    shape: ModelShape = QWEN3_0_6B_8L
    batch: int = 32                 # max_num_seqs, and the peer's static batch
    num_requests: int = 64          # per workload run (2 waves of `batch`)
    prompt_len: int = 32
    max_tokens: int = 32
    rounds: int = 5                 # interleaved repetitions; ratios are medians over rounds
    rank: int = 16
    max_loras_per_batch: int = 8
    max_loaded_loras: int = 64
    num_many: int = 1000            # adapters of the host-paging workload
    num_some: int = 64              # adapters of the slot-paging workload
    power_alpha: float = 0.3        # S-LoRA's generator: adapter = floor(power(alpha) * n)
    fp32_rounds: int = 2            # the fp32 run: base / one / eight only
    peer_rounds: int = 2
    hotload_samples: int = 40
    bandwidth_bytes: int = 1 << 30  # the read-bandwidth probe's tensor (far larger than the caches)
    seed: int = 0
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)


FULL = Sizes()
TINY_SIZES = Sizes(shape=TINY, batch=4, num_requests=8, prompt_len=8, max_tokens=4, rounds=1, rank=8,
                   max_loras_per_batch=2, max_loaded_loras=4, num_many=12, num_some=6, fp32_rounds=1,
                   peer_rounds=1, hotload_samples=4, bandwidth_bytes=1 << 24)


def sizes_from_json(text: str | None, base: Sizes = FULL) -> Sizes:
    """Override fields of `base` from a JSON object (shape given as "tiny" or "full")."""
    if not text:
        return base
    values = json.loads(text)
    if "shape" in values:
        values["shape"] = {"tiny": TINY, "full": QWEN3_0_6B_8L}[values["shape"]]
    return replace(base, **values)


def set_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)


def make_engine(model_dir: Path, dtype: str, sizes: Sizes, enable_lora: bool = True):
    from workers import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(
        model=str(model_dir), dtype=dtype, device="cpu", seed=sizes.seed, max_num_seqs=sizes.batch,
        max_model_len=sizes.prompt_len + sizes.max_tokens + 16, enable_lora=enable_lora,
        max_loras_per_batch=sizes.max_loras_per_batch, max_loaded_loras=sizes.max_loaded_loras,
        max_lora_rank=sizes.rank, kv_cache_memory_gb=1.0, cpu_threads=sizes.threads,
        # The whole batch's prompts in one step, as in every recorded run: these benchmarks time decode
        # (the scheduling benchmark measures chunked prefill on its own, against the engine without it).
        max_num_batched_tokens=max(2048, sizes.batch * sizes.prompt_len),
        # The adapters' own target set, as in every recorded run; since steps skip the modules their adapters
        # do not target, the default (embed_tokens and lm_head too) costs the same decode time
        # (results/targets.md) and only adds the vocabulary-sized slot buffers.
        lora_target_modules=ALL7))


def make_prompts(sizes: Sizes) -> list[list[int]]:
    """The same token-id prompts for every system (ids >= 2 skip the special tokens)."""
    import random

    rng = random.Random(sizes.seed)
    vocab = sizes.shape.vocab_size
    return [[rng.randrange(2, vocab) for _ in range(sizes.prompt_len)] for _ in range(sizes.num_requests)]


def power_law_choices(n: int, count: int, alpha: float, seed: int) -> list[int]:
    """S-LoRA's adapter choice: floor(power(alpha) * n); alpha < 1 skews towards low indices."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [min(int(x * n), n - 1) for x in rng.power(alpha, count)]


@dataclass
class RunTiming:
    wall_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    idle_s: float = 0.0              # steps that ran nothing: waiting on a background adapter load
    output_tokens: int = 0
    decode_tokens: int = 0
    decode_steps: int = 0
    prefill_steps: int = 0
    adapters_per_decode_step: list[int] = field(default_factory=list)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "adapters_per_decode_step"}
        out["output_tok_s"] = self.output_tok_s
        out["decode_tok_s"] = self.decode_tok_s
        steps = self.adapters_per_decode_step
        out["mean_adapters_per_decode_step"] = statistics.fmean(steps) if steps else 0.0
        out["mean_decode_batch"] = self.decode_tokens / self.decode_steps if self.decode_steps else 0.0
        return out


def run_requests(engine, prompts, adapters, max_tokens: int, logprobs: bool = False) -> RunTiming:
    """Submit every request, then step until all finish; each step timed and classified (`logprobs`: each
    request asks for its tokens' logprobs, as the sampler computes them only then).

    A step that runs any prompt tokens is a prefill step (with chunked prefill it also carries the
    running decodes); a step of decodes only is a decode step; a step that returns nothing waited
    on a background adapter load.
    """
    from workers import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    timing = RunTiming()
    start = time.perf_counter()
    for prompt, adapter in zip(prompts, adapters):
        engine.add_request(prompt, params, adapter)
    controller = engine.controller
    while engine.has_unfinished():
        running = controller.running
        adapters_now = len({s.adapter for s in running if s.adapter})
        t0 = time.perf_counter()
        engine.last_step = (0, 0)
        outputs = engine.step()
        dt = time.perf_counter() - t0
        decode_tokens, prefill_tokens = engine.last_step
        if not decode_tokens and not prefill_tokens:
            time.sleep(0.001)
            timing.idle_s += time.perf_counter() - t0
        elif prefill_tokens:
            timing.prefill_s += dt
            timing.prefill_steps += 1
        else:
            timing.decode_s += dt
            timing.decode_steps += 1
            timing.decode_tokens += len(outputs)
            timing.adapters_per_decode_step.append(adapters_now)
    timing.wall_s = time.perf_counter() - start
    timing.output_tokens = len(prompts) * max_tokens
    return timing


def machine_info() -> dict:
    import torch

    from lora.backends import cpu_sgmv
    from workers import cpu_attention

    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "machine": platform.machine(), "processor": _cpu_model(),
            # which code ran: the C kernels, or the torch ops they replace when they cannot build
            "cpu_kernels": {"lora": cpu_sgmv.available(), "attention": cpu_attention.available()}}
    try:
        info["load_avg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def write_result(name: str, data: dict, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def as_engine_process(module: str, argv) -> None:
    """Run `python -m module argv` again with the malloc setting every engine process of ours starts with
    (workers/engine_process.py's MALLOC_TUNABLES: glibc reads it only at start), unless GLIBC_TUNABLES is set
    (empty: glibc's defaults)."""
    if "GLIBC_TUNABLES" not in os.environ:
        from workers.engine_process import MALLOC_TUNABLES

        args = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, "-m", module, *args],
                  {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES})


def command(module: str, argv) -> str:
    """How to re-run this result: the hash seed too (Ray's router and the LoRA budget break ties in set order)."""
    return " ".join([f"PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', '')}", f"python -m {module}",
                     *(argv if argv is not None else sys.argv[1:])])


def record(name: str, result: dict, started: float, markdown) -> dict:
    """results/<name>.json and .md, with the CPU time since `started` and the machine."""
    result["cpu_s"] = time.process_time() - started
    result["machine"] = machine_info()
    print(write_result(name, result))
    (RESULTS / f"{name}.md").write_text(markdown(result))
    return result


def sizes_dict(sizes: Sizes) -> dict:
    data = asdict(sizes)
    data["shape"] = asdict(sizes.shape)
    return data


def bench_main(name: str, doc: str, run, argv=None) -> dict:
    """The command line every single benchmark shares: --dtype, --sizes; writes results/<name>_<dtype>.json, or
    <name>_<dtype>_t<N>.json where --sizes asks for N > 1 threads (a 2-thread run then leaves the 1-thread one's
    file alone)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--sizes", default=None, help="JSON overrides of benchmarks.common.Sizes")
    args = parser.parse_args(argv)
    threads = json.loads(args.sizes or "{}").get("threads", 1)
    data = run(sizes_from_json(args.sizes), args.dtype)
    print(write_result(f"{name}_{args.dtype}" + (f"_t{threads}" if threads > 1 else ""), data))
    return data


@contextlib.contextmanager
def local_serve(prefix: str, num_cpus: int) -> Iterator[str]:
    """A private loopback Ray + Serve for one benchmark run: yields Serve's HTTP URL; stops both after."""
    from workers.ray_utils import free_port, init_local_ray

    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")   # short: Ray's socket paths have a length limit
    init_local_ray(temp_dir, num_cpus=num_cpus)
    import ray
    from ray import serve
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
