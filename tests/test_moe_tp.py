"""Acceptance (issue 20): Qwen3-MoE under tensor parallelism on Ray (CPU / gloo, loopback only).

Experts cut along their intermediate dim on every rank, the router replicated: TP 2 gives TP 1's tokens (and
logprobs within 1e-4) for a batch mixing the base and every adapter format, and each rank holds half the experts'
weights and half their LoRA slots.
"""
import pytest

from factories import PROMPTS, engine_with_adapters, make_adapter
from moe_factories import make_expert_adapter, make_moe_model, write_dense_mlp_adapter, write_per_expert_adapter
from workers import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
NAMES = [None, "attn", "experts", "per_expert", "dense_mlp"]
REQUESTS = [(PROMPTS[i // len(NAMES)], NAMES[i % len(NAMES)]) for i in range(3 * len(NAMES))]


pytestmark = pytest.mark.usefixtures("shared_ray")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-tp")
    path = make_moe_model(out / "model", fused=True)
    adapters = {
        "attn": make_adapter(path, out / "attn", r=8, alpha=16, target_modules=["q_proj", "k_proj", "o_proj"], seed=1),
        "experts": make_expert_adapter(path, out / "experts", r=8, alpha=16, target_modules=["v_proj"], seed=2),
        "per_expert": write_per_expert_adapter(path, out / "per_expert", r=4, alpha=8, seed=3)[0],
        "dense_mlp": write_dense_mlp_adapter(path, out / "dense_mlp", layers=(1,), seed=4),
    }
    return path, adapters


def run(path, adapters, **kw):
    engine = engine_with_adapters(path, adapters, max_lora_rank=8, max_model_len=256, max_loras_per_batch=4,
                                  prepack_weights=False, **kw)   # dense bytes: halves exactly
    try:
        outs = engine.generate([p for p, _ in REQUESTS], GREEDY, adapters=[a for _, a in REQUESTS])
        return outs, engine.executor.resident_bytes()
    finally:
        engine.close()


def test_tp2_matches_tp1_and_halves_the_experts(setup):
    path, adapters = setup
    (tp1, full), (tp2, ranks) = run(path, adapters), run(path, adapters, tensor_parallel_size=2)
    base = {p: o.token_ids for (p, a), o in zip(REQUESTS, tp1) if a is None}
    for name in adapters:
        assert any(o.token_ids != base[p] for (p, a), o in zip(REQUESTS, tp1) if a == name), name
    for (prompt, adapter), a, b in zip(REQUESTS, tp1, tp2):
        assert a.token_ids == b.token_ids, (prompt, adapter)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4, (prompt, adapter)
    assert len(ranks) == 2
    for rank in ranks:
        for param, nbytes in rank["params"].items():
            if ".experts." in param:
                assert 2 * nbytes == full["params"][param], param          # cut along the expert intermediate dim
            elif "mlp.gate." in param:
                assert nbytes == full["params"][param], param              # the router: replicated
        assert rank["lora_slots"] < full["lora_slots"]
