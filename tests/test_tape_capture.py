"""Captured decode on the CPU: the op tape (workers/tape_graph.py) recorded and replayed on static buffers,
token for token the eager decode's, with mixed adapters and every sampler option; width buckets up to
max_model_len, a wider graph as sequences grow, up-front capture, a host read while capturing raises, a
bucket whose capture fails runs eagerly, and enforce_eager turns it off. (The decode step's capture safety
and the CUDA graphs: tests/test_capture.py.)"""
import logging

import pytest
import torch

from factories import PROMPTS, make_adapter
from lora_fixtures import ALL7
from lora_reference import OpLog
from sampler_rows import EVERYTHING
from workers import EngineConfig, LLMEngine, SamplingParams, tape_graph
from workers.graph_runner import width_buckets
from workers.kv_cache import blocks_needed

pytestmark = pytest.mark.slow   # make test-fast skips it: graph captures and replays

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
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
    return engine.executor.graph_runner


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

    captured.executor.model.lm_head.register_forward_hook(host_read_for_bucket_4)
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
