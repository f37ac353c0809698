#!/usr/bin/env bash
# The CUDA check, ready to run unattended on a machine with an NVIDIA GPU (never part of CI):
#   1. a scratch venv with a CUDA build of the pinned torch and the project's other pins;
#   2. tests/test_capture.py's CUDA tests (graph capture replays exactly, the LoRA ops inside a
#      captured graph);
#   3. LoRA on the device (lora_device): a tiny random Qwen3 and the six PEFT adapters of the LoRA tests,
#      built here, loaded into an fp32 CUDA engine; a batch mixing every adapter and the base decoded
#      through captured graphs, token for token the CPU engine's (fp32, eager);
#   3b. Qwen3-MoE on the device (moe_device): a tiny random Qwen3-MoE and four adapters (attention, experts
#      in both formats, dense MLP) through captured graphs, plus choice / regex constrained requests,
#      token for token the CPU engine's;
#   4. the graph-safe LoRA op tests;
#   5. one throughput run on CUDA (base, 1 adapter, 8 adapters; bf16, the benchmark checkpoint).
# It prints each step's result and a summary, and exits non-zero if a step failed. Nothing needs the
# network but the package index (for the venv of step 1).
#
#   bash benchmarks/gpu_check.sh                 # from the checkout's root, or from anywhere
#   TORCH_CUDA_INDEX_URL=<index> bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --dry-run       # no GPU: steps 3 and 3b on the CPU (capture emulated),
#                                                # with the checkout's .venv (or $PYTHON)
#
# TORCH_CUDA_INDEX_URL: the package index holding the CUDA build of torch (passed to pip as
# --index-url for torch alone); unset, pip's own configured index, whose Linux torch wheels are
# CUDA builds. GPU_CHECK_DIR: the scratch directory (default .cache/gpu_check in the checkout;
# the venv there is reused when its torch already is the pinned CUDA build).
# GPU_CHECK_BUDGET_S (default 470): the whole run's cap; each step has its own timeout within
# it, and a step the budget no longer covers is reported as not run. On a fresh box with only
# the package index reachable most of the time is the download of the CUDA wheels (several GB).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRATCH="${GPU_CHECK_DIR:-$ROOT/.cache/gpu_check}"
VENV="$SCRATCH/venv"
PY="$VENV/bin/python"
LOG="$SCRATCH/logs"
TORCH_PIN="torch==2.13.0"
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"   # the whole run's wall-clock cap: later steps get what is left
START=$SECONDS
declare -a SUMMARY=()
FAILED=0

say() { printf '[gpu_check %4ds] %s\n' "$((SECONDS - START))" "$*"; }
record() {   # record NAME STATUS
    SUMMARY+=("$(printf '%-28s %s' "$1" "$2")")
    [[ "$2" == ok* ]] || FAILED=1
}
step() {     # step NAME TIMEOUT_S COMMAND...: run with a timeout, log to $LOG/NAME.log, show its tail
    local name="$1" limit="$2" status left
    shift 2
    left=$((BUDGET_S - (SECONDS - START)))
    if ((left < 10)); then record "$name" "NOT RUN: the ${BUDGET_S}s budget is spent"; return 1; fi
    ((limit > left)) && limit=$left
    say "$name (timeout ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$LOG/$name.log" 2>&1
    status=$?
    tail -n 15 "$LOG/$name.log" | sed 's/^/    /'
    if [[ $status -eq 0 ]]; then record "$name" "ok"; elif [[ $status -eq 124 ]]; then
        record "$name" "TIMED OUT after ${limit}s"; else record "$name" "FAILED (exit $status)"; fi
    return $status
}
finish() {
    say "summary ($((SECONDS - START)) s in all; logs in $LOG)"
    printf '    %s\n' "${SUMMARY[@]}"
    exit "$FAILED"
}

# Step 3's program (argument --device cuda | cpu), run from the checkout's root.
LORA_CHECK=$(cat <<'EOF'
"""LoRA on the device: a tiny random Qwen3 and the six PEFT adapters of the LoRA tests (tests/lora_fixtures.py:
ranks 4-64, attention, MLP, embedding and LM head, rslora, rank/alpha patterns), built here (no network),
loaded into an fp32 engine on --device; one mixed batch (every prompt with the base and with each adapter)
decoded greedily through captured graphs, token for token the CPU engine's (fp32, eager decode).
--device cpu: the same check with the CPU capture emulation as the "device" (a dry run of this script)."""
import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "tests"))
import torch  # noqa: E402

