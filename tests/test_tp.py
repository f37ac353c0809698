"""Acceptance (issue 4): tensor-parallel worker actors on Ray, CPU / gloo, loopback only.

TP=2 equals TP=1 (tokens, logprobs within 1e-4) with mixed rank-8 / rank-16
adapters on every projection plus lm_head (and embed_tokens), each rank holds
about half the sharded weights and never imports transformers (the engine sends
the config's values), TP=1 runs in one actor when asked, and a killed rank fails
the waiting caller fast and leaves the engine unhealthy.
"""
import shutil
import sys
import threading
import time

import pytest
import ray
import torch

from factories import PROMPTS, make_adapter, model_config
from lora_fixtures import PeftOracle
from lora.adapter import LoRAWeights, model_spec_from_hf_config
from workers import EngineConfig, LLMEngine, SamplingParams
from workers.models.llama import LlamaForCausalLM
from workers.parallel import TPGroup
from lora.layers import lora_shard
from workers.worker_group import WorkerGroupError

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"r8": dict(r=8, alpha=16, target_modules=ALL7 + ["lm_head"]),
            "r16": dict(r=16, alpha=32, target_modules=ALL7 + ["embed_tokens", "lm_head"])}
ARCHS = {"qwen3_kv1": ("qwen3", dict(num_key_value_heads=1)),   # 1 kv head < 2 ranks: replicated
         "llama": ("llama", {})}                                  # 2 kv heads: one per rank
NAMES = [None, "r8", "r16"]
REQUESTS = [(PROMPTS[i // 3], NAMES[i % 3]) for i in range(12)]   # each prompt: base, r8, r16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SHARDED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head")


def make_engine(path, adapters, **kwargs) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_lora_rank=16,
                                    max_model_len=256, **kwargs))
    for name, source in adapters.items():
        engine.load_adapter(name, str(source))
    return engine


def generate(engine, requests=REQUESTS, params=GREEDY):
    return engine.generate([p for p, _ in requests], params, adapters=[a for _, a in requests])


@pytest.fixture(scope="module", params=list(ARCHS))
def setup(request, model_dir, tmp_path_factory, shared_ray):
    """(path, adapters, TP=1 in-process outputs, resident bytes of TP=1) per architecture."""
    arch, overrides = ARCHS[request.param]
    path = model_dir(arch, **overrides)
    out = tmp_path_factory.mktemp(f"tp-adapters-{request.param}")
    adapters = {name: make_adapter(path, out / name, seed=i + 1, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}
    engine = make_engine(path, adapters)
    try:
        expected = generate(engine)
        resident = engine.executor.resident_bytes()
    finally:
        engine.close()
    base = {p: o.token_ids for (p, a), o in zip(REQUESTS, expected) if a is None}
    for name in ADAPTERS:  # both adapters change some output, so parity is not trivial
        assert any(o.token_ids != base[p] for (p, a), o in zip(REQUESTS, expected) if a == name), name
    return request.param, path, adapters, expected, resident


def assert_same(outs, expected):
    for (prompt, adapter), out, ref in zip(REQUESTS, outs, expected):
        assert out.token_ids == ref.token_ids, (prompt, adapter)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs)) < 1e-4, (prompt, adapter)


