"""Acceptance: greedy tokens and logprobs equal transformers' for Llama, Qwen2 and Qwen3."""
import pytest
import torch

from factories import PROMPTS
from workers import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow   # make test-fast skips it: whole generations against transformers

MAX_TOKENS = 32


@torch.inference_mode()
def hf_greedy(model, tokenizer, prompt: str, max_tokens: int):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_parity_with_transformers(arch, model_dir, hf_model):
    path = model_dir(arch)
    model, tokenizer = hf_model(path)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs = hf_greedy(model, tokenizer, prompt, MAX_TOKENS)
        assert out.token_ids == tokens, prompt
        assert out.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-4
        assert out.text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_sharded_checkpoint_loads_identically(model_dir, tmp_path):
    from factories import make_model
    sharded = make_model(tmp_path / "sharded", "llama", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    single = model_dir("llama")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a = LLMEngine(EngineConfig(model=str(single), device="cpu")).generate(PROMPTS[:3], params)
    b = LLMEngine(EngineConfig(model=str(sharded), device="cpu")).generate(PROMPTS[:3], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_eos_and_stop_conditions(model_dir):
    path = model_dir("qwen3")
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu"))
    free = engine.generate("Hello", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    first, third = free.token_ids[0], free.token_ids[2]
    # a stop token id ends the request on that token, which is kept in token_ids
    out = engine.generate("Hello", SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[third]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:free.token_ids.index(third) + 1]
    # the model's eos id is honoured unless ignore_eos
    engine.eos_token_ids = {first}
    out = engine.generate("Hello", SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == [first]
    # a stop string truncates the text before it
    text = free.text
    stop = text[3:6]
    out = LLMEngine(EngineConfig(model=str(path), device="cpu")).generate(
        "Hello", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.find(stop)]


def test_prepacked_linears_compute_what_plain_ones_do(model_dir):
    """On CPU the linear weights are reordered for oneDNN at load; that must not change a token or logprob."""
    path = str(model_dir("qwen3"))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    packed = LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu"))
    assert any(m.weight.is_mkldnn for m in packed.executor.model.modules() if hasattr(m, "weight")) \
        or not torch.backends.mkldnn.is_available()
    plain = LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", prepack_weights=False))
    a, b = packed.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs)) < 1e-4


def test_dtype_auto_follows_the_checkpoint(model_dir, tmp_path):
    import json
    import shutil
    fp32 = model_dir("qwen3")
    assert LLMEngine(EngineConfig(model=str(fp32), device="cpu")).runtime.dtype == "float32"
    bf16 = tmp_path / "bf16"
    shutil.copytree(fp32, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (bf16 / "config.json").write_text(json.dumps(config))
    want = "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    assert LLMEngine(EngineConfig(model=str(bf16), device="cpu")).runtime.dtype == want


def test_cpu_threads_is_applied_and_defaults_to_the_process_cpus(model_dir):
    """In a Ray actor torch would keep Ray's OMP_NUM_THREADS (the actor's num_cpus: 1 for a replica)."""
    import os
    from workers.worker import CPU_THREADS_ENV, cpu_threads_per_rank, default_cpu_threads
    before = torch.get_num_threads()
    try:
        LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", cpu_threads=1))
        assert torch.get_num_threads() == 1
        assert cpu_threads_per_rank(1) == len(os.sched_getaffinity(0))
        assert cpu_threads_per_rank(10_000) == 1
        cpus = len(os.sched_getaffinity(0))
        assert cpu_threads_per_rank(1, reserved=1) == max(1, cpus - 1)   # a served engine leaves Serve a core
        assert cpu_threads_per_rank(1, reserved=cpus) == 1
        with pytest.raises(ValueError, match="cpu_reserved_cores must be >= 0"):
            EngineConfig(model="m", cpu_reserved_cores=-1)
        with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
            EngineConfig(model="m", cpu_threads=0)
        with pytest.MonkeyPatch.context() as env:   # the environment's default, which cpu_threads overrides
            env.delenv(CPU_THREADS_ENV, raising=False)
            assert default_cpu_threads(1) == len(os.sched_getaffinity(0))
            env.setenv(CPU_THREADS_ENV, "3")
            assert default_cpu_threads(1) == 3
            LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu"))
            assert torch.get_num_threads() == 3
            LLMEngine(EngineConfig(model=str(model_dir("qwen3")), device="cpu", cpu_threads=1))
            assert torch.get_num_threads() == 1
            env.setenv(CPU_THREADS_ENV, "0")
            with pytest.raises(ValueError, match="LORASERVE_CPU_THREADS must be an integer >= 1, got '0'"):
                default_cpu_threads(1)
    finally:
        torch.set_num_threads(before)