from factories import PROMPTS, make_model  # noqa: E402
from lora_fixtures import build_adapters  # noqa: E402
from workers import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
args = parser.parse_args()
torch.set_float32_matmul_precision("highest")   # fp32 GEMMs, no TF32: the CPU engine's maths

with tempfile.TemporaryDirectory(prefix="gpu-check-lora-") as tmp:
    started = time.perf_counter()
    model = make_model(Path(tmp) / "model", "qwen3")
    adapters = build_adapters(model, Path(tmp) / "adapters")
    names = [None, *adapters]
    prompts = [p for p in PROMPTS[:4] for _ in names]
    wanted = [n for _ in PROMPTS[:4] for n in names]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(model=str(model), dtype="float32", max_lora_rank=64, max_loras_per_batch=len(adapters),
                  max_loaded_loras=len(adapters), max_num_seqs=32, max_model_len=256)

    def engine(**kw):
        e = LLMEngine(EngineConfig(**common, **kw))
        for name, path in adapters.items():
            e.load_adapter(name, str(path))
        return e

    device = engine(device=args.device, **({"emulate_capture": True} if args.device == "cpu" else {}))
    got = device.generate(prompts, params, adapters=wanted)
    runner = device.executor
    graphs = sorted(runner.graph_runner.graphs)
    want = engine(device="cpu", enforce_eager=True).generate(prompts, params, adapters=wanted)
    print(f"{args.device}: {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'CPU (capture emulated)'}; "
          f"{len(prompts)} requests ({len(adapters)} adapters and the base, mixed), 16 tokens each, fp32; "
          f"{time.perf_counter() - started:.1f} s")
    print(f"  captured (batch, width) graphs: {graphs}; LoRA backend: {runner.lora_backend.stats()}")
    mismatched = [i for i, (a, b) in enumerate(zip(got, want)) if a.token_ids != b.token_ids]
    drift = max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a.logprobs, b.logprobs))
    print(f"  token-identical to the CPU engine: {len(prompts) - len(mismatched)}/{len(prompts)}; "
          f"max |logprob difference| {drift:.2e}")
    for i in mismatched:
        print(f"  MISMATCH request {i} (adapter {wanted[i]}): {got[i].token_ids} != {want[i].token_ids}")
    distinct = {p: len({tuple(o.token_ids) for o, q in zip(want, prompts) if q == p}) for p in PROMPTS[:4]}
    print(f"  distinct outputs per prompt over base + adapters: {list(distinct.values())}")
    assert graphs, "no graph was captured: decode ran eagerly"
    assert min(distinct.values()) > 1, "the adapters do not change the output: LoRA was not applied"
    assert not mismatched, f"{len(mismatched)} requests differ from the CPU engine"
    print("ok")
EOF
)

# Step 3b's program (argument --device cuda | cpu), run from the checkout's root.
MOE_CHECK=$(cat <<'EOF'
"""Qwen3-MoE, expert LoRA and grammar-constrained decoding on the device: a tiny random Qwen3-MoE (sparse and
dense layers) and four adapters (attention; PEFT target_parameters experts; per-expert 2-D; dense-layer MLP),
built here; one mixed batch decoded greedily through captured graphs (the experts' fixed-shape path), plus
choice / regex constrained requests (the token bitmask copied to the device and applied there), token for
token the CPU engine's (fp32, eager). --device cpu: the same with the CPU capture emulation (a dry run)."""
import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "tests"))
import torch  # noqa: E402

from factories import PROMPTS, make_adapter  # noqa: E402
from moe_factories import (make_expert_adapter, make_moe_model, write_dense_mlp_adapter,  # noqa: E402
                           write_per_expert_adapter)
from workers import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from workers.grammar import StructuredSpec  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
args = parser.parse_args()
torch.set_float32_matmul_precision("highest")

