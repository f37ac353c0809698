"""`make clients`: the tools vLLM's users point at an OpenAI-compatible server, run against the demo server.

    .venv/bin/python -m benchmarks.clients.run [--record benchmarks/results/clients.md]

Installs the clients, pinned, into a venv of their own (.cache/clients-venv, git-ignored; built once, again
when the pins change), starts `loraserve serve --demo` on a free loopback port, and runs, each bounded in
time and in requests: guidellm (a constant-rate run: TTFT / ITL), lm-eval on the offline tasks in tasks/
(multiple choice and generation over completions, generation over chat completions), LangChain
(langchain_check.py) and the OpenAI Agents SDK (agents_check.py). Prints one table row per check and exits
1 if any failed. Every request goes to 127.0.0.1; Hugging Face libraries run offline; the Agents SDK's and
LangChain's tracing is off. The demo model is random, so metric values are nonsense: a row checks the protocol.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.procfs import process_tree, running
from deployments.demo_model import default_cache_dir
from workers.ray_utils import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VENV = ROOT / ".cache" / "clients-venv"
RUN_DIR = ROOT / ".cache" / "clients-run"        # logs and the clients' outputs of the last run
TOKENIZER = default_cache_dir() / "demo" / "model"   # the demo's BPE tokenizer, made by the server's start
# torch is guidellm's dependency: pinned in the same install, or pip pulls a multi-GB CUDA build.
PINS = ("torch==2.13.0", "guidellm==0.8.1", "lm-eval==0.4.13", "openai-agents==0.24.0", "langchain-openai==1.7.4",
        "langchain-core==1.8.1", "openai==3.63.0", "transformers==5.25.0", "datasets==5.2.0")
# The demo model's vocabulary is 477 tokens, so an agent's prompt with a tool schema is ~850 tokens and its
# turn after the tool call passes the demo's default 1024 (rotary positions have no hard limit).
MAX_MODEL_LEN = 2048
GUIDELLM_REQUESTS = 20
STOP_GRACE_S = 20   # the CLI stops within its SHUTDOWN_GRACE_S (8 s) after SIGTERM


def ensure_venv() -> Path:
    """The clients' python, installing the pins first where the venv is missing or was made with others."""
    marker, pins = VENV / ".installed", " ".join(PINS)
    if not (marker.is_file() and marker.read_text() == pins):
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", *PINS], check=True)
        marker.write_text(pins)
    return VENV / "bin" / "python"


