"""AsyncLLMEngine: streams equal the sync engine, leaving early aborts, errors reach the caller, nothing is dropped.

Each contract test runs on both kinds: the engine on a thread of the caller's process, and in a process of
its own (workers/engine_process.py, a replica's default)."""
import asyncio
import shutil
import time

import pytest

from factories import PROMPTS, make_adapter
from lora.errors import AdapterNotFoundError
from workers import EngineConfig, LLMEngine, SamplingParams
from workers.async_engine import AsyncLLMEngine, EngineDeadError, RequestError
from workers.engine_process import start_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    return make_adapter(model, tmp_path_factory.mktemp("lora") / "a", r=8, seed=3)


def config(model, **kw):
    return EngineConfig(model=str(model), device="cpu", max_model_len=256, **kw)


def start(kind: str, engine_config: EngineConfig) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(engine_config)) if kind == "thread" else start_engine(engine_config, {})


# the process kind is `slow` (make test-fast skips it): an engine process is seconds of a core to start
@pytest.fixture(scope="module", params=["thread", pytest.param("process", marks=pytest.mark.slow)])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def aengine(model, kind):
    """One engine of each kind for the module's tests: each leaves it as it found it (they check that all is
    released), and the next one would see what it left."""
    engine = start(kind, config(model))
    yield engine
    engine.close()


async def collect(aengine, prompt, params=GREEDY, adapter=None, request_id=None):
    outputs = [out async for out in aengine.generate(prompt, params, adapter, request_id)]
    assert outputs and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    return outputs[-1]


async def wait_released(aengine, timeout=10.0):
    """KV blocks all free and no adapter referenced (bounded wait: the abort runs on the step thread)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await aengine.stats()
        done = (stats["running"] == stats["waiting"] == 0 and stats["free_kv_blocks"] == stats["total_kv_blocks"]
                and stats["lora"]["host_cache"]["referenced"] == 0)
        if done or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


def test_concurrent_streams_equal_sync_generate(model, adapter, aengine):
    sync = LLMEngine(config(model))
    sync.load_adapter("a", str(adapter))
    adapters = [None, "a"] * (len(PROMPTS) // 2)
    expected = sync.generate(PROMPTS, GREEDY, adapters)

    async def main():
        await aengine.load_adapter("a", str(adapter))
        return await asyncio.gather(*(collect(aengine, p, GREEDY, a) for p, a in zip(PROMPTS, adapters)))

    got = asyncio.run(main())
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    assert all(o.finish_reason == "length" for o in got)


def test_leaving_mid_stream_releases_kv_and_adapter(adapter, aengine):
    async def main():
        await aengine.load_adapter("a", str(adapter))
        stream = aengine.generate("Hello", LONG, "a", request_id="leaver")
        first = [await anext(stream) for _ in range(3)]
        during = await aengine.stats()
        await stream.aclose()   # what a client disconnect does to the replica's generator
        return first, during, await wait_released(aengine)

    first, during, after = asyncio.run(main())
    assert not first[-1].finished and len(first[-1].token_ids) >= 3
    assert during["free_kv_blocks"] < during["total_kv_blocks"]
    assert during["lora"]["host_cache"]["referenced"] == 1
    assert after["free_kv_blocks"] == after["total_kv_blocks"] and after["running"] == 0
    assert after["lora"]["host_cache"]["referenced"] == 0


def test_explicit_abort_ends_the_stream(aengine):
    async def main():
        outputs = []
        async for out in aengine.generate("Hello", LONG, request_id="x"):
            outputs.append(out)
            if len(outputs) == 2:
                await aengine.abort("x")
        return outputs, await wait_released(aengine)

    outputs, stats = asyncio.run(main())
    assert outputs[-1].finish_reason == "abort" and len(outputs[-1].token_ids) < LONG.max_tokens
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_caller_errors_are_raised_and_the_engine_keeps_serving(aengine):
    async def main():
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            await collect(aengine, "Hello", SamplingParams(max_tokens=1000))
        with pytest.raises(AdapterNotFoundError, match="nope"):
            await collect(aengine, "Hello", GREEDY, "nope")
        with pytest.raises(ValueError, match="already in use"):
            async with asyncio.timeout(30):
                first = aengine.generate("Hello", LONG, request_id="dup")
                await anext(first)
                await collect(aengine, "Hello", GREEDY, request_id="dup")
        await first.aclose()
        return await collect(aengine, "Hello"), await wait_released(aengine)

    out, stats = asyncio.run(main())
    assert out.finish_reason == "length" and stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_a_failed_adapter_load_ends_its_request_with_an_error(model, adapter, tmp_path, kind):
    # capacity 1: loading "b" evicts "a" from host memory, so "a" is reloaded (from a deleted dir) on use
    aengine = start(kind, config(model, max_loras_per_batch=1, max_loaded_loras=1))
    doomed = shutil.copytree(adapter, tmp_path / "doomed")

    async def main():
        await aengine.load_adapter("a", str(doomed))
        await aengine.load_adapter("b", str(adapter))
        shutil.rmtree(doomed)
        with pytest.raises(RequestError, match="'a'"):
            await collect(aengine, "Hello", GREEDY, "a")
        return await collect(aengine, "Hello", GREEDY, "b")

    try:
        assert asyncio.run(main()).finish_reason == "length"
    finally:
        aengine.close()


class CrashingEngine(LLMEngine):
    """A real engine whose step fails once `crash` is set (a device or worker failure)."""
    crash = False

    def step_deltas(self):
        if self.crash:
            raise RuntimeError("worker died")
        return super().step_deltas()


def test_a_crashed_step_loop_fails_every_pending_request(model):
    engine = CrashingEngine(config(model))
    aengine = AsyncLLMEngine(engine)

    async def main():
        streams = [aengine.generate(p, LONG) for p in PROMPTS[:4]]
        for stream in streams:
            await anext(stream)
        engine.crash = True

        async def drain(stream):   # one reader per stream: concurrent anext() of one generator is an error
            try:
                async for _ in stream:
                    pass
            except BaseException as exc:  # noqa: BLE001
                return exc

        results = await asyncio.gather(*(drain(s) for s in streams))
        errors = {type(r) for r in results}
        with pytest.raises(EngineDeadError, match="worker died"):
            await collect(aengine, "Hello")
        with pytest.raises(EngineDeadError):
            await aengine.stats()
        return errors

    assert asyncio.run(aengine.check_health())
    try:
        errors = asyncio.run(asyncio.wait_for(main(), 60))
        assert errors == {EngineDeadError} and not aengine.is_healthy() and not asyncio.run(aengine.check_health())
    finally:
        aengine.close()


def test_many_concurrent_requests_with_random_leavers_all_end(aengine):
    async def one(i):
        params = SamplingParams(max_tokens=5 + i % 7, temperature=0.8, seed=i)
        got = 0
        async for out in aengine.generate(PROMPTS[i % len(PROMPTS)], params):
            got += 1
            if i % 3 == 0 and got == 2:
                return "left"
            if out.finished:
                return out.finish_reason

    async def main():
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(24))), 120)
        return results, await wait_released(aengine)

    results, stats = asyncio.run(main())
    assert sorted(set(results)) <= ["left", "length", "stop"] and len(results) == 24
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"] and stats["running"] == stats["waiting"] == 0
