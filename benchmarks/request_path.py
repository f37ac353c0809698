"""Which files of ours one streamed chat request runs, and its path through them, measured on the running service
(issue 40's path).

    .venv/bin/python -m benchmarks.request_path      (~2 min; writes results/request_path.{json,md})

Starts `loraserve serve --demo` (what `make serve` runs: TP 1, the CPU, the engine in its own process) with
benchmarks/path_trace/ on PYTHONPATH, so each of its Python processes (the ingress, the replica, the engine
process, Serve's own) notes the functions of the repository it runs and the calls between them. After warm-up
requests, three windows of the same length: one streamed chat completion for an adapter, nothing (what runs
anyway: health checks, routing stats, the registry's long poll, metrics), and the request again. A file is the
request's when it ran a function of it in both its windows that the idle window did not run; C kernels are not
seen (docs/architecture.md names them by hand). The path joins the stages of the request (STAGES) by the
measured chains of calls between them (`_path`); every other file the request ran is a helper that a file of
the path calls. `--windows F` keeps the measured windows, `--from-windows F` analyses them again.
"""
from __future__ import annotations

import heapq
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
ROLES = (("deployments/openai_api.py", "ingress"), ("deployments/llm_server.py", "replica"),
         ("workers/core.py", "engine process"))
# The stages of a chat completion, in order: DESIGN.md's data flow of one request "from the route to the kernel and
# back" (issue 40). The route; the body parsed and validated into the sampling parameters; the router; the replica;
# the prompt tokenized; the engine request built and checked once; the engine core; its scheduler; the LoRA kernel
# (prefill); the sampler; the captured decode step; the detokenizer; the SSE renderer; the route again. The path
# joins each stage to the next by a chain of calls measured between them (`_path`).
STAGES = (("ingress", "deployments/openai_api.py"), ("ingress", "deployments/protocol.py"),
          ("ingress", "deployments/routing/router.py"), ("replica", "deployments/llm_server.py"),
          ("replica", "workers/tokenizer.py"), ("replica", "workers/request.py"),
          ("engine process", "workers/core.py"), ("engine process", "workers/controller.py"),
          ("engine process", "lora/backends/cpu_sgmv.py"), ("engine process", "workers/sampler.py"),
          ("engine process", "workers/graph_runner.py"), ("replica", "workers/output.py"),
          ("replica", "deployments/render.py"), ("ingress", "deployments/openai_api.py"))


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
    """Every process's functions and calls between files in one window: the request's if `port`, else an idle
    one ("file:qualname" a function, "caller>callee" a call)."""
    (out / "reset").write_text(str(time.time_ns()))
    time.sleep(WINDOW_S)
    if port is not None:
        _chat(port)
    time.sleep(WINDOW_S)
    return {int(p.stem): set(filter(None, p.read_text().splitlines())) for p in out.glob("*.txt")}


def _role(functions: set[str]) -> str:
    files = {f.split(":", 1)[0] for f in functions if ":" in f}
    return next((role for file, role in ROLES if file in files), "other")


def measure(port: int) -> list[dict[int, set[str]]]:
    """The three windows: the request, idle, the request again."""
    from workers.ray_utils import free_port

    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="lspath") as tmp:
        out = Path(tmp)
        proc = _serve(out, port)
        try:
            for _ in range(5):
                _chat(port)
            return [_window(out, port), _window(out, None), _window(out, port)]
        finally:
            _stop(proc)


def analyse(first: dict[int, set[str]], idle: dict[int, set[str]], second: dict[int, set[str]]) -> dict:
    # the request's: run in both request windows and not in the idle one (a background timer firing in one
    # window, e.g. the registry's check for a deleted app, is not the request's)
    requested = set().union(*first.values()) & set().union(*second.values())
    requested -= set().union(*idle.values())
    seen: dict[str, tuple[set, set]] = {}   # file -> (processes, functions)
    calls: set[tuple[tuple[str, str], tuple[str, str]]] = set()
    for pid in first.keys() | second.keys():
        ran = first.get(pid, set()) | second.get(pid, set())
        role = _role(ran)
        calls |= {tuple(_node(role, f) for f in call.split(" -> ")) for call in ran if " -> " in call}
        for function in ran & requested:
            if " -> " not in function:
                name, qualname = function.split(":", 1)
                processes, functions = seen.setdefault(name, (set(), set()))
                processes.add(role)
                functions.add(qualname)
    files = {name: {"lines": len((ROOT / name).read_text().splitlines()), "processes": sorted(processes),
                    "functions": sorted(functions)} for name, (processes, functions) in sorted(seen.items())}
    for name, f in files.items():   # which files (or carriers) called it: a helper is named with its callers
        f["called_by"] = sorted({a[1].split(":", 1)[0] for a, b in calls if _file(b)[1] == name and b[0]
                                 and (not a[0] or _file(a)[1] in files) and _file(a)[1] != name})
    hops, chains = _path(calls, {(role, name) for name, f in files.items() for role in f["processes"]})
    path = list(dict.fromkeys(name for _, name in hops if not name.startswith("<")))
    return {"files": files, "num_files": len(files), "num_lines": sum(f["lines"] for f in files.values()),
            "path": path, "num_path_files": len(path), "num_path_lines": sum(files[n]["lines"] for n in path),
            "hops": hops, "chains": chains}


def _node(role: str, label: str) -> tuple[str, str]:
    """A function of one process; a carrier ("<serve>", "<pipe>", "<asgi>") is one node joining the processes."""
    return ("", label) if label.startswith("<") else (role, label)


