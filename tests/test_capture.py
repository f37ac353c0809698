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
from sampler_rows import step_rows
from workers.sampler import SamplerState, sample

pytestmark = pytest.mark.slow   # make test-fast skips it: graph captures and replays

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# every sampler option at once: the processors, min-p, top-k / top-p, top logprobs
EVERYTHING = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                  repetition_penalty=1.2, min_tokens=4, logit_bias={3: 5.0, 7: -100.0}, top_logprobs=3)


def _engine(model_dir, **kw):
    return LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", graph_safe_decode=True, **kw))


def test_decode_step_runs_under_fake_tensor_mode(model_dir):
    engine = _engine(model_dir)
    engine.generate(PROMPTS[:3], GREEDY)          # real KV content and a non-trivial state
    graphs = engine.executor.runner.graph_runner
    b = graphs.buckets[2]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for buf in ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables", "token_slots"):
            setattr(graphs, buf, mode.from_tensor(getattr(graphs, buf)))
        batch = graphs._batch(b, graphs.width, graphs._graph_lora(b, None))
        with OpLog() as log:
            logits = engine.executor.runner.model(batch, engine.executor.runner.kv_cache)
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
    assert captured.executor.runner.graph_runner.graphs, "no graph was captured"
    a = eager.generate(PROMPTS, GREEDY)
    b = captured.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_cuda_graph_replays_the_lora_ops():
    """The graph phase's LoRA captured once, replayed with other slots per token: each replay is exact."""
    from lora import ops
    from lora.batch import LoRABatchInfo
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
        ops.add_lora(y, x, a, b, case.offsets, info)
        ops.add_embedding_lora(emb_y, ids, ea, eb, info)

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


# ---- captured decode on the CPU: the op tape (workers/tape_graph.py), width buckets, fallback ----------------

import logging  # noqa: E402

from factories import make_adapter  # noqa: E402
from lora_fixtures import ALL7  # noqa: E402
from workers import tape_graph  # noqa: E402
from workers.graph_runner import width_buckets  # noqa: E402
from workers.kv_cache import blocks_needed  # noqa: E402

MIXED = ["A", None, "B", "A", "C", None, "B", "C"]   # three adapters and the base in one batch


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    model, out = model_dir("qwen3"), tmp_path_factory.mktemp("capture-adapters")
    return {name: str(make_adapter(model, out / name, r=r, alpha=2 * r, target_modules=ALL7, seed=i))
            for i, (name, r) in enumerate({"A": 4, "B": 16, "C": 8}.items())}


def _lora_engine(model_dir, adapters, **kw):
    engine = LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", max_lora_rank=16, **kw))
    for name, source in adapters.items():
        engine.load_adapter(name, source)
    return engine


def _runner(engine):
    return engine.executor.runner.graph_runner


def _generate(engine, params, names=MIXED):
    return engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(names))], params, adapters=list(names))


def _params(options, n=len(MIXED), max_tokens=16):
    if options == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [SamplingParams(max_tokens=max_tokens, seed=i, **EVERYTHING) for i in range(n)]


def test_width_buckets_are_powers_of_two_up_to_max_model_len(model_dir):
    assert width_buckets(2048) == (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert width_buckets(7) == (4, 7) and width_buckets(3) == (3,) and width_buckets(1) == (1,)
    assert width_buckets(100, smallest=1) == (1, 2, 4, 8, 16, 32, 64, 100)
    engine = LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", max_model_len=500,
                                    kv_block_size=8, emulate_capture=True))
    runner = _runner(engine)
    assert runner.widths[-1] == runner.width == blocks_needed(500, 8) == 63
    assert all(w & (w - 1) == 0 for w in runner.widths[:-1]) and list(runner.widths) == sorted(set(runner.widths))
    assert runner.width_bucket(1) == 4 and runner.width_bucket(5) == 8 and runner.width_bucket(33) == 63
    assert runner.capture and runner.graph_safe and not runner.graphs   # lazy: nothing captured before a decode
    with pytest.raises(ValueError, match="emulate_capture"):
        EngineConfig(model="m", emulate_capture=True, graph_safe_decode=False)


