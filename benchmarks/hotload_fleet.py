"""Hot-load and unload across a fleet: over HTTP on a 2-replica app (loopback Ray and Serve, the benchmark
checkpoint, rank-16 adapters), how long `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` take. A call
returns once every replica has applied the change, so this is the time until the whole fleet serves it.

    .venv/bin/python -m benchmarks.hotload_fleet [--samples 10] [--tree DIR --tree DIR2 ...]

Each tree (default: this checkout; another revision: its worktree .cache/ab/<sha>, benchmarks.trees.checkout)
runs in a process of its own with that tree first on the path (benchmarks/trees.py), alternating a, b, b, a with
--pairs, so that a ratio comes from one run on a shared machine. The app uses each tree's defaults.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import machine_info, median, write_result
from benchmarks.trees import ROOT, alternating, revision, run_child

CHILD = """
import json, shutil, sys, tempfile, time
import ray, requests
from benchmarks.checkpoint import build_adapters, build_checkpoint
from workers.ray_utils import free_port, init_local_ray

samples = int(sys.argv[1])
model, adapters = build_checkpoint("bfloat16"), build_adapters(2)
temp_dir = tempfile.mkdtemp(prefix="lshf-", dir="/tmp")
init_local_ray(temp_dir, num_cpus=4)
from ray import serve
from deployments.app import build_app
port = free_port()
serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(build_app(dict(model=str(model), served_model_name="base", device="cpu", max_model_len=256, num_replicas=2,
                         replica_cpus=1, enable_hotload=True, adapter_roots=[str(adapters[0].parent)])),
          name="fleet", route_prefix="/")
url, out = f"http://127.0.0.1:{port}/v1", {"load": [], "unload": []}
for i in range(samples + 1):   # the first pair warms up
    for kind, body in (("load", {"lora_name": "h", "lora_path": str(adapters[i % 2])}), ("unload", {"lora_name": "h"})):
        start = time.perf_counter()
        response = requests.post(f"{url}/{kind}_lora_adapter", json=body, timeout=120)
        assert response.status_code == 200, response.text
        if i:
            out[kind].append(time.perf_counter() - start)
serve.shutdown()
ray.shutdown()
shutil.rmtree(temp_dir, ignore_errors=True)
print("RESULT " + json.dumps(out))
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10, help="load + unload pairs per run")
    parser.add_argument("--tree", action="append", type=Path, help="a checkout to measure (repeatable)")
    parser.add_argument("--pairs", type=int, default=1, help="runs per tree, alternating a, b, b, a")
    args = parser.parse_args(argv)
    trees = [t.resolve() for t in args.tree or [ROOT]]
    order = alternating(trees, args.pairs)
    runs: dict[str, dict[str, list[float]]] = {revision(t): {"load": [], "unload": []} for t in trees}
    for tree in order:
        got = run_child(tree, CHILD, str(args.samples))
        for kind, seconds in got.items():
            runs[revision(tree)][kind] += seconds
        print(f"{revision(tree)}: load p50 {1e3 * median(got['load']):.0f} ms, "
              f"unload p50 {1e3 * median(got['unload']):.0f} ms", flush=True)
    summary = {tree: {f"{kind}_{stat}_ms": 1e3 * f(s) for kind, s in kinds.items() for stat, f in
                      (("p50", median), ("max", max))} for tree, kinds in runs.items()}
    result = {"machine": machine_info(), "samples": args.samples, "pairs": args.pairs,
              "order": [revision(t) for t in order], "trees": summary}
    write_result("hotload_fleet", result)
    return result


if __name__ == "__main__":
    main()