def _path(calls: set, requested: set) -> tuple[list[tuple[str, str]], list[list[tuple[str, str]]]]:
    """The stages joined by chains of calls the request windows made, through functions of files the request
    ran and the carriers: each stage to the next by the chain entering the fewest files not yet on the path
    (then the fewest calls). A value passes from a caller to its callee and back, so a chain may go either
    way, but never down into a function and up out of it to another caller: two callers of one helper
    (`native.call` runs every C kernel) pass nothing to each other. The files in the order first reached, and
    each stage's chain of functions."""
    down: dict[tuple, set] = {}
    for a, b in calls:
        if all(n[0] == "" or _file(n) in requested for n in (a, b)):
            down.setdefault(a, set()).add(b)
    up: dict[tuple, set] = {}
    for a, callees in down.items():
        for b in callees:
            up.setdefault(b, set()).add(a)
    path: list[tuple[str, str]] = [STAGES[0]]
    chains = []
    for start, goal in zip(STAGES, STAGES[1:]):
        chains.append(_chain(down, up, start, goal, set(path)))
        path += [f for f in dict.fromkeys(map(_file, chains[-1])) if f not in path]
    return path, chains


def _file(node: tuple[str, str]) -> tuple[str, str]:
    return node[0], node[1].split(":", 1)[0]


def _chain(down: dict, up: dict, start: tuple[str, str], goal: tuple[str, str], on_path: set) -> list:
    """The functions from one of the file `start` to one of `goal`, cheapest first (Dijkstra) over states
    (function, came down from its caller); a call costs (1 if it enters a file not on the path, 1)."""
    firsts = [(n, False) for n in down.keys() | up.keys() if _file(n) == start]
    best = {state: (0, 0) for state in firsts}
    previous = {state: None for state in firsts}
    queue = [((0, 0), state) for state in firsts]
    heapq.heapify(queue)
    while queue:
        cost, state = heapq.heappop(queue)
        if cost > best[state]:
            continue
        node, went_down = state
        if _file(node) == goal:
            chain = []
            while state is not None:
                chain.append(state[0])
                state = previous[state]
            return chain[::-1]
        steps = [(n, True) for n in down.get(node, ())]
        if node[0] == "" or not went_down:   # a carrier passes the request on whichever way it came
            steps += [(n, False) for n in up.get(node, ())]
        for step in steps:
            new_file = step[0][0] != "" and _file(step[0]) != _file(node) and _file(step[0]) not in on_path
            step_cost = (cost[0] + new_file, cost[1] + 1)
            if step_cost < best.get(step, (1 << 30, 0)):
                best[step], previous[step] = step_cost, state
                heapq.heappush(queue, (step_cost, step))
    raise RuntimeError(f"no measured chain of calls from {start} to {goal}")


def markdown(result: dict) -> str:
    hops = " -> ".join(f"`{name}`" if name.startswith("<") else f"`{name}` ({role})" for role, name in
                       (h for i, h in enumerate(result["hops"]) if h not in result["hops"][:i]))
    rows = [f"| `{name}` | {'**path**' if name in result['path'] else ''} | {f['lines']} | "
            f"{', '.join(f['processes'])} | {', '.join(f'`{c}`' for c in f['called_by'])} | "
            f"{len(f['functions'])}: {', '.join(f['functions'][:6])}{' ...' if len(f['functions']) > 6 else ''} |"
            for name, f in result["files"].items()]
    return "\n".join([
        "# One streamed chat request's files, measured", "",
        f"`{result['command']}` on {result['machine']['processor']}, {result['date']}: `loraserve serve --demo` "
        "(TP 1, CPU, engine process), `POST /v1/chat/completions` with `stream: true` for an adapter, 8 tokens.",
        "A file counts when the request ran a function of it in both request windows that an idle window of the "
        "same length did not. The path joins the stages (the route, the body's model, the router, the replica, "
        "the tokenizer, the engine request, the core, its scheduler, the LoRA kernel, the sampler, the captured "
        "decode, the detokenizer, the renderer, the route) by the measured chains of calls that enter the fewest "
        "other files; the other files are helpers that the path's files call.", "",
        f"**The path: {result['num_path_files']} Python files, {result['num_path_lines']} lines; with the helpers "
        f"they call: {result['num_files']} files, {result['num_lines']} lines** (C kernels not counted).", "",
        f"The path in the order first reached: {hops}.", "",
        "| file | | lines | process | called by | functions the request ran |", "|---|---|---|---|---|---|",
        *rows, ""])


def main(argv=None) -> dict:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    parser.add_argument("--windows", type=Path, help="also write the measured windows to this JSON file")
    parser.add_argument("--from-windows", type=Path, help="analyse windows written before instead of measuring")
    args = parser.parse_args(argv)
    if args.from_windows:
        windows = [{int(pid): set(ran) for pid, ran in w.items()} for w in json.loads(args.from_windows.read_text())]
    else:
        windows = measure(args.port)
    if args.windows:
        args.windows.write_text(json.dumps([{pid: sorted(ran) for pid, ran in w.items()} for w in windows]))
    result = analyse(*windows)
    result.update(command="python -m benchmarks.request_path", date=time.strftime("%Y-%m-%d %H:%M UTC",
                  time.gmtime()), machine=machine_info())
    print(write_result("request_path", result))
    (RESULTS / "request_path.md").write_text(markdown(result))
    print(f"path {result['num_path_files']} files; all {result['num_files']} files, {result['num_lines']} lines")
    return result


if __name__ == "__main__":
    main()