@pytest.mark.parametrize("options", ["greedy", "every_sampler_option"])
def test_tape_capture_replays_token_identical_to_eager(model_dir, adapters, options):
    eager = _lora_engine(model_dir, adapters, graph_safe_decode=True)   # the same ops, run eagerly
    control = _lora_engine(model_dir, adapters)                         # CPU default: C kernels, host segments
    captured = _lora_engine(model_dir, adapters, emulate_capture=True)
    a, b, c = (_generate(e, _params(options)) for e in (eager, captured, control))
    assert _runner(captured).graphs, "no graph was captured"
    assert [o.token_ids for o in a] == [o.token_ids for o in b] == [o.token_ids for o in c]
    assert max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs)) < 1e-5
    assert max(abs(x - y) for oa, oc in zip(a, c) for x, y in zip(oa.logprobs, oc.logprobs)) < 1e-4
    # a second run replays the graphs captured by the first (new prompts' values in the same buffers)
    keys = set(_runner(captured).graphs)
    assert [o.token_ids for o in _generate(captured, _params(options), MIXED[::-1])] == \
        [o.token_ids for o in _generate(eager, _params(options), MIXED[::-1])]
    assert keys <= set(_runner(captured).graphs)


def test_replay_switches_to_a_wider_graph_as_sequences_grow(model_dir, adapters, monkeypatch):
    """Block size 4: 4 blocks cover 16 tokens, so 40 new tokens cross the 16-, 32- and 64-token boundaries."""
    kw = dict(kv_block_size=4, max_model_len=256, num_kv_blocks=256)
    eager = _lora_engine(model_dir, adapters, graph_safe_decode=True, **kw)
    captured = _lora_engine(model_dir, adapters, emulate_capture=True, **kw)
    runner = _runner(captured)
    assert runner.widths == (4, 8, 16, 32, 64)
    chosen = []
    replay = tape_graph.TapeGraph.replay

    def spy(graph):
        key = next(k for k, (g, _) in runner.graphs.items() if g is graph)
        needed = int(runner.context_lens[:key[0]].max())                # the widest sequence of this step
        chosen.append((key, blocks_needed(needed, 4)))
        return replay(graph)

    monkeypatch.setattr(tape_graph.TapeGraph, "replay", spy)
    names = ["A", None, "B"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    a, b = _generate(eager, params, names), _generate(captured, params, names)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    widths = [w for (_, w, _), _ in chosen]
    assert widths == sorted(widths) and {8, 16} <= set(widths)            # switched graph at each boundary
    for (bucket, w, _), needed in chosen:                               # the narrowest covering graph
        assert bucket == 4 and needed <= w and (w == runner.widths[0] or needed > w // 2)
    assert {w for _, w, _ in runner.graphs} == set(widths)              # only the widths used were captured


def test_up_front_capture_of_every_bucket_replays_exactly(model_dir, adapters):
    """The device order (every (batch, width), largest first, one pool), here with tapes."""
    kw = dict(max_model_len=128, max_num_seqs=4)
    eager = _lora_engine(model_dir, adapters, graph_safe_decode=True, **kw)
    captured = _lora_engine(model_dir, adapters, emulate_capture=True, **kw)
    runner = _runner(captured)
    runner.lazy = False
    with torch.inference_mode():
        runner._capture_all()
    keys = {(b, w, t) for b in runner.buckets for w in runner.widths for t in runner.tiers}
    # every LoRA tier too: none, the projections, all targets (embed_tokens and lm_head)
    assert len(runner.tiers) == 3 and runner.tiers[0] == frozenset() and runner.tiers[-1] >= {"lm_head"}
    assert set(runner.graphs) == keys == {(b, w, t) for b in (1, 2, 4) for w in (4, 8) for t in runner.tiers}
    assert len({id(g.pool()) for g, _ in runner.graphs.values()}) == 1
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for names in (["A", None, "B"], ["C"]):
        assert [o.token_ids for o in _generate(captured, params, names)] == \
            [o.token_ids for o in _generate(eager, params, names)]
    assert set(runner.graphs) == keys and not runner.failed


def test_tape_replays_in_place_and_records_custom_ops():
    """Replay writes the captured output tensors; loraserve::decode_attention / bgmv_add are on the tape."""
    from lora.backends import cpu_sgmv
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 6, 4, 32, generator=gen), torch.randn(2, 6, 4, 32, generator=gen)
    q, tables, lens = torch.randn(3, 4, 32, generator=gen), torch.tensor([[1, 2], [3, 0], [5, 4]]), torch.tensor([5, 1, 8])
    x, a, b = torch.randn(3, 16, generator=gen), torch.randn(2, 4, 16, generator=gen), torch.randn(2, 8, 4, generator=gen)
    slots = torch.tensor([0, -1, 1])
    y0 = torch.randn(3, 8, generator=gen)

    def step():
        attn = torch.ops.loraserve.decode_attention(q, k, v, tables, lens, 0.2)
        y = y0.clone()
        if cpu_sgmv.available():
            torch.ops.loraserve.bgmv_add(y, x, a, [b], [0, 8], slots)
        return attn.sum(-1), torch.relu(y).view(-1)

    graph = tape_graph.TapeGraph()
    with OpLog() as log, tape_graph.graph(graph):
        attn, y = step()
    assert "loraserve::decode_attention" in log.names
    assert not cpu_sgmv.available() or "loraserve::bgmv_add" in log.names
    for seed in range(1, 3):                        # new values in the inputs, in place; same output tensors
        g = torch.Generator().manual_seed(seed)
        for t in (q, k, v, x, y0):
            t.copy_(torch.randn(t.shape, generator=g))
        lens.copy_(torch.tensor([8, 3, 2]))
        slots.copy_(torch.tensor([1, 0, -1]))
        graph.replay()
        expected_attn, expected_y = step()
        torch.testing.assert_close(attn, expected_attn, rtol=0, atol=0)
        torch.testing.assert_close(y, expected_y, rtol=0, atol=0)


@pytest.mark.parametrize("read", ["item", "tolist", "bool", "nonzero", "masked_select", "bool_index", "numpy"])
def test_host_read_during_tape_capture_raises(read):
    x = torch.arange(6.0)
    reads = {"item": lambda: x.sum().item(), "tolist": lambda: x.tolist(), "bool": lambda: bool(x[1] > 0),
             "nonzero": lambda: x.nonzero(), "masked_select": lambda: x.masked_select(x > 2),
             "bool_index": lambda: x[x > 2], "numpy": lambda: x.numpy()}
    with pytest.raises(tape_graph.CaptureError, match="capture"):
        with tape_graph.graph(tape_graph.TapeGraph()):
            torch.relu(x)
            reads[read]()
    assert x.tolist()[:2] == [0.0, 1.0] and x.sum().item() == 15.0     # outside a capture: allowed again
    with tape_graph.graph(tape_graph.TapeGraph()):                    # integer indexing has a static shape
        x[torch.tensor([0, 2])]


def test_failing_capture_of_one_bucket_runs_that_bucket_eagerly(model_dir, adapters, caplog):
    """A host read in the model only for batch bucket 4: its capture fails, once, with one warning naming the
    bucket; that bucket decodes eagerly (correct tokens) and bucket 1 is still captured."""
    eager = _lora_engine(model_dir, adapters, graph_safe_decode=True)
    captured = _lora_engine(model_dir, adapters, emulate_capture=True)
    runner = _runner(captured)

    def host_read_for_bucket_4(module, inputs, output):
        if output.shape[0] == 4:
            output.sum().item()      # fine eagerly; a capture cannot do it

    captured.executor.runner.model.norm.register_forward_hook(host_read_for_bucket_4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="workers.graph_runner"):
        for names in (["A", None, "B"], ["C"], [None, "C", "A"]):
            assert [o.token_ids for o in _generate(captured, params, names)] == \
                [o.token_ids for o in _generate(eager, params, names)]
    warnings = [r for r in caplog.records if r.name == "workers.graph_runner"]
    projections = runner.tiers[1]      # the adapters' (ALL7) tier
    assert list(runner.failed) == [(4, 4, projections)] and (4, 4, projections) not in runner.graphs \
        and (1, 4, projections) in runner.graphs
    assert len(warnings) == 1 and "batch bucket 4" in warnings[0].getMessage() \
        and "CaptureError" in warnings[0].getMessage()


def test_enforce_eager_turns_the_emulated_capture_off(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", emulate_capture=True,
                                    enforce_eager=True))
    engine.generate(PROMPTS[:2], GREEDY)
    runner = _runner(engine)
    assert not runner.capture and not runner.graphs
