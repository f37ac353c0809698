"""Which files of ours one streamed chat request runs, measured on the running service (issue 40's path).

    .venv/bin/python -m benchmarks.request_path      (~2 min; writes results/request_path.{json,md})

Starts `loraserve serve --demo` (what `make serve` runs: TP 1, the CPU, the engine in its own process) with
benchmarks/path_trace/ on PYTHONPATH, so each of its Python processes (the ingress, the replica, the engine
process, Serve's own) notes the functions of the repository it runs. After warm-up requests, three windows of
the same length: one streamed chat completion for an adapter, nothing (what runs anyway: health checks,
routing stats, the registry's long poll, metrics), and the request again. A file is on the path when the
request ran a function of it in both its windows that the idle window did not run; C kernels are not seen
(they are named in docs/architecture.md by hand).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.common import RESULTS, machine_info, write_result

ROOT = Path(__file__).resolve().parents[1]
WINDOW_S = 1.5
ROLES = (("deployments/openai_api.py", "ingress"), ("workers/engine_core.py", "engine process"),
         ("deployments/llm_server.py", "replica"))


def _serve(out: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "LS_PATH_TRACE": str(out), "LS_PATH_TRACE_ROOT": str(ROOT),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "path_trace"), str(ROOT)]),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    log = out / "serve.log"   # a file, not a pipe: nobody reads a pipe once serving, and a full one stalls the CLI
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", "--demo", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if "serving 'loraserve-demo'" in log.read_text(errors="replace"):
            return proc
        time.sleep(0.5)
    _stop(proc)
    raise RuntimeError(f"loraserve serve --demo did not start:\n{log.read_text(errors='replace')[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT: the CLI stops Serve and the Ray processes it started (a kill would leave them)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


def _chat(port: int) -> None:
    body = {"model": "demo-a", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read().decode()
    assert text.rstrip().endswith("data: [DONE]"), text[-200:]


def _window(out: Path, port: int | None) -> dict[int, set[str]]:
    """Every process's functions run in one window: the request's if `port`, else an idle one."""
    (out / "reset").write_text(str(time.time_ns()))
    time.sleep(WINDOW_S)
    if port is not None:
        _chat(port)
    time.sleep(WINDOW_S)
    return {int(p.stem): set(filter(None, p.read_text().splitlines())) for p in out.glob("*.txt")}


def _role(functions: set[str]) -> str:
    files = {f.split(":", 1)[0] for f in functions}
    return next((role for file, role in ROLES if file in files), "other")


def measure(port: int) -> dict:
    from workers.ray_utils import free_port

    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="lspath") as tmp:
        out = Path(tmp)
        proc = _serve(out, port)
        try:
            for _ in range(5):
                _chat(port)
            first, idle, second = _window(out, port), _window(out, None), _window(out, port)
        finally:
            _stop(proc)
    # the request's: run in both request windows and not in the idle one (a background timer firing in one
    # window, e.g. the registry's check for a deleted app, is not the request's)
    requested = set().union(*first.values()) & set().union(*second.values())
    requested -= set().union(*idle.values())
    seen: dict[str, tuple[set, set]] = {}   # file -> (processes, functions)
    for pid in first.keys() | second.keys():
        ran = first.get(pid, set()) | second.get(pid, set())
        for function in ran & requested:
            name, qualname = function.split(":", 1)
            processes, functions = seen.setdefault(name, (set(), set()))
            processes.add(_role(ran))
            functions.add(qualname)
    files = {name: {"lines": len((ROOT / name).read_text().splitlines()), "processes": sorted(processes),
                    "functions": sorted(functions)} for name, (processes, functions) in sorted(seen.items())}
    return {"files": files, "num_files": len(files), "num_lines": sum(f["lines"] for f in files.values())}


def markdown(result: dict) -> str:
    rows = [f"| `{name}` | {f['lines']} | {', '.join(f['processes'])} | {len(f['functions'])}: "
            f"{', '.join(f['functions'][:6])}{' ...' if len(f['functions']) > 6 else ''} |"
            for name, f in result["files"].items()]
    return "\n".join([
        "# One streamed chat request's files, measured", "",
        f"`{result['command']}` on {result['machine']['processor']}, {result['date']}: `loraserve serve --demo` "
        "(TP 1, CPU, engine process), `POST /v1/chat/completions` with `stream: true` for an adapter, 8 tokens.",
        "A file counts when the request ran a function of it in both request windows that an idle window of the "
        "same length did not.", "",
        f"**{result['num_files']} Python files, {result['num_lines']} lines** (C kernels not counted).", "",
        "| file | lines | process | functions the request ran |", "|---|---|---|---|", *rows, ""])


def main(argv=None) -> dict:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    args = parser.parse_args(argv)
    result = measure(args.port)
    result.update(command="python -m benchmarks.request_path", date=time.strftime("%Y-%m-%d %H:%M UTC",
                  time.gmtime()), machine=machine_info())
    print(write_result("request_path", result))
    (RESULTS / "request_path.md").write_text(markdown(result))
    print(f"{result['num_files']} files, {result['num_lines']} lines")
    return result


if __name__ == "__main__":
    main()