def client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "HF_", "LANGCHAIN_", "LANGSMITH_"))}
    return {**env, "HF_HOME": str(RUN_DIR / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "OPENAI_AGENTS_DISABLE_TRACING": "1", "LANGCHAIN_TRACING_V2": "false",
            "LANGSMITH_TRACING": "false", "OPENAI_API_KEY": "unused", "no_proxy": "127.0.0.1", "NO_PROXY": "127.0.0.1",
            # guidellm's default, 10 worker processes that each import torch, took 70 s to start on 2 busy cores.
            "GUIDELLM__MAX_WORKER_PROCESSES": "2"}


def start_server(port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "deployments.cli", "serve", "--demo", "--port", str(port),
               "--max-model-len", str(MAX_MODEL_LEN)]
    return subprocess.Popen(command, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(server: subprocess.Popen, url: str, timeout: float = 300) -> list[str]:
    """The served model ids, once the demo's adapters are listed; fails if the server exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as answer:
                models = [m["id"] for m in json.load(answer)["data"]]
            if {"demo-a", "demo-b"} <= set(models):
                return models
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the demo server did not come up (see {RUN_DIR / 'server.log'})")
        time.sleep(1)


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM (the CLI stops its Ray and removes its temp dir), then whatever of its tree still runs is killed."""
    tree = process_tree(server.pid)
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for pid in tree:
        if running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    server.wait(10)


def run_client(name: str, command: list[str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Runs one client, its output kept in RUN_DIR/<name>.log; past `timeout` its whole process group (guidellm's
    workers too) is killed and exit status 124 returned."""
    client = subprocess.Popen(command, cwd=cwd, env=client_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        stdout, stderr = client.communicate(timeout=timeout)
        returncode = client.returncode
    except subprocess.TimeoutExpired:
        os.killpg(client.pid, signal.SIGKILL)
        stdout, stderr = client.communicate()
        returncode, stderr = 124, f"{stderr}\ntimed out after {timeout:.0f} s"
    (RUN_DIR / f"{name}.log").write_text(f"$ {' '.join(command)}\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


def last_error(done: subprocess.CompletedProcess, name: str) -> str:
    """The last error line of a client's output and the two after it (a CLI's usage error or an exception's cause)."""
    lines = [line.strip() for line in f"{done.stderr}\n{done.stdout}".splitlines() if line.strip()] or [""]
    last = max((i for i, line in enumerate(lines) if "error" in line.lower()), default=len(lines) - 1)
    return f"exit {done.returncode}: {' '.join(lines[last:last + 3])[:300]} (.cache/clients-run/{name}.log)"


def guidellm(python: Path, url: str) -> list[dict]:
    out = RUN_DIR / "guidellm.json"
    done = run_client("guidellm", [
        str(python.parent / "guidellm"), "run", "--backend", f"kind=openai_http,target={url},model=loraserve-demo",
        "--tokenizer", f"kind=huggingface_auto,model={TOKENIZER}", "--profile", "kind=constant,rate=2",
        "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
        "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}", "--constraint", "kind=max_duration,seconds=90",
        "--output", f"kind=json,path={out}", "--disable-console-interactive"], timeout=180)
    name = "guidellm 0.8.1, constant 2/s, 64 in / 32 out"
    if done.returncode != 0 or not out.is_file():
        return [{"check": name, "ok": False, "detail": last_error(done, "guidellm")}]
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    metrics, totals = benchmark["metrics"], benchmark["metrics"]["request_totals"]
    p50 = lambda key: metrics[key]["successful"]["percentiles"]["p50"]  # noqa: E731
    detail = (f"{totals['successful']} of {totals['total']} ok, {totals['errored']} errors; "
              f"TTFT p50 {p50('time_to_first_token_ms'):.1f} ms, ITL p50 {p50('inter_token_latency_ms'):.1f} ms")
    if totals["errored"]:
        detail += f"; first error: {benchmark['requests']['errored'][0]['info']['error'][:200]}"
    return [{"check": name, "ok": totals["successful"] == GUIDELLM_REQUESTS and not totals["errored"],
             "detail": detail}]


def lm_eval(python: Path, url: str) -> list[dict]:
    mc_requests = sum(len(json.loads(line)["choices"]) for line in (HERE / "tasks" / "mc.jsonl").open())
    gen_requests = sum(1 for _ in (HERE / "tasks" / "gen.jsonl").open())
    runs = {   # name: (model, model_args, tasks, requests)
        "lm-eval 0.4.13, completions: multiple choice + generation": (
            "local-completions", f"base_url={url}/v1/completions,model=loraserve-demo,tokenizer={TOKENIZER},"
            "tokenizer_backend=huggingface", ["loraserve_mc", "loraserve_gen"],
            f"{mc_requests} log-likelihood + {gen_requests} generation requests"),
        "lm-eval 0.4.13, chat completions (adapter demo-b): generation": (
            "local-chat-completions", f"base_url={url}/v1/chat/completions,model=demo-b", ["loraserve_gen"],
            f"{gen_requests} generation requests"),
    }
    rows = []
    for i, (name, (model, model_args, tasks, requests)) in enumerate(runs.items()):
        out = RUN_DIR / f"lm_eval_{i}"
        command = [str(python.parent / "lm_eval"), "run", "--model", model,
                   "--model_args", f"{model_args},num_concurrent=4,max_retries=1", "--tasks", *tasks,
                   "--include_path", str(HERE / "tasks"), "--output_path", str(out)]
        if model == "local-chat-completions":
            command.append("--apply_chat_template")
        # The tasks' data_files are relative to the task folder.
        done = run_client(f"lm_eval_{i}", command, timeout=180, cwd=HERE / "tasks")
        results = sorted(out.glob("*/results_*.json"))
        if done.returncode != 0 or not results:
            rows.append({"check": name, "ok": False, "detail": last_error(done, f"lm_eval_{i}")})
            continue
        scores = json.loads(results[-1].read_text())["results"]
        values = ", ".join(f"{metric.split(',')[0]} {value:.2f}" for task in tasks
                           for metric, value in scores[task].items() if metric.endswith(",none")
                           and "_stderr" not in metric)
        rows.append({"check": name, "ok": True, "detail": f"{values}; {requests}"})
    return rows


def python_check(python: Path, script: str, url: str, model: str) -> list[dict]:
    """A check script of this folder: its JSON rows, or one failing row with the reason it gave none."""
    done = run_client(script, [str(python), str(HERE / f"{script}.py"), "--base-url", f"{url}/v1",
                               "--model", model], timeout=240)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        rows.append({"check": script, "ok": False, "detail": last_error(done, script)})
    return rows


def table(rows: list[dict], seconds: dict[str, float]) -> str:
    lines = ["| check | result | numbers / reason | s |", "|---|---|---|---:|"]
    for row in rows:
        detail = row["detail"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {row['check']} | {'ok' if row['ok'] else 'FAIL'} | {detail} | {seconds[row['check']]:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, help="also write the table, with the commit and date, to this file")
    args = parser.parse_args(argv)
    started = time.monotonic()
    python = ensure_venv()
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, RUN_DIR / "server.log")
    rows, seconds = [], {}
    try:
        models = wait_ready(server, url)
        print(f"clients: the demo server at {url} serves {', '.join(models)}", flush=True)
        for check in (lambda: guidellm(python, url), lambda: lm_eval(python, url),
                      lambda: python_check(python, "langchain_check", url, "demo-a"),
                      lambda: python_check(python, "agents_check", url, "loraserve-demo")):
            begin = time.monotonic()
            got = check()
            for row in got:
                seconds[row["check"]] = (time.monotonic() - begin) / len(got)
                print(f"clients: {row['check']}: {'ok' if row['ok'] else 'FAIL'}: {row['detail']}", flush=True)
            rows += got
    finally:
        stop_server(server)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()   # -dirty: run on uncommitted changes
    report = (f"`make clients` at {commit}, {datetime.date.today()}, {time.monotonic() - started:.0f} s "
              f"(the demo server on CPU; per check, its share of its client's wall time):\n\n{table(rows, seconds)}\n")
    print("\n" + report)
    if args.record:
        # A section of benchmarks/RESULTS.md, which includes results/*.md.
        args.record.write_text(f"### Clients against the demo server (make clients)\n\n{report}")
    return 0 if rows and all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
