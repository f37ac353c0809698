"""The engine in a process of its own (workers/engine_process.py): what only that kind has. The contract both
kinds share (streams equal the sync engine, leaving early, aborts, errors, adapter loads) is
tests/test_async_engine.py, run on each."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from factories import PROMPTS, make_adapter
from lora.errors import AdapterError
from processes import REPO, engine_processes
from transformers import AutoTokenizer
from workers import EngineConfig, SamplingParams
from workers.engine_process import ProcessCoreClient, start_engine
from workers.errors import EngineDeadError
from workers.grammar import StructuredSpec

pytestmark = pytest.mark.slow   # make test-fast skips it: each test starts an engine process (seconds of a core)

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


def config(model, **kw) -> EngineConfig:
    return EngineConfig(model=str(model), device="cpu", max_model_len=256, **kw)


def gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


async def drain(stream):
    try:
        async for _ in stream:
            pass
    except BaseException as exc:  # noqa: BLE001
        return exc


def test_a_killed_engine_process_fails_every_stream_and_call_and_reads_unhealthy(model):
    engine = start_engine(config(model), {})
    try:
        assert engine.is_healthy() and asyncio.run(engine.check_health())

        async def main():
            streams = [engine.generate(p, LONG) for p in PROMPTS[:3]]
            for stream in streams:
                await anext(stream)
            os.kill(engine.client.pid, signal.SIGKILL)   # what the OOM killer or a device fault does
            errors = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 60)
            with pytest.raises(EngineDeadError, match="exit code -9"):
                await engine.stats()
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate("Hello", GREEDY):
                    pass
            return errors

        errors = asyncio.run(main())
        assert {type(e) for e in errors} == {EngineDeadError}
        assert not engine.is_healthy() and not asyncio.run(engine.check_health())
    finally:
        engine.close()


def test_close_ends_the_engine_process_and_pending_streams(model, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    engine = start_engine(config(model), {})
    # started with glibc's malloc on transparent huge pages (engine_process.MALLOC_TUNABLES)
    with open(f"/proc/{engine.client.pid}/environ", "rb") as f:
        assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in f.read().split(b"\0")

    async def main():
        stream = engine.generate("Hello", LONG)
        await anext(stream)
        await asyncio.to_thread(engine.close)
        return await asyncio.wait_for(drain(stream), 30)

    assert isinstance(asyncio.run(main()), EngineDeadError)
    assert gone(engine.client.pid) and not engine.is_healthy()


def test_a_bad_configured_adapter_fails_the_start_with_its_reason_and_leaves_no_process(model, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    before = set(engine_processes(os.getpid()))
    with pytest.raises(AdapterError, match="adapter 'bad'"):
        start_engine(config(model), {"bad": str(empty)})
    assert set(engine_processes(os.getpid())) <= before


def test_configured_adapters_are_loaded_before_it_is_ready_and_an_invalid_grammar_raises(model, tmp_path):
    adapter = make_adapter(model, tmp_path / "a", r=8, seed=3)
    engine = start_engine(config(model), {"a": str(adapter)})
    try:
        assert asyncio.run(engine.list_adapters()) == {"a": str(adapter)}
        with pytest.raises(ValueError):
            asyncio.run(engine.check_grammar(StructuredSpec("json_schema", '{"type": "nonsense"}')))
        asyncio.run(engine.check_grammar(StructuredSpec("json_schema", '{"type": "integer"}')))
    finally:
        engine.close()


def test_only_an_engine_of_the_callers_process_runs_in_one():
    assert EngineConfig(model="m").runs_in_process and EngineConfig(model="m", distributed_executor="inproc").runs_in_process
    assert not EngineConfig(model="m", tensor_parallel_size=2).runs_in_process
    assert not EngineConfig(model="m", distributed_executor="ray").runs_in_process
    with pytest.raises(ValueError, match="needs one process per rank"):   # one rule: refused where it is read
        EngineConfig(model="m", tensor_parallel_size=2, distributed_executor="inproc")
    with pytest.raises(ValueError, match="not the ranks of a Ray executor"):
        ProcessCoreClient(EngineConfig(model="m", tensor_parallel_size=2))


def test_the_callers_side_loads_no_engine_and_no_torch(model):
    """The replica keeps tokenizers and streams; the model, its kernels, the KV cache and torch are the child's
    (torch is ~1.5 s of a core and ~200 MB per replica start): a whole request, chat template included, is served
    without them, by the tokenizer class the child's AutoTokenizer chose."""
    probe = f"""
import asyncio, sys
from workers import EngineConfig, SamplingParams
from workers.engine_process import start_engine

async def serve(engine):
    prompt = await engine.render_chat([{{"role": "user", "content": "Hi"}}])
    async for out in engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)):
        pass
    return out

e = start_engine(EngineConfig(model={str(model)!r}, device="cpu", max_model_len=256), {{}})
out = asyncio.run(serve(e))
print(len(out.token_ids), type(e.decode_tokenizer).__name__, "torch" in sys.modules)
print(sorted(m for m in sys.modules if m.startswith(("workers.engine", "workers.model", "lora.backends"))))
e.close()
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    *_, served, modules = out.stdout.strip().splitlines()
    assert modules == "['workers.engine_process']", out.stdout
    assert served == f"4 {type(AutoTokenizer.from_pretrained(model)).__name__} False", out.stdout


def test_the_cli_and_a_replicas_config_default_to_an_engine_process():
    from deployments.cli import config_from_args, parse_args
    from deployments.config import LLMConfig

    assert LLMConfig().engine_process and config_from_args(parse_args(["serve", "--demo"])).engine_process
    assert not config_from_args(parse_args(["serve", "--demo", "--no-engine-process"])).engine_process