with tempfile.TemporaryDirectory(prefix="gpu-check-moe-") as tmp:
    started, out = time.perf_counter(), Path(tmp)
    model = make_moe_model(out / "model")
    adapters = {
        "attn": make_adapter(model, out / "attn", r=8, alpha=16, target_modules=["q_proj", "v_proj"], seed=1),
        "experts": make_expert_adapter(model, out / "experts", r=4, alpha=8, target_modules=["q_proj"], seed=2),
        "per_expert": write_per_expert_adapter(model, out / "per_expert", r=8, alpha=16, seed=3)[0],
        "dense_mlp": write_dense_mlp_adapter(model, out / "dense_mlp", layers=(1,), r=8, alpha=16, seed=4),
    }
    names = [None, *adapters]
    prompts = [p for p in PROMPTS[:4] for _ in names]
    wanted = [n for _ in PROMPTS[:4] for n in names]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    choice = StructuredSpec("choice", json.dumps(["yes", "no", "maybe"]))
    regex = StructuredSpec("regex", r"[a-c]{2,4}-[0-9]{2}")
    constrained = [SamplingParams(max_tokens=16, temperature=0.0, structured=spec) for spec in (choice, regex)]

    def engine(**kw):
        e = LLMEngine(EngineConfig(model=str(model), dtype="float32", max_lora_rank=16, max_loras_per_batch=4,
                                   max_num_seqs=32, max_model_len=256, **kw))
        for name, path in adapters.items():
            e.load_adapter(name, str(path))
        return e

    def run(e):
        mixed = e.generate(prompts, greedy, adapters=wanted)
        grammar = e.generate([PROMPTS[0]] * 4, constrained * 2, adapters=[None, None, "experts", "experts"])
        return mixed, grammar

    device = engine(device=args.device, **({"emulate_capture": True} if args.device == "cpu" else {}))
    got, got_grammar = run(device)
    graphs = sorted(device.executor.graph_runner.graphs)
    want, want_grammar = run(engine(device="cpu", enforce_eager=True))
    print(f"{args.device}: {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'CPU (capture emulated)'}; "
          f"Qwen3-MoE, {len(prompts)} mixed requests (4 adapters and the base) + 4 constrained, fp32; "
          f"{time.perf_counter() - started:.1f} s; captured (batch, width) graphs: {graphs}")
    mismatched = [i for i, (a, b) in enumerate(zip(got, want)) if a.token_ids != b.token_ids]
    drift = max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a.logprobs, b.logprobs))
    print(f"  token-identical to the CPU engine: {len(prompts) - len(mismatched)}/{len(prompts)}; "
          f"max |logprob difference| {drift:.2e}")
    print(f"  constrained (choice, regex; base, experts): {[(o.text, o.finish_reason) for o in got_grammar]}")
    assert graphs, "no graph was captured: decode ran eagerly"
    assert not mismatched, f"requests {mismatched} differ from the CPU engine"
    assert [o.token_ids for o in got_grammar] == [o.token_ids for o in want_grammar], "constrained outputs differ"
    for o, pattern in zip(got_grammar, ["yes|no|maybe", r"[a-c]{2,4}-[0-9]{2}"] * 2):
        assert o.finish_reason == "length" or re.fullmatch(pattern, o.text), (o.text, pattern)
    print("ok")
EOF
)

mkdir -p "$LOG"
cd "$ROOT" || exit 1
if [[ "${1:-}" == "--dry-run" ]]; then
    PY="${PYTHON:-$ROOT/.venv/bin/python}"
    export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
    step lora_device 300 "$PY" -c "$LORA_CHECK" --device cpu
    step moe_device 300 "$PY" -c "$MOE_CHECK" --device cpu
    finish
elif [[ -n "${1:-}" ]]; then
    say "unknown argument $1 (the only one is --dry-run)"
    exit 2
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    say "no NVIDIA GPU visible (nvidia-smi -L failed): this check needs one"
    exit 2
fi
nvidia-smi -L | sed 's/^/    /'

# The project's pins come from the Makefile (one list); torch is installed on its own, CUDA build.
PINS=()
while read -r pin; do [[ -n "$pin" && "$pin" != torch==* ]] && PINS+=("$pin"); done < <(
    sed -n '/^PINS :=/,/[^\\]$/p' Makefile | sed 's/^PINS :=//; s/\\$//' | tr ' ' '\n')