@pytest.fixture(scope="module")
def tp2(setup):
    """A TP=2 engine (two RayWorker ranks) with the setup's adapters, per architecture."""
    engine = make_engine(setup[1], setup[2], tensor_parallel_size=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tp2_chunked(setup):
    """A TP=2 engine taking prompts in 16-token chunks, with a prefix cache of 4-token blocks; the module's
    last test kills one of its ranks (each TP group costs two processes that import torch)."""
    engine = make_engine(setup[1], setup[2], tensor_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=8,
                         kv_block_size=4)
    yield engine
    engine.close()


def test_tp2_matches_tp1_and_halves_weights(setup, tp2):
    name, path, adapters, expected, tp1 = setup
    assert_same(generate(tp2), expected)
    ranks = tp2.executor.resident_bytes()
    assert tp2.is_healthy()
    # the ranks got the config as plain values, rope frequencies included (llama3 scaling): no transformers
    imported = [w.__ray_call__.remote(lambda _: "transformers" in sys.modules) for w in tp2.executor.workers]
    assert ray.get(imported) == [False, False]
    for rank in ranks:
        assert rank["params"].keys() == tp1["params"].keys()
        for param, nbytes in rank["params"].items():
            full = tp1["params"][param]
            if not any(f"{m}." in param for m in SHARDED):
                assert nbytes == full, param                       # norms: replicated
            elif "qkv_proj" in param and name == "qwen3_kv1":
                cfg = model_config("qwen3", 384, num_key_value_heads=1)
                q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.head_dim
                assert nbytes * (q + 2 * kv) == full * (q // 2 + 2 * kv), param   # kv heads replicated
            else:
                assert 2 * nbytes == full, param
        sharded = sum(n for p, n in rank["params"].items() if any(f"{m}." in p for m in SHARDED))
        full = sum(n for p, n in tp1["params"].items() if any(f"{m}." in p for m in SHARDED))
        assert 0.5 <= sharded / full < 0.6, sharded / full
        assert rank["lora_slots"] < tp1["lora_slots"] and rank["kv_cache"] <= tp1["kv_cache"]


@pytest.mark.parametrize("setup", ["llama"], indirect=True)
def test_tp1_in_one_actor(setup):
    _, path, adapters, expected, _ = setup
    engine = make_engine(path, adapters, distributed_executor="ray")
    try:
        assert len(engine.executor.workers) == 1
        assert_same(generate(engine), expected)
        ray.kill(engine.executor.workers[0])   # an idle engine notices a dead worker too (ray.kill is async)
        deadline = time.monotonic() + 10
        while engine.is_healthy() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not engine.is_healthy()
        with pytest.raises(WorkerGroupError, match="unhealthy"):
            generate(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("setup", ["llama"], indirect=True)
def test_tp2_chunked_prefill_and_prefix_cache_match_peft(setup, tp2_chunked):
    """Prompts in 16-token chunks beside decodes, then again from the prefix cache: PEFT's tokens on 2 ranks."""
    _, path, adapters, _, _ = setup
    oracle = PeftOracle(path, adapters)
    requests = [(" ".join(PROMPTS), a) for a in NAMES] + REQUESTS[9:]
    expected = [oracle.greedy(p, a, GREEDY.max_tokens) for p, a in requests]
    for _ in range(2):
        for (prompt, adapter), out, (tokens, logprobs) in zip(requests, generate(tp2_chunked, requests), expected):
            assert out.token_ids == tokens, (prompt[:20], adapter)
            assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-3, (prompt[:20], adapter)
    assert tp2_chunked.stats()["prefix_cache"]["hit_tokens"] > 100


@pytest.mark.parametrize("setup", ["llama"], indirect=True)
def test_killed_rank_fails_waiting_caller_fast(setup, tp2_chunked):
    """The module's last use of tp2_chunked: one of its ranks is killed."""
    engine = tp2_chunked
    result = {}

    def run():
        try:
            generate(engine, params=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
            result["finished"] = True
        except Exception as exc:  # noqa: BLE001 - the error is what the test checks
            result["error"] = exc

    steps = engine.controller.step_count   # the earlier tests' steps
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while engine.controller.step_count < steps + 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert thread.is_alive() and engine.controller.step_count >= steps + 3, "generation was not running"
    survivor = engine.executor.workers[0]
    killed_at = time.monotonic()
    ray.kill(engine.executor.workers[1])
    thread.join(timeout=30)
    waited = time.monotonic() - killed_at
    assert not thread.is_alive(), "the caller still waits 30 s after the kill"
    assert isinstance(result.get("error"), WorkerGroupError), result
    assert "rank" in str(result["error"]) and "unhealthy" in str(result["error"])
    assert not engine.is_healthy()
    started = time.monotonic()
    with pytest.raises(WorkerGroupError):
        engine.generate("Hello", GREEDY)
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 30
    with pytest.raises(ray.exceptions.RayActorError):  # the survivor is not left inside a collective
        while time.monotonic() < deadline:
            ray.get(survivor.is_alive.remote(), timeout=30)
            time.sleep(0.1)
    print(f"caller got the error {waited:.2f}s after the kill: {result['error']}")


@pytest.mark.parametrize("setup", ["llama"], indirect=True)
def test_adapter_files_read_again_reach_every_rank(setup, tp2, tmp_path):
    """New files at the same path, unloaded and loaded again: every rank serves the new weights.

    The ranks keep their own copies of adapters; they must not keep serving the old ones.
    """
    _, path, adapters, expected, _ = setup
    only_copy = [(p, "copy") for p in PROMPTS[:4]]
    source = tmp_path / "r8"
    shutil.copytree(adapters["r8"], source)
    tp2.load_adapter("copy", str(source))
    try:
        before = [o.token_ids for o in generate(tp2, only_copy)]
        make_adapter(path, source, seed=77, **ADAPTERS["r8"])      # retrained, saved in place
        tp2.unload_adapter("copy")
        tp2.load_adapter("copy", str(source))
        after = generate(tp2, only_copy)
    finally:
        tp2.unload_adapter("copy")
    reference = make_engine(path, {"copy": source})                # TP=1, the new files only
    try:
        wanted = generate(reference, only_copy)
    finally:
        reference.close()
    assert [o.token_ids for o in wanted] != before, "the new weights must change the output"
    for out, ref in zip(after, wanted):
        assert out.token_ids == ref.token_ids
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs)) < 1e-4


@pytest.mark.parametrize("arch,overrides", [("qwen3", dict(num_key_value_heads=1)), ("llama", {}),
                                            ("llama", dict(vocab_size=383))])
def test_lora_shard_tiles_full_tensors(arch, overrides):
    """Each rank's LoRA slices, put back together, are the full PEFT tensors (no process group needed)."""
    overrides = dict(overrides)
    cfg = model_config(arch, overrides.pop("vocab_size", 384), **overrides)
    shards = [lora_shard(LlamaForCausalLM(cfg, TPGroup(rank, 2), 64)) for rank in range(2)]
    gen = torch.Generator().manual_seed(0)
    for module, (in_dim, out_dim) in model_spec_from_hf_config(cfg.to_dict()).module_dims.items():
        w = LoRAWeights(torch.randn(8, in_dim, generator=gen), torch.randn(out_dim, 8, generator=gen), 1.0)
        (a0, b0), (a1, b1) = (shard(module, w) for shard in shards)
        if module in ("o_proj", "down_proj"):                   # row-parallel: A split on input columns
            assert torch.equal(torch.cat([a0, a1], 1), w.lora_a) and b0 is w.lora_b and b1 is w.lora_b
        elif module == "embed_tokens":                          # replicated
            assert a0 is w.lora_a and a1 is w.lora_a and b0 is w.lora_b and b1 is w.lora_b
        elif module in ("k_proj", "v_proj") and cfg.num_key_value_heads == 1:
            assert torch.equal(b0, w.lora_b) and torch.equal(b1, w.lora_b)   # the one kv head on both ranks
        else:                                                   # column-parallel: B split on output rows
            full = torch.cat([b0, b1], 0)
            assert torch.equal(full[:out_dim], w.lora_b) and not full[out_dim:].any()  # lm_head pads with 0
            assert a0 is w.lora_a and a1 is w.lora_a
