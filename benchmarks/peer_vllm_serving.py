"""vLLM's OpenAI server from its own venv (benchmarks/peer_vllm.py's), and the HTTP serving comparison: the
benchmarks.serving load against vLLM's server and against ours, one after the other. Used by peer_vllm.run and
benchmarks/serving_vllm.py; apart from peer_vllm.py's offline jobs because it drives servers, not engines."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from benchmarks.checkpoint import build_adapters, build_checkpoint
from benchmarks.common import Sizes
from benchmarks.peer_vllm import ensure_venv, vllm_env
from benchmarks.throughput import adapter_name


def vllm_server(model: Path, dtype: str, sizes: Sizes, paths: list[Path], port: int, max_model_len: int, log=print,
                omp_bind: str | None = None):
    cmd = [str(ensure_venv(log)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "bench", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(sizes.batch), "--max-model-len", str(max_model_len), "--enable-lora",
           "--max-loras", str(sizes.max_loras_per_batch), "--max-lora-rank", str(sizes.rank),
           "--max-cpu-loras", str(sizes.max_loaded_loras), "--seed", "0",
           "--lora-modules", *[f"{adapter_name(i)}={p}" for i, p in enumerate(paths)]]
    return subprocess.Popen(cmd, env=vllm_env(sizes.threads, log, omp_bind), cwd=tempfile.gettempdir(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def wait_healthy(server: subprocess.Popen, url: str, timeout: float = 900) -> None:
    """Until vLLM's server at `url` answers /health; fails if it exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5)
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("vLLM's server did not come up") from None
            time.sleep(2)


def serving(sizes: Sizes, dtype: str, log=print) -> dict:
    import asyncio

    from benchmarks import serving as ours
    from workers.ray_utils import free_port

    load = ours.ServingLoad(num_adapters=8)
    model = build_checkpoint(dtype, sizes.shape)
    paths = build_adapters(load.num_adapters, sizes.shape, sizes.rank)
    port = free_port()
    server = vllm_server(model, dtype, sizes, paths, port, load.input_range[1] + load.output_range[1] + 16, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url)
        requests = ours.make_requests(load, sizes.shape.vocab_size)
        naming = lambda adapter: "bench" if adapter is None else adapter_name(adapter)  # noqa: E731
        asyncio.run(ours.drive(url, ours.warm_requests(load, sizes), naming))
        results, wall = asyncio.run(ours.drive(url, requests, naming))
        vllm = ours.summarize(results, wall)
    finally:
        os.killpg(server.pid, signal.SIGTERM)   # the server and its engine-core process, started by us
        server.wait(timeout=60)
    mine = ours.run(replace(sizes), load, dtype, log)["summary"]
    log(f"[vllm serving] TPOT p50 ours {mine['tpot_ms']['p50']:.1f} vLLM {vllm['tpot_ms']['p50']:.1f} ms; "
        f"TTFT p99 ours {mine['ttft_ms']['p99']:.0f} vLLM {vllm['ttft_ms']['p99']:.0f} ms")
    return {"ours": mine, "vllm": vllm, "load": {"rate": load.rate, "num_requests": load.num_requests,
                                                 "num_adapters": load.num_adapters}}
