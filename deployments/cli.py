"""`loraserve serve ...`: start Ray (or join a cluster), deploy the app, serve HTTP until interrupted.

Without --address a private single-node Ray is started on loopback (its own
temp dir, no dashboard, a random port); HTTP binds --host (127.0.0.1 by default).
Once serving, it prints the Ray address a separate script passes to `ray.init`.
The start fails (exit 1) with a message when a replica cannot be placed
(deployments/placement.py) or raises while it starts: then the replica's own
exception, and where its traceback and a copy of Ray's logs are kept. SIGTERM or SIGINT stops it at any point, also
while Ray or Serve is starting, within SHUTDOWN_GRACE_S: a clean stop exits 0.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from deployments.config import DEMO_MODEL, LLMConfig
from lora.modules import SUPPORTED_MODULES as SUPPORTED_LORA_MODULES
from workers.reasoning import REASONING_PARSERS

DEFAULT_APP_NAME = "loraserve"
SHUTDOWN_GRACE_S = 8.0    # after SIGTERM the process is gone within this, whatever hangs (orchestrators wait 10+)
SERVE_SHUTDOWN_S = 4.0    # of which Serve gets this to drain and stop replicas
STOPPING = threading.Event()
# A stop signal arrived: its handler also raises, but a raise landing where Python swallows it (an at-fork
# hook while Ray forks its daemons: "Exception ignored in _releaseLock") is lost; the flag is not.
STOP_REQUESTED = threading.Event()


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
    run.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                     help="weights and activations (auto: bfloat16; float32 on a CPU without bf16 instructions)")
    run.add_argument("--cpu-threads", type=int, default=None,
                     help="device cpu: compute threads per rank (default: the node's CPUs but "
                          "--cpu-reserved-cores, / tp)")
    run.add_argument("--cpu-reserved-cores", type=int, default=None,
                     help="device cpu: cores the default --cpu-threads leaves to Serve (default 1)")
    run.add_argument("--replicas", type=int, default=1, help="LLMServer replicas")
    run.add_argument("--routing", default="adapter-affinity", choices=["adapter-affinity", "multiplex"],
                     help="how requests pick a replica: adapter home sets with bounded load (default), or Serve's "
                          "multiplexed routing (docs/routing.md)")
    run.add_argument("--max-lora-rank", type=int, default=64)
    run.add_argument("--max-loras-per-batch", type=int, default=8,
                     help="distinct adapters a step runs (default 8: docs/scheduling.md)")
    run.add_argument("--max-loaded-loras", type=int, default=16)
    run.add_argument("--max-model-len", type=int, default=None)
    run.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoding at once per replica")
    run.add_argument("--lora-target-modules", nargs="+", default=None, choices=SUPPORTED_LORA_MODULES,
                     metavar="MODULE",
                     help="modules that get LoRA buffers (default: every supported one: "
                          f"{' '.join(SUPPORTED_LORA_MODULES)}); adapters targeting others are refused. "
                          "Leaving out embed_tokens / lm_head saves their vocabulary-sized buffers (a step runs the LoRA of "
                          "only the modules its adapters target, whatever this list)")
    run.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="tokens per engine step, decodes first (default per device: 128 on cpu, 2048 else)")
    run.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                     help="run long prompts in chunks beside the running decodes (default: on)")
    run.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="reuse the KV of prompt prefixes seen before, per adapter (default: on)")
    run.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                     help="a thinking model's reasoning apart from its answer (message.reasoning_content), and a "
                          "response_format / tools grammar applied after it (vLLM's flag; docs/structured-output.md)")
    run.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                     help="the engine in a process of its own beside each replica (TP=1; vLLM's EngineCore)")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=8000)
    run.add_argument("--name", default=DEFAULT_APP_NAME, help="Serve application name")
    run.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    run.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    run.add_argument("--placement-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="fail the start when a replica cannot be placed within this (0: wait forever, e.g. "
                          "for a cluster autoscaler); one that no node could ever hold fails at once")
    security = run.add_argument_group("security (docs/security.md)")
    security.add_argument("--api-key", default=None, metavar="KEY",
                          help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                               "$LORASERVE_API_KEY; unset = no authentication)")
    security.add_argument("--metrics-require-api-key", action="store_true",
                          help="/metrics needs the key too (default: open, as vLLM's, for Prometheus)")
    security.add_argument("--enable-hotload", action="store_true",
                          help="allow /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default)")
    security.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                          help="a directory hot-loaded adapters may come from; repeatable (default: any)")
    quantize = commands.add_parser("quantize", help="write a W8A8_DYNAMIC copy of a 16/32-bit checkpoint "
                                   "(msModelSlim's AscendV1 layout; docs/w8a8.md)")
    quantize.add_argument("src", help="the float checkpoint directory")
    quantize.add_argument("dst", help="the new directory (must not exist or be empty)")
    args = parser.parse_args(argv)
    if args.command == "quantize":
        return args
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
    return LLMConfig(model=args.model or DEMO_MODEL, adapters=adapters, num_replicas=args.replicas,
                     api_key=args.api_key, metrics_require_api_key=args.metrics_require_api_key,
                     enable_hotload=args.enable_hotload, engine_process=args.engine_process,
                     placement_timeout_s=args.placement_timeout or None, routing=args.routing,
                     engine_kwargs=_engine_kwargs(args))


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the CLI sets (LLMConfig passes them through as engine_kwargs)."""
    kwargs = dict(tensor_parallel_size=args.tp, device=args.device, dtype=args.dtype, max_lora_rank=args.max_lora_rank,
                  max_loras_per_batch=args.max_loras_per_batch, max_loaded_loras=args.max_loaded_loras,
                  max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
                  adapter_roots=args.adapter_root, max_num_seqs=args.max_num_seqs)
    if args.cpu_threads:
        kwargs["cpu_threads"] = args.cpu_threads
    if args.cpu_reserved_cores is not None:
        kwargs["cpu_reserved_cores"] = args.cpu_reserved_cores
    if args.lora_target_modules:
        kwargs["lora_target_modules"] = tuple(dict.fromkeys(args.lora_target_modules))
    if args.reasoning_parser:
        kwargs["reasoning_parser"] = args.reasoning_parser
    return kwargs


