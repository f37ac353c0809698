"""Acceptance: the decode step is capture-safe (no data-dependent ops); CUDA graphs replay exactly."""
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from factories import PROMPTS
from workers import EngineConfig, LLMEngine, SamplingParams
from workers.sampler import SamplerState, SamplingTensors, sample

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
        batch = graphs._batch(b, graphs.width, graphs._graph_lora(b))
        logits = engine.executor.runner.model(batch, engine.executor.runner.kv_cache)
        assert logits.shape == (b, engine.runtime.hf_config.vocab_size)
        state = SamplerState(b, logits.shape[-1], 8, "cpu")
        tensors = SamplingTensors.from_lists([0.7] * b, [5] * b, [0.9] * b, list(range(b)), [3] * b,
                                             logits.shape[-1], "cpu", min_ps=[0.1] * b, slots=list(range(b)),
                                             penalties=[(0.5, 0.3, 1.2)] * b, hold_stops=[True] * b, use_bias=True,
                                             num_top_logprobs=3)
        result = sample(logits, tensors, state)
        assert result.tokens.shape == (b,) and result.logprobs.shape == (b,) and result.top_ids.shape == (b, 3)


def test_fake_mode_catches_host_syncs():
    """The check above has teeth: a host read of tensor data fails under the same mode."""
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.ones(4))
        with pytest.raises(DataDependentOutputException):
            x.sum().item()


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
