"""workers/cpu_graph.py: a CPU decode step, with or without adapters, replayed as its kernel program
(workers/cpu_program.c)."""
from __future__ import annotations

import pytest
import torch

from tests.factories import PROMPTS, make_adapter
from tests.moe_factories import make_expert_adapter, make_moe_model
from workers import EngineConfig, LLMEngine, SamplingParams, cpu_gemv, cpu_graph, cpu_ops, tape_graph

pytestmark = pytest.mark.skipif(not (cpu_graph.available() and cpu_ops.available()), reason="needs a C compiler")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _generate(path: str, prompts=PROMPTS[:3], adapters_of=None, adapters=None, params=GREEDY, **config):
    engine = LLMEngine(EngineConfig(model=path, dtype=config.pop("dtype", "bfloat16"), device="cpu", **config))
    try:
        for name, source in (adapters or {}).items():
            engine.load_adapter(name, str(source))
        out = engine.generate(prompts, params, adapters_of)
        return out, dict(engine.executor.graph_runner.cpu_graphs)
    finally:
        engine.close()


def _base(graphs: dict, bucket: int):
    """The graph (or None) of `bucket` for steps without adapters."""
    (entry,) = [graph for (b, tier), graph in graphs.items() if b == bucket and not tier]
    return entry


def _same(a, b) -> None:
    """Same tokens and the same logprobs, bit for bit: the replay runs the eager step's kernels on its rows."""
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.logprobs == y.logprobs and len(x.logprobs) == len(x.token_ids) > 0


@pytest.mark.skipif(not cpu_gemv.available(), reason="the bf16 linears are oneDNN's without the GEMV kernel")
@pytest.mark.parametrize("arch,num_prompts", [("qwen3", 3), ("llama", 3), ("qwen3", 6)])
def test_a_step_without_adapters_replays_the_eager_steps_kernels(model_dir, arch, num_prompts):
    """Three sequences: the bucket of 4 (the GEMV's vector path), its padded row written to the scratch block; six:
    the bucket of 8 (AMX tiles where Linux lends them)."""
    path = str(model_dir(arch))
    graphed, graphs = _generate(path, PROMPTS[:num_prompts])
    eager, none = _generate(path, PROMPTS[:num_prompts], enforce_eager=True)
    _same(graphed, eager)
    assert none == {}
    bucket = 4 if num_prompts == 3 else 8
    if bucket > cpu_gemv.max_rows():   # oneDNN's linears (no AMX): not captured, the bucket stays eager
        assert graphs == {}
        return
    graph, logits = _base(graphs, bucket)
    layers = 2   # each: two norms, q/k rope, attention, four GEMVs (gate_up with its SiLU-and-mul)
    assert graph.num_kernel_calls == 8 * layers + 2 and graph.num_torch_ops == 1 and logits.shape[0] == bucket


