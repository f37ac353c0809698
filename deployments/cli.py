"""`loraserve serve ...`: start Ray (or join a cluster), deploy the app, serve HTTP until interrupted.

Without --address a private single-node Ray is started on loopback (its own
temp dir, no dashboard, a random port); HTTP binds --host (127.0.0.1 by default).
Once serving, it prints the Ray address a separate script passes to `ray.init`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading

from deployments.config import DEMO_MODEL, LLMConfig

DEFAULT_APP_NAME = "loraserve"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loraserve", description="Ray Serve LoRA inference service")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="serve a model and its LoRA adapters over the OpenAI API")
    run.add_argument("--model", help="local HF directory or Hub id (default: the embedded demo model)")
    run.add_argument("--demo", action="store_true", help="serve the embedded tiny demo model and its adapters")
    run.add_argument("--lora", action="append", default=[], metavar="NAME=SOURCE",
                     help="an adapter to load at start (directory or Hub id); repeatable")
    run.add_argument("--tp", type=int, default=1, help="tensor parallel size (devices per replica)")
    run.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    run.add_argument("--replicas", type=int, default=1, help="LLMServer replicas")
    run.add_argument("--max-lora-rank", type=int, default=64)
    run.add_argument("--max-loras-per-batch", type=int, default=4)
    run.add_argument("--max-loaded-loras", type=int, default=16)
    run.add_argument("--max-model-len", type=int, default=None)
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=8000)
    run.add_argument("--name", default=DEFAULT_APP_NAME, help="Serve application name")
    run.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    run.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    args = parser.parse_args(argv)
    if args.demo and args.model:
        parser.error("--demo and --model exclude each other")
    return args


def config_from_args(args: argparse.Namespace) -> LLMConfig:
    adapters = {}
    for item in args.lora:
        name, sep, source = item.partition("=")
        if not sep or not name or not source:
            raise SystemExit(f"--lora expects NAME=SOURCE, got {item!r}")
        adapters[name] = source
    return LLMConfig(model=args.model or DEMO_MODEL, adapters=adapters, tensor_parallel_size=args.tp,
                     device=args.device, num_replicas=args.replicas, max_lora_rank=args.max_lora_rank,
                     max_loras_per_batch=args.max_loras_per_batch, max_loaded_loras=args.max_loaded_loras,
                     max_model_len=args.max_model_len)


def serve_forever(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    import ray
    from ray import serve

    from workers.ray_utils import init_local_ray

    temp_dir = None
    if args.address:
        context = ray.init(address=args.address)
    else:
        temp_dir = tempfile.mkdtemp(prefix="lsr-", dir="/tmp")   # short: Ray's socket paths have a length limit
        context = init_local_ray(temp_dir, num_cpus=args.num_cpus or os.cpu_count() or 2)
    from deployments.app import build_app

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(config), name=args.name, route_prefix="/", blocking=False)
        base = f"http://{args.host}:{args.port}"
        print(f"loraserve: serving {config.base_model_name!r} at {base}/v1 (models: {base}/v1/models)", flush=True)
        print(ray_address_hint(context.address_info["gcs_address"], args.name), flush=True)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


def ray_address_hint(address: str, app_name: str) -> str:
    """How a separate Python script joins this Ray (the local one listens on a random loopback port)."""
    return (f"loraserve: Ray at {address}; from a script: ray.init(address=\"{address}\"), then "
            f"serve.get_deployment_handle(\"LLMServer\", app_name=\"{app_name}\") "
            f"(run it with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 when the address is 127.0.0.1)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "serve":
        serve_forever(args)


if __name__ == "__main__":
    main(sys.argv[1:])
