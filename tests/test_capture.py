"""Acceptance: the decode step is capture-safe (no data-dependent ops); CUDA graphs replay exactly.

On CPU the graph-safe decode runs its LoRA through the C kernel's registered torch op
(loraserve::bgmv_add), which FakeTensor mode and torch.compile see through its fake.
"""
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from factories import PROMPTS
from lora_reference import OpLog
from workers import EngineConfig, LLMEngine, SamplingParams, cpu_attention
from sampler_rows import EVERYTHING, step_rows
from workers.sampler import SamplerState, sample

pytestmark = pytest.mark.slow   # make test-fast skips it: graph captures and replays

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _engine(model_dir, **kw):
    return LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", graph_safe_decode=True, **kw))


def test_decode_step_runs_under_fake_tensor_mode(model_dir):
    engine = _engine(model_dir)
    engine.generate(PROMPTS[:3], GREEDY)          # real KV content and a non-trivial state
    graphs = engine.executor.graph_runner
    b = graphs.buckets[2]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for buf in ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables", "token_slots"):
            setattr(graphs, buf, mode.from_tensor(getattr(graphs, buf)))
        batch = graphs._batch(b, graphs.width, graphs._graph_lora(b, None))
        with OpLog() as log:
            logits = engine.executor.model(batch, engine.executor.kv_cache)
        assert "loraserve::bgmv_add" in log.names, "the graph-safe LoRA did not run through the kernel's op"
        assert logits.shape == (b, engine.runtime.hf_config.vocab_size)
        state = SamplerState(b, logits.shape[-1], 8, "cpu")
        tensors, _ = step_rows(SamplingParams(**EVERYTHING), list(range(b)), logits.shape[-1], steps=[3] * b,
                               state=state)   # min_tokens 4 > step 3: the stop tokens are held back
        assert tensors.hold_stops is not None and tensors.penalties is not None and tensors.use_bias
        result = sample(logits, tensors, state)
        assert result.tokens.shape == (b,) and result.logprobs.shape == (b,) and result.top_ids.shape == (b, 3)


def test_fake_mode_catches_host_syncs():
    """The check above has teeth: a host read of tensor data fails under the same mode."""
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.ones(4))
        with pytest.raises(DataDependentOutputException):
            x.sum().item()


def test_cpu_attention_op_has_a_fake_and_compiles():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 6, 4, 32, generator=gen), torch.randn(2, 6, 4, 32, generator=gen)
    q, tables, lens = torch.randn(3, 4, 32, generator=gen), torch.tensor([[1, 2], [3, 0], [5, 4]]), torch.tensor([5, 1, 8])
    expected = cpu_attention.decode_attention(q, k, v, tables, lens, 0.2)
    mode = FakeTensorMode()
    narrow = q[:, :3].clone()      # 3 query heads for 2 kv heads
    with mode:
        out = torch.ops.loraserve.decode_attention(*map(mode.from_tensor, (q, k, v, tables, lens)), 0.2)
        assert out.shape == q.shape and out.dtype == q.dtype
        with pytest.raises(ValueError, match="decode attention"):
            torch.ops.loraserve.decode_attention(*map(mode.from_tensor, (narrow, k, v, tables, lens)), 0.2)
    torch._dynamo.reset()
    compiled = torch.compile(cpu_attention.decode_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, tables, lens, 0.2), expected)


@pytest.mark.parametrize("options", ["greedy", "every_sampler_option"])
def test_graph_safe_decode_equals_eager_decode(model_dir, options):
    eager = LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu"))
    graph_safe = _engine(model_dir)
    params = GREEDY if options == "greedy" else [SamplingParams(max_tokens=16, seed=i, **EVERYTHING)
                                                 for i in range(len(PROMPTS))]
    a = eager.generate(PROMPTS, params)
    b = graph_safe.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs)) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_cuda_graph_capture_replays_identically(model_dir):
    path = str(model_dir("qwen3"))
    eager = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32", enforce_eager=True))
    captured = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32"))
    assert captured.executor.graph_runner.graphs, "no graph was captured"
    a = eager.generate(PROMPTS, GREEDY)
    b = captured.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_cuda_graph_replays_the_lora_ops():
    """The graph phase's LoRA captured once, replayed with other slots per token: each replay is exact."""
    from lora.batch import LoRABatchInfo
    from lora_impls import add_embedding_lora, add_lora
    from lora_reference import assign_slots, make_embedding_buffers, make_lora_case, ref_add_embedding_lora, ref_add_lora
    case = make_lora_case("base_mixed", [1] * 16, (32, 16, 16), seed=3)
    emb_a, emb_b = make_embedding_buffers(case.ranks, case.max_rank, 30, 16, torch.float32, torch.Generator().manual_seed(1))
    cuda = lambda t: t.to("cuda")  # noqa: E731
    x, a, b, y0, ea, eb = cuda(case.x), cuda(case.a), tuple(map(cuda, case.b)), cuda(case.y), cuda(emb_a), cuda(emb_b)
    ids = cuda(torch.randint(0, 30, (16,), generator=torch.Generator().manual_seed(2)))
    slots = torch.full((16,), -1, dtype=torch.int64, device="cuda")
    info = LoRABatchInfo(token_slots=slots, seg_lens=torch.ones_like(slots), seg_slots=slots, seg_lens_host=(),
                         seg_slots_host=(), slot_ranks_host=(), max_rank=case.max_rank, use_graph=True)
    y, emb_y = torch.empty_like(y0), torch.zeros(16, 16, device="cuda")

    def step():
        y.copy_(y0)
        emb_y.zero_()
        add_lora(y, x, a, b, case.offsets, info)
        add_embedding_lora(emb_y, ids, ea, eb, info)

    step()                                  # warm-up: nothing lazy may happen while capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        new = assign_slots("base_mixed", [1] * 16, len(case.ranks), torch.Generator().manual_seed(seed))
        slots.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        expected = ref_add_lora(case.y.clone(), case.x, case.a, case.b, case.offsets, new)
        torch.testing.assert_close(y.cpu(), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(emb_y.cpu(), ref_add_embedding_lora(torch.zeros(16, 16), ids.cpu(), emb_a, emb_b, new),
                                   rtol=1e-4, atol=1e-4)
