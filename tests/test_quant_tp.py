"""Issue 23 under tensor parallelism (Ray actors, gloo, loopback): a W8A8_DYNAMIC checkpoint on 2 ranks.

Column-parallel shards take their output rows of the int8 weight and of its scales (k/v by the same
kv-head ranges as the float layers, replicated when there are fewer kv heads than ranks); row-parallel
shards take their input columns and keep every scale, and quantize their own slice of the input per
token (as vllm-ascend: no extra collective), so TP 2 is its own arithmetic. Each TP size gives the
tokens of the plain-torch reference of its arithmetic (transformers + PEFT with W8A8 reference
linears, fp32) with mixed adapters, within 1e-3 in logprob for every request (the reference takes
the engine's side of int8 rounding ties, each rank's recorded on its actor: tests/w8a8_ties.py);
each rank holds half the int8 weights.
"""
import pytest

from factories import PROMPTS, engine_with_adapters
from lora_fixtures import ADAPTERS, PeftOracle, build_adapters
from w8a8_reference import assert_matches_reference, install_reference
from w8a8_ties import engine_rounding
from workers import LLMEngine, SamplingParams
from workers.quant.writer import quantize_checkpoint

NAMES = [None, *ADAPTERS]
REQUESTS = [(PROMPTS[i % len(PROMPTS)], NAMES[i % len(NAMES)]) for i in range(14)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ARCHS = {"qwen3_kv1": ("qwen3", dict(num_key_value_heads=1)), "llama": ("llama", {})}
INT8 = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


pytestmark = pytest.mark.usefixtures("shared_ray")


def engine_for(path, adapters, **kwargs) -> LLMEngine:
    return engine_with_adapters(path, adapters, max_lora_rank=64, max_loras_per_batch=8, max_loaded_loras=8,
                                max_model_len=256, **kwargs)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tp2_matches_the_reference_and_halves_int8_weights(model_dir, tmp_path, arch):
    name, overrides = ARCHS[arch]
    src = model_dir(name, **overrides)
    dst = tmp_path / "w8a8"
    quantize_checkpoint(src, dst)
    adapters = build_adapters(src, tmp_path / "adapters")
    sizes = {}
    for tp in (1, 2):
        engine = engine_for(dst, adapters, tensor_parallel_size=tp)
        try:
            with engine_rounding(engine) as ties:
                outs = engine.generate([p for p, _ in REQUESTS], GREEDY, adapters=[a for _, a in REQUESTS])
            ranks = engine.executor.resident_bytes()
        finally:
            engine.close()
        sizes[tp] = ranks if tp == 2 else [ranks]
        assert len(ties.tables) == 4 * 2 * tp   # every layer on every rank
        oracle = PeftOracle(src, adapters)
        install_reference(oracle.model, dst, tp=tp, ties=ties)
        expected = [oracle.greedy(p, a, GREEDY.max_tokens) for p, a in REQUESTS]
        assert_matches_reference(REQUESTS, outs, expected)
        assert ties.rare(), ties.adopted   # a few elements per run, not a pattern
    one = sizes[1][0]["params"]
    for rank in sizes[2]:
        for param, nbytes in rank["params"].items():
            if param.endswith(INT8) and not (arch == "qwen3_kv1" and "qkv_proj" in param):
                assert 2 * nbytes == one[param], param
            if param.endswith("o_proj.weight_scale") or param.endswith("down_proj.weight_scale"):
                assert nbytes == one[param], param                 # row-parallel: every output row's scale
            if param.endswith("gate_up_proj.weight_scale"):
                assert 2 * nbytes == one[param], param