def serve_forever(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT (exit status 0); 1 when the application cannot start."""
    config = config_from_args(args)
    for warning in config.startup_warnings():
        print(f"loraserve: warning: {warning}", file=sys.stderr, flush=True)
    import ray
    import ray._private.ray_constants as ray_constants
    import ray._private.utils as ray_private_utils
    from ray import serve

    from workers.ray_utils import init_local_ray

    # Ray's C++ failure-signal handler (stack dump, then abort) would replace ours for SIGTERM in this process;
    # read when ray.init starts the driver's core worker, so this leaves Ray's own processes as they are.
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    # ray.init would put its own SIGTERM handler (sys.exit) in place of ours for its duration: ours records
    # the signal, so a stop during ray.init is acted on once it returns even if its raise was swallowed.
    ray_private_utils.set_sigterm_handler = lambda _handler: None
    temp_dir, serving = None, False
    try:
        if args.address:
            context = ray.init(address=args.address)
        else:
            temp_dir = tempfile.mkdtemp(prefix="lsr-", dir="/tmp")   # short: Ray's socket paths have a length limit
            context = init_local_ray(temp_dir, num_cpus=args.num_cpus or os.cpu_count() or 2)
        _raise_on_stop_signals()
        if STOP_REQUESTED.is_set():
            raise KeyboardInterrupt
        from deployments.app import build_app
        from deployments.placement import DeployError, PlacementError, wait_until_running

        try:
            app = build_app(config)   # before Serve starts: a replica no node can hold fails here, at once
            serve.start(http_options={"host": args.host, "port": args.port})
            serve.run_many([serve.RunTarget(app, name=args.name, route_prefix="/")],
                           wait_for_applications_running=False)
            wait_until_running(args.name, config.placement_timeout_s)
        except (PlacementError, DeployError) as exc:
            print(f"loraserve: cannot start: {exc}", file=sys.stderr, flush=True)
            if isinstance(exc, DeployError):
                print(keep_start_failure(exc, copy_ray_logs=temp_dir is not None), file=sys.stderr, flush=True)
            return 1
        base = f"http://{args.host}:{args.port}"
        print(f"loraserve: serving {config.base_model_name!r} at {base}/v1 (models: {base}/v1/models)", flush=True)
        print(ray_address_hint(context.address_info["gcs_address"], args.name), flush=True)
        serving = True
        while not STOP_REQUESTED.is_set():
            time.sleep(1)   # until a signal raises KeyboardInterrupt (or sets the flag where its raise was lost)
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(args.name, joined=bool(args.address), drain=serving, temp_dir=temp_dir)


def keep_start_failure(error, copy_ray_logs: bool) -> str:
    """Where the cause of a failed start is kept, as a line to print: the failing replica's traceback (from
    Serve's status) in a file, and, for the private Ray whose temp dir goes at exit, a copy of its logs
    (Serve's controller log holds every failed attempt's traceback)."""
    import ray

    keep = Path(tempfile.mkdtemp(prefix="loraserve-start-failed-"))
    (keep / "replica_error.txt").write_text((error.details or str(error)) + "\n")
    node = getattr(ray._private.worker, "_global_node", None)
    logs = node.get_logs_dir_path() if node is not None else None
    where = f"loraserve: the replica's traceback: {keep / 'replica_error.txt'}"
    if logs and copy_ray_logs:
        try:
            shutil.copytree(logs, keep / "ray-logs", symlinks=True, ignore_dangling_symlinks=True)
            return f"{where}; Ray's logs of this run: {keep / 'ray-logs'} (Serve's: {keep / 'ray-logs' / 'serve'})"
        except OSError as exc:   # a file that went meanwhile: what was copied stays
            return f"{where}; Ray's logs of this run, partly ({exc.__class__.__name__}): {keep / 'ray-logs'}"
    if logs:
        return f"{where}; the cluster's Ray logs: {logs} on its head node (Serve's: {logs}/serve)"
    return where


def _stop(app_name: str, joined: bool, drain: bool, temp_dir: str | None) -> None:
    """Stop what we started: on a cluster we joined only our application, else the local Ray, after Serve
    drained its requests if it was serving (bounded: SERVE_SHUTDOWN_S)."""
    import ray
    from ray import serve
    from ray._private import auto_init_hook

    STOPPING.set()
    deadline = threading.Timer(SHUTDOWN_GRACE_S, os._exit, (1,))   # whatever hangs below, the process ends
    deadline.daemon = True
    deadline.start()
    if ray.is_initialized() and (joined or drain):
        def stop_serve() -> None:
            try:
                serve.delete(app_name) if joined else serve.shutdown()
            except Exception as exc:  # noqa: BLE001  (nothing deployed yet, or Serve already gone)
                print(f"loraserve: stopping Serve: {exc}", file=sys.stderr, flush=True)

        stopper = threading.Thread(target=stop_serve, daemon=True)   # bounded: ray.shutdown ends it regardless
        stopper.start()
        stopper.join(SERVE_SHUTDOWN_S)
    # A Serve call still waiting in the stopper (past its bound) must not start a Ray of its own once ours is
    # down: its next ray.get would (Ray's auto-init), a new cluster under /tmp/ray that nothing stops.
    auto_init_hook.enable_auto_connect = False
    ray.shutdown()   # also after an interrupted ray.init: stops the processes it had started
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _raise_on_stop_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt in the main thread wherever it is (in serve.start, a
    blocking Ray call: Ray checks for signals while it waits), once: not during the clean-up; and set
    STOP_REQUESTED. Installed again after ray.init (which installs Ray's own SIGINT handling)."""
    def on_signal(_signum, _frame) -> None:
        STOP_REQUESTED.set()
        if not STOPPING.is_set():
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def ray_address_hint(address: str, app_name: str) -> str:
    """How a separate Python script joins this Ray (the local one listens on a random loopback port)."""
    return (f"loraserve: Ray at {address}; from a script: ray.init(address=\"{address}\"), then "
            f"serve.get_deployment_handle(\"LLMServer\", app_name=\"{app_name}\") "
            f"(run it with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 when the address is 127.0.0.1)")


def main(argv: list[str] | None = None) -> None:
    _raise_on_stop_signals()
    args = parse_args(argv)
    if args.command == "serve":
        sys.exit(serve_forever(args))
    if args.command == "quantize":
        sys.exit(quantize_command(args))


def quantize_command(args: argparse.Namespace) -> int:
    from workers.quant.writer import quantize_checkpoint
    try:
        description = quantize_checkpoint(Path(args.src), Path(args.dst))
    except (OSError, ValueError) as exc:
        print(f"loraserve quantize: {exc}", file=sys.stderr)
        return 1
    count = sum(1 for k, v in description.items() if k.endswith(".weight") and v != "FLOAT")
    print(f"wrote {args.dst}: {count} W8A8_DYNAMIC linears")
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
