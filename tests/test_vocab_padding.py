"""A vocabulary that is not a multiple of 16: the embedding / LM head shard gets zero padding rows
(workers/parallel.py, for the NPU kernels' 32-byte copies), invisible in tokens and logprobs."""
from factories import PROMPTS, make_adapter
from lora_fixtures import PeftOracle
from workers import EngineConfig, LLMEngine, SamplingParams

VOCAB = 389   # 384 tokenizer tokens + 5 unused rows; the shard is 400 rows


def test_padded_vocab_shard_matches_peft(model_dir, tmp_path):
    path = model_dir("qwen3", vocab_size=VOCAB)   # tied: the padded rows are shared by both ends
    adapters = {"emb_head": make_adapter(path, tmp_path / "emb_head", r=8, alpha=16, seed=3,
                                         target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"])}
    oracle = PeftOracle(path, adapters)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_lora_rank=8))
    engine.load_adapter("emb_head", str(adapters["emb_head"]))
    runner = engine.executor
    assert runner.model.lm_head.shard_size == 400 and runner.model.lm_head.weight.shape[0] == 400
    requests = [(PROMPTS[0], "emb_head"), (PROMPTS[1], None), (PROMPTS[2], "emb_head")]
    outs = engine.generate([p for p, _ in requests], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           adapters=[a for _, a in requests])
    for (prompt, name), out in zip(requests, outs):
        tokens, logprobs = oracle.greedy(prompt, name, 8)
        assert out.token_ids == tokens, (prompt, name)
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-4, (prompt, name)
