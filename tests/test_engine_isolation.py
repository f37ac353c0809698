"""The async engine's step thread only schedules and runs the model; hostile requests do not stall it.

Tokenization, chat templates and text happen in front of it (a tokenizer thread, each reader); a prompt
far over max_model_len is refused before it is tokenized; adapter files are read off the step thread
with a timeout; a stop string ends a request in the engine too.
"""
import asyncio
import threading
import time

import pytest

from factories import PROMPTS, make_adapter
from lora.errors import AdapterLoadTimeoutError
from workers import EngineConfig, LLMEngine, SamplingParams
from workers.async_engine import AsyncLLMEngine, RequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CANARY = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


class NoTokenizer:
    """Stands in for the engine's own tokenizer: any use on the step thread fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the step thread used its tokenizer ({name})")

    def __call__(self, *args, **kwargs):
        raise AssertionError("the step thread tokenized a prompt")


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    return make_adapter(model, tmp_path_factory.mktemp("iso") / "a", r=8, seed=5)


def make(model, **kw):
    return LLMEngine(EngineConfig(model=str(model), device="cpu", max_model_len=512, **kw))


async def canary_gaps(aengine, until: asyncio.Event, prompt=PROMPTS[1]) -> float:
    """Stream a long request until `until` is set; the largest pause between its tokens (s)."""
    last, worst = time.perf_counter(), 0.0
    async for out in aengine.generate(prompt, CANARY):
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
        if until.is_set() or out.finished:
            break
    return worst


def test_text_and_tokens_are_made_off_the_step_thread(model):
    sync = make(model)
    stop_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = sync.generate(PROMPTS[:4], GREEDY)
    stop_text = sync.generate(PROMPTS[2], stop_params)[0].text[3:7]
    engine = make(model)
    engine.tokenizer = NoTokenizer()
    aengine = AsyncLLMEngine(engine)
    messages = [{"role": "user", "content": "Hi"}]

    async def main():
        outs = [[o async for o in aengine.generate(p, GREEDY)][-1] for p in PROMPTS[:4]]
        deltas = [o async for o in aengine.generate(PROMPTS[0], GREEDY, delta=True)]
        stopped = [o async for o in aengine.generate(PROMPTS[2], SamplingParams(
            max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop_text]))][-1]
        chat = await aengine.render_chat(messages)
        return outs, deltas, stopped, chat, await aengine.stats()

    try:
        outs, deltas, stopped, chat, stats = asyncio.run(main())
    finally:
        aengine.close()
    assert [(o.token_ids, o.text) for o in outs] == [(r.token_ids, r.text) for r in reference]
    assert "".join(d.text for d in deltas) == outs[0].text and sum(len(d.token_ids) for d in deltas) == 12
    assert deltas[0].prompt_token_ids and not any(d.prompt_token_ids for d in deltas[1:])
    assert stopped.finish_reason == "stop" and stop_text not in stopped.text
    assert len(stopped.token_ids) < 24 and stats["running"] == 0   # the stop string ended it in the engine
    template = sync.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == sync.tokenizer(template, add_special_tokens=False).input_ids


def test_a_huge_prompt_is_refused_cheaply_while_others_stream(model):
    aengine = AsyncLLMEngine(make(model))
    limit = aengine.encoder.max_chars

    async def main():
        done = asyncio.Event()
        canary = asyncio.create_task(canary_gaps(aengine, done))
        await asyncio.sleep(0.3)
        start = time.perf_counter()
        with pytest.raises(ValueError, match="far longer than max_model_len"):
            await anext(aengine.generate("x" * (4 * 2**20), GREEDY))          # 4 MiB: not even tokenized
        refused_in = time.perf_counter() - start
        words = ("lorem ipsum dolor sit amet " * (limit // 27 + 1))[:limit]  # tokenized, then too long
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            await anext(aengine.generate(words, GREEDY))
        done.set()
        return refused_in, await canary

    try:
        refused_in, worst_gap = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        aengine.close()
    assert refused_in < 0.5
    assert worst_gap < 1.0, f"the canary stalled {worst_gap:.2f}s"   # the bound; steps take ~10 ms


def test_slow_adapter_reads_time_out_and_others_keep_generating(model, adapter, tmp_path):
    engine = make(model, adapter_load_timeout_s=0.5, max_loras_per_batch=1, max_loaded_loras=1)
    aengine = AsyncLLMEngine(engine)
    other = make_adapter(model, tmp_path / "b", r=8, seed=6)
    cache = engine.adapters.cache
    gate, original = threading.Event(), cache._load_fn

    def stuck_load(name, source):   # the real read, held as a hung filesystem would hold it
        gate.wait(30)
        return original(name, source)

    async def main():
        await aengine.load_adapter("a", str(adapter))
        await aengine.load_adapter("b", str(other))      # capacity 1: "a" leaves host memory
        assert not cache.is_resident(aengine.client.engine.adapters.current("a"))
        cache._load_fn = stuck_load
        done = asyncio.Event()
        canary = asyncio.create_task(canary_gaps(aengine, done))
        await asyncio.sleep(0.3)
        with pytest.raises(AdapterLoadTimeoutError, match="adapter_load_timeout_s"):   # a hot-load
            await aengine.load_adapter("slow", str(adapter))
        with pytest.raises(RequestError, match="adapter_load_timeout_s"):              # a page-in
            await anext(aengine.generate(PROMPTS[0], GREEDY, "a"))
        done.set()
        gap = await canary
        gate.set()
        cache._load_fn = original
        out = [o async for o in aengine.generate(PROMPTS[0], GREEDY, "a")][-1]
        return gap, out, await aengine.list_adapters()

    try:
        gap, out, known = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        gate.set()
        aengine.close()
    assert gap < 1.0, f"the canary stalled {gap:.2f}s while adapter reads hung"
    assert out.finish_reason == "length" and "slow" not in known and {"a", "b"} <= set(known)