if [[ ${#PINS[@]} -lt 5 ]]; then
    say "could not read PINS from the Makefile (got: ${PINS[*]:-nothing})"
    exit 1
fi

have_cuda_torch() {
    [[ -x "$PY" ]] && "$PY" - <<'EOF' >/dev/null 2>&1
import torch
assert torch.__version__.split("+")[0] == "2.13.0" and torch.version.cuda and torch.cuda.is_available()
EOF
}

if have_cuda_torch; then
    say "reusing $VENV (torch 2.13.0 with CUDA)"
    record "venv" "ok (reused)"
else
    PIP=("$PY" -m pip install --quiet --disable-pip-version-check --no-input)
    INDEX=()
    [[ -n "${TORCH_CUDA_INDEX_URL:-}" ]] && INDEX=(--index-url "$TORCH_CUDA_INDEX_URL")
    step venv 60 python3 -m venv "$VENV" || finish
    step torch_cuda 360 "${PIP[@]}" "${INDEX[@]}" "$TORCH_PIN" || finish
    # The other pins, torch among them so that pip keeps the CUDA build it already has.
    step pins 240 "${PIP[@]}" "${PINS[@]}" "$TORCH_PIN" || finish
    step project 60 "${PIP[@]}" --no-deps -e . || finish
    have_cuda_torch || { record "torch with CUDA" "FAILED: torch.cuda.is_available() is False"; finish; }
fi
"$PY" -c "import torch; print('    torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false LORASERVE_BENCH_CACHE="$SCRATCH/bench"
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
export TORCHINDUCTOR_CACHE_DIR="$ROOT/.cache/inductor" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled

# The CUDA tests: graph capture replays the engine exactly, and the LoRA ops inside a captured graph.
step cuda_tests 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_capture.py -k cuda -rs
if grep -q "skipped" "$LOG/cuda_tests.log"; then   # torch saw no GPU: the step's "ok" means nothing
    SUMMARY[${#SUMMARY[@]} - 1]="$(printf '%-28s %s' cuda_tests "FAILED: the CUDA tests were skipped")"
    FAILED=1
fi
# LoRA on the device: adapters loaded, a mixed-adapter batch through captured graphs = the CPU engine's tokens.
step lora_device 180 "$PY" -c "$LORA_CHECK" --device cuda
# Qwen3-MoE with expert LoRA and grammar-constrained requests on the device: the same comparison.
step moe_device 150 "$PY" -c "$MOE_CHECK" --device cuda
# The graph-safe LoRA ops (FakeTensor, torch.compile); those of the CPU kernel need a C compiler.
GRAPH_TESTS="graph or fake or compile"
command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || GRAPH_TESTS="(graph or fake or compile) and torch_masked"
step lora_graph_ops 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_lora_ops.py -k "$GRAPH_TESTS"

step throughput 240 "$PY" - <<'EOF'
"""base / 1 adapter / 8 adapters on CUDA, bf16, the benchmark checkpoint; 2 interleaved rounds."""
import statistics

import torch

from benchmarks.checkpoint import ALL7, build_adapters, build_checkpoint
from benchmarks.common import FULL, make_prompts, run_requests
from benchmarks.throughput import adapter_name, workload_adapters
from workers import EngineConfig, LLMEngine

sizes = FULL
model = build_checkpoint("bfloat16", sizes.shape)
paths = build_adapters(8, sizes.shape, sizes.rank)
engine = LLMEngine(EngineConfig(
    model=str(model), dtype="bfloat16", device="cuda", max_num_seqs=sizes.batch,
    max_model_len=sizes.prompt_len + sizes.max_tokens + 16, max_loras_per_batch=sizes.max_loras_per_batch,
    max_loaded_loras=sizes.max_loaded_loras, max_lora_rank=sizes.rank, kv_cache_memory_gb=2.0,
    lora_target_modules=ALL7))
assert engine.executor.graph_runner.graphs, "no CUDA graph was captured"
for i in range(8):
    engine.load_adapter(adapter_name(i), str(paths[i]))
prompts = make_prompts(sizes)
workloads = ("base", "one", "eight")
run_requests(engine, prompts, workload_adapters("eight", sizes), sizes.max_tokens)   # warm-up
results = {w: [] for w in workloads}
for _ in range(2):
    for w in workloads:
        torch.cuda.synchronize()
        results[w].append(run_requests(engine, prompts, workload_adapters(w, sizes), sizes.max_tokens))
print(f"{torch.cuda.get_device_name(0)}: {sizes.num_requests} requests x {sizes.max_tokens} tokens, "
      f"batch {sizes.batch}, rank {sizes.rank}, bf16, CUDA graphs")
base = statistics.median(t.output_tok_s for t in results["base"])
for w in workloads:
    out = statistics.median(t.output_tok_s for t in results[w])
    decode = statistics.median(t.decode_tok_s for t in results[w])
    print(f"  {w:>5}: {out:8.1f} out tok/s  {decode:8.1f} decode tok/s  {out / base:5.2f} of base")
EOF

finish