def test_steps_with_adapters_replay_their_lora_tiers_graph(model_dir, tmp_path):
    """A step with adapters replays the graph of its LoRA tier (each row's slot read from the static slot buffer,
    the kernel's per-token entry); its tokens and logprobs are the eager step's, bit for bit, beside the
    adapter-free steps of the same engine and adapters of another rank than the slots'."""
    path = model_dir("qwen3")
    adapters = {"a": make_adapter(path, tmp_path / "a"),
                "b": make_adapter(path, tmp_path / "b", r=4, target_modules=("q_proj", "down_proj"), seed=1)}
    lora = dict(enable_lora=True, max_lora_rank=8, adapters=adapters)
    for names in (["a"] * 3, ["a", None, "b"], [None] * 3):
        graphed, graphs = _generate(str(path), adapters_of=names, **lora)
        _same(graphed, _generate(str(path), adapters_of=names, enforce_eager=True, **lora)[0])
        (bucket, tier), = graphs
        assert bucket == 4 and bool(tier) == any(names) and graphs[bucket, tier] is not None
    # eight streams of different lengths: the batch shrinks through buckets 8, 4, 2 and 1, both tiers in each
    names = [None, "a"] * 4
    params = [SamplingParams(max_tokens=2 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
    graphed, graphs = _generate(str(path), PROMPTS, names, params=params, **lora)
    _same(graphed, _generate(str(path), PROMPTS, names, params=params, enforce_eager=True, **lora)[0])
    if cpu_gemv.max_rows() >= 8:
        assert {b for b, _ in graphs} == {1, 2, 4, 8} and all(g is not None for g in graphs.values())


def test_steps_of_torch_ops_keep_their_eager_step(model_dir):
    """fp32 (oneDNN's linears) is not captured: as it was before the graphs."""
    path = str(model_dir("qwen3"))
    graphed, graphs = _generate(path, dtype="float32")
    assert graphs == {}
    _same(graphed, _generate(path, dtype="float32", enforce_eager=True)[0])


@pytest.mark.skipif(not cpu_gemv.available(), reason="the router's linear is oneDNN's without the GEMV kernel")
@pytest.mark.parametrize("num_prompts", [3, 5])
def test_a_moe_step_replays_its_router_routing_and_experts_as_kernels(tmp_path, num_prompts):
    """A bf16 MoE step: the router's linear on the GEMV kernel, the routing and the whole expert block one C call
    each, so only the embedding is a torch op; the bucket's padded rows (1 of 4, 3 of 8) route to no expert; the
    same tokens and logprobs as the eager step, bit for bit."""
    moe = str(make_moe_model(tmp_path / "moe"))
    prompts = (PROMPTS * 2)[:num_prompts]
    graphed, graphs = _generate(moe, prompts)
    _same(graphed, _generate(moe, prompts, enforce_eager=True)[0])
    bucket = 4 if num_prompts == 3 else 8
    if bucket > cpu_gemv.max_rows():
        assert graphs == {}
        return
    graph, logits = _base(graphs, bucket)
    # a layer: two norms, q/k rope, attention, qkv and o; a sparse one's router, routing and experts (2 of the 3),
    # the dense one's gate_up and down; then the final norm and the LM head
    assert graph.num_torch_ops == 1 and graph.num_kernel_calls == 2 * 9 + 8 + 2 and logits.shape[0] == bucket


@pytest.mark.skipif(not cpu_gemv.available(), reason="the router's linear is oneDNN's without the GEMV kernel")
def test_moe_steps_with_expert_adapters_replay_their_tiers_graph(tmp_path):
    """Expert LoRA inside the fused block, each row's slot read from the static slot buffer through the pool's slot
    -> expert slot map: a MoE step with expert adapters (two ranks, one on attention too, one of the 3 rows base) is
    a graph of kernels, and its tokens and logprobs are the eager step's, bit for bit."""
    moe = tmp_path / "moe"
    make_moe_model(moe)
    adapters = {"e": make_expert_adapter(moe, tmp_path / "e", r=4, target_modules=["q_proj"]),
                "f": make_expert_adapter(moe, tmp_path / "f", r=8, seed=1)}
    lora = dict(enable_lora=True, max_lora_rank=8, adapters=adapters)
    for names in (["e", None, "f"], ["f"] * 3):
        graphed, graphs = _generate(str(moe), adapters_of=names, **lora)
        _same(graphed, _generate(str(moe), adapters_of=names, enforce_eager=True, **lora)[0])
        if 4 > cpu_gemv.max_rows():
            continue
        (bucket, tier), = graphs
        graph, _ = graphs[bucket, tier]
        assert bucket == 4 and "experts_down" in tier and graph.num_torch_ops == 1


def _capture(fn):
    graph = cpu_graph.CPUGraph()
    with torch.inference_mode(), cpu_graph.graph(graph):
        out = fn()
    return graph, out


def test_an_op_with_torch_work_inside_replays_through_the_dispatcher():
    """rms_norm of a view with a column stride copies its rows first (torch work): a replay of its kernel call alone
    would read the capture's copy, so that op replays whole; the plain one replays as its kernel call."""
    base, w = torch.randn(4, 128).bfloat16(), torch.randn(64).bfloat16()
    plain, strided = base[:, 64:], base[:, ::2]
    graph, (a, b) = _capture(lambda: (cpu_ops.rms_norm(plain, w, 1e-6), cpu_ops.rms_norm(strided, w, 1e-6)))
    assert graph.num_kernel_calls == 1 and graph.num_torch_ops >= 1
    base.copy_(torch.randn(4, 128).bfloat16())
    graph.replay()
    assert torch.equal(a, cpu_ops.rms_norm(plain, w, 1e-6)) and torch.equal(b, cpu_ops.rms_norm(strided, w, 1e-6))


def test_a_replay_raises_the_kernels_own_error_and_times_its_calls(monkeypatch):
    qkv, positions = torch.randn(2, 4 * 16).bfloat16(), torch.tensor([3, 5])
    cos, sin = torch.randn(8, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    k_cache = torch.zeros(1, 4, 4, 16, dtype=torch.bfloat16)
    v_cache, slots = torch.zeros_like(k_cache), torch.tensor([1, 6])
    graph, (q, k) = _capture(lambda: cpu_ops.qkv_rope(qkv, positions, cos, sin, None, None, 0.0, 2, 1, k_cache,
                                                      v_cache, slots))
    assert graph.num_kernel_calls == 1 and graph.num_torch_ops == 0
    qkv.copy_(torch.randn(2, 4 * 16).bfloat16())
    monkeypatch.setattr(cpu_graph, "PROFILE", True)
    graph.replay()
    assert torch.equal(q, cpu_ops.qkv_rope(qkv, positions, cos, sin, None, None, 0.0, 2, 1, k_cache, v_cache,
                                           slots)[0])
    assert graph.kernel_seconds()["qkv_rope_bf16"] > 0
    graph.reset_times()
    assert graph.kernel_seconds() == {"qkv_rope_bf16": 0.0}
    positions[1] = 8   # past the rope table
    with pytest.raises(IndexError, match="past the rope table"):
        graph.replay()


def test_a_host_read_while_capturing_raises():
    x = torch.randn(4)
    with pytest.raises(tape_graph.CaptureError):
        _capture(lambda: x.sum().item())


@pytest.mark.skipif(not cpu_gemv.available(), reason="the bf16 linears are oneDNN's without the GEMV kernel")
def test_the_replayed_steps_agree_with_transformers(model_dir):
    """The oracle: Hugging Face's model in bf16 scores the tokens the replayed steps chose (teacher-forced); each
    token's logprob agrees within bf16's rounding of the two computations' different orders."""
    from transformers import AutoModelForCausalLM

    path = model_dir("qwen3")
    out, graphs = _generate(str(path), PROMPTS[:3])
    assert _base(graphs, 4) is not None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    worst = 0.0
    for o in out:
        ids = o.prompt_token_ids + o.token_ids
        with torch.no_grad():
            logprobs = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        n = len(o.prompt_token_ids)
        want = [logprobs[n - 1 + i, t].item() for i, t in enumerate(o.token_ids)]
        worst = max(worst, *(abs(a - b) for a, b in zip(o.logprobs, want, strict=True)))
    assert worst < 0.05, worst


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_served_streams_replay_graphs_and_all_finish(model_dir, tmp_path, kind):
    """The served path (the async front over an engine thread, or the engine in its own process): streams of
    different lengths arriving together, the batch shrinking as they end (buckets 8, 4, 2, 1), adapters and base
    rows mixed; every stream gets all its tokens, and the thread's engine replayed a graph of each bucket and tier.
    (Token equality with LLMEngine.generate is the tests above: served, the steps' composition depends on when each
    request arrives, and a bf16 row's bits on its GEMV path, vector or AMX, as in eager steps.)"""
    import asyncio

    from workers.async_engine import AsyncLLMEngine
    from workers.engine_process import start_engine

    path = model_dir("qwen3")
    adapter = make_adapter(path, tmp_path / "a")
    config = EngineConfig(model=str(path), dtype="bfloat16", device="cpu", max_lora_rank=8)
    names = [None, "a"] * 4
    params = [SamplingParams(max_tokens=2 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
    inner = LLMEngine(config) if kind == "thread" else None
    served = AsyncLLMEngine(inner) if inner is not None else start_engine(config, {})

    async def stream(prompt, p, name):
        return [out async for out in served.generate(prompt, p, name)][-1]

    async def main():
        await served.load_adapter("a", str(adapter))
        return await asyncio.gather(*(stream(*args) for args in zip(PROMPTS, params, names)))

    try:
        outs = asyncio.run(main())
        assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
        assert all(o.finish_reason == "length" for o in outs)
        if inner is not None and cpu_gemv.max_rows() >= 8:
            graphs = inner.executor.graph_runner.cpu_graphs
            assert {b for b, _ in graphs} >= {1, 2, 4} and all(g is not None for g in graphs.values())
            assert any(tier for _, tier in graphs)
    finally:
        served.close()
