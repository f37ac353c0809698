"""Modules that no adapter of a step targets run no LoRA op (eagerly and in captured decode), and an adapter
hot-loaded later with embed_tokens / lm_head weights is computed exactly, through captured decode, from its
first step on (workers/graph_runner.py: graphs per LoRA tier)."""
import pytest

from factories import PROMPTS, make_adapter
from lora.backends.base import LayerLoRA
from lora.errors import AdapterTargetError
from lora.layers import _LoRALayer
from lora_fixtures import ALL7, PeftOracle
from workers import EngineConfig, LLMEngine, SamplingParams
from workers import tape_graph
from workers.graph_runner import lora_tiers

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROJECTIONS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})
# the vocabulary-sized modules beside attention only: its steps need neither MLP group
EMB_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "lm_head"]


@pytest.fixture(scope="module")
def setup(model_dir, tmp_path_factory):
    path, out = model_dir("qwen3"), tmp_path_factory.mktemp("target-adapters")
    adapters = {"proj": make_adapter(path, out / "proj", r=8, alpha=16, target_modules=ALL7, seed=1),
                "emb_head": make_adapter(path, out / "emb_head", r=16, alpha=32, target_modules=EMB_HEAD, seed=2)}
    return path, adapters, PeftOracle(path, adapters)


class LoRACalls:
    """Which groups' LoRA ops ran (LayerLoRA calls), by wrapper group; in a capture, what the graph holds."""

    def __init__(self, engine, monkeypatch):
        groups = {id(m.op): m.group for m in engine.executor.model.modules() if isinstance(m, _LoRALayer)}
        self.groups: list[str] = []
        call = LayerLoRA.__call__

        def spy(op, y, x, info):
            self.groups.append(groups[id(op)])
            return call(op, y, x, info)

        monkeypatch.setattr(LayerLoRA, "__call__", spy)

    def take(self) -> set[str]:
        seen, self.groups = set(self.groups), []
        return seen


def _generate(engine, names):
    return engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(names))], GREEDY, adapters=list(names))


def _check_peft(oracle, outs, names):
    for i, (out, name) in enumerate(zip(outs, names)):
        tokens, logprobs = oracle.greedy(PROMPTS[i % len(PROMPTS)], name, MAX_TOKENS)
        assert out.token_ids == tokens, name
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-4, name


def test_eager_steps_run_only_the_groups_their_adapters_target(setup, monkeypatch):
    """The CPU default (eager decode, host segments) with the default targets: every module has buffers."""
    path, adapters, oracle = setup
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_lora_rank=16))
    assert set(engine.executor.slot_pool.groups) == PROJECTIONS | {"embed_tokens", "lm_head"}
    for name, source in adapters.items():
        engine.load_adapter(name, str(source))
    calls = LoRACalls(engine, monkeypatch)
    _check_peft(oracle, _generate(engine, [None, None]), [None, None])
    assert calls.take() == set()                                        # base rows only: no LoRA op at all
    _check_peft(oracle, _generate(engine, ["proj", None]), ["proj", None])
    assert calls.take() == PROJECTIONS                                  # no vocabulary-sized zero delta
    _check_peft(oracle, _generate(engine, ["emb_head"]), ["emb_head"])
    assert calls.take() == {"qkv_proj", "o_proj", "embed_tokens", "lm_head"}   # no MLP zero delta either
    names = ["emb_head", "proj", None]
    _check_peft(oracle, _generate(engine, names), names)
    assert calls.take() == PROJECTIONS | {"embed_tokens", "lm_head"}
    engine.close()


def test_hot_loaded_lm_head_adapter_is_exact_through_captured_decode(setup, monkeypatch):
    """Captured decode (the CPU op tape) serves the projections-only adapter with graphs holding no
    embed_tokens / lm_head op; the emb_head adapter, loaded after those graphs exist, replays a graph
    that has them, and equals HF+PEFT; afterwards the projections adapter goes back to its narrower graph."""
    path, adapters, oracle = setup
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_lora_rank=16,
                                    emulate_capture=True))
    runner = engine.executor.graph_runner
    everything = PROJECTIONS | {"embed_tokens", "lm_head"}
    assert runner.tiers == (frozenset(), PROJECTIONS, everything)
    engine.load_adapter("proj", str(adapters["proj"]))
    calls = LoRACalls(engine, monkeypatch)
    replayed = []
    replay = tape_graph.TapeGraph.replay

    def spy(graph):
        replayed.append(next(k for k, (g, _) in runner.graphs.items() if g is graph))
        return replay(graph)

    monkeypatch.setattr(tape_graph.TapeGraph, "replay", spy)
    for names in (["proj", None, "proj"], [None, None, None]):
        _check_peft(oracle, _generate(engine, names), names)
    assert calls.take() == PROJECTIONS                          # prefills and captures alike
    assert {tier for _, _, tier in runner.graphs} == {frozenset(), PROJECTIONS}
    assert {tier for _, _, tier in replayed} == {frozenset(), PROJECTIONS}
    # same (batch, width), narrower tier: fewer ops on the tape, none from the skipped modules
    ops = {tier: g.num_ops for (b, w, tier), (g, _) in runner.graphs.items() if (b, w) == (4, 4)}
    assert ops[frozenset()] < ops[PROJECTIONS]

    engine.load_adapter("emb_head", str(adapters["emb_head"]))    # hot-load, after the graphs were captured
    replayed.clear()
    names = ["emb_head", "proj", None]
    _check_peft(oracle, _generate(engine, names), names)
    assert {"embed_tokens", "lm_head"} <= calls.take()
    assert replayed and {tier for _, _, tier in replayed} == {everything}
    assert runner.graphs[(4, 4, everything)][0].num_ops > ops[PROJECTIONS]

    replayed.clear()
    _check_peft(oracle, _generate(engine, ["proj"]), ["proj"])
    assert {tier for _, _, tier in replayed} == {PROJECTIONS}
    engine.close()


def test_narrowed_targets_refuse_an_adapter_naming_a_module_left_out(setup):
    """The targets that get buffers are fixed at start (graph addresses never move): narrowed, an adapter
    with lm_head / embed_tokens weights is refused by name, and the graphs have two tiers."""
    path, adapters, oracle = setup
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_lora_rank=16,
                                    lora_target_modules=tuple(ALL7), emulate_capture=True))
    assert engine.executor.graph_runner.tiers == (frozenset(), PROJECTIONS)
    with pytest.raises(AdapterTargetError, match="embed_tokens|lm_head"):
        engine.load_adapter("emb_head", str(adapters["emb_head"]))
    engine.load_adapter("proj", str(adapters["proj"]))
    _check_peft(oracle, _generate(engine, ["proj"]), ["proj"])
    engine.close()


def test_tiers_and_the_narrowest_covering_one(model_dir):
    assert lora_tiers(None) == (None,)
    assert lora_tiers(PROJECTIONS) == (frozenset(), PROJECTIONS)
    everything = PROJECTIONS | {"lm_head"}
    assert lora_tiers(everything) == (frozenset(), PROJECTIONS, everything)
    assert lora_tiers(frozenset({"lm_head"})) == (frozenset(), frozenset({"lm_head"}))
    engine = LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", emulate_capture=True))
    runner, all_groups = engine.executor.graph_runner, engine.executor.graph_runner.tiers[-1]
    assert runner.tier(frozenset()) == frozenset() and runner.tier(frozenset({"o_proj"})) == PROJECTIONS
    assert runner.tier(frozenset({"lm_head"})) == runner.tier(None) == all_groups
    engine.close()
