"""Tiny random checkpoints, tokenizers and PEFT adapters, built in a temp dir.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a
fixed corpus, the models are random transformers checkpoints, the adapters are
PEFT adapters with random (non-zero) B so they change the output.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

PROMPTS = [
    "Hello",
    "The quick brown fox",
    "Ray Serve routes requests to replicas",
    "A paged KV cache stores keys and values in fixed-size blocks and",
    "0123",
    "Tensor parallel shards split the attention heads across devices. The quick brown fox jumps",
    "def main():",
    "world",
]


def make_tokenizer(path: Path, vocab_size: int = 384):
    """The demo model's byte-level BPE (trained here, no download) with its chat template."""
    from deployments.demo_model import train_tokenizer
    return train_tokenizer(path, vocab_size)


# Qwen3's thinking switch, as its chat template writes it after the generation prompt
THINKING_SWITCH = ("{%- if enable_thinking is defined and enable_thinking is false %}"
                   "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


def with_thinking_switch(model_path: Path, out: Path) -> Path:
    """A copy of the checkpoint whose chat template ends with Qwen3's enable_thinking switch."""
    shutil.copytree(model_path, out)
    template = Path(out) / "chat_template.jinja"
    template.write_text(template.read_text() + THINKING_SWITCH)
    return Path(out)


def thinking_model(model_path: Path, out: Path, seed: int = 0) -> Path:
    """A copy of a Qwen3 checkpoint that thinks as Qwen3 does: its enable_thinking switch, and `<think>` /
    `</think>` as added tokens (not special, so they show in the text, as in Qwen3's tokenizer) with two
    random embedding rows of their own."""
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with_thinking_switch(model_path, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    tokenizer.save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.manual_seed(seed)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(out, safe_serialization=True)
    return Path(out)


def model_config(arch: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.2, eos_token_id=vocab_size - 1,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False, head_dim=16,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, tie_word_embeddings=True, head_dim=32,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_model(path: Path, arch: str = "qwen3", seed: int = 0, max_shard_size: str | None = None,
               **overrides) -> Path:
    """Write a tiny random `arch` checkpoint (safetensors) plus tokenizer into `path`."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tok = make_tokenizer(path)
    cfg = model_config(arch, vocab_size=overrides.pop("vocab_size", len(tok)), **overrides)
    cfg.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch == "qwen2":  # random qkv biases so the bias path matters
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def make_adapter(model_path: Path, out: Path, *, r: int = 8, alpha: int = 16,
                 target_modules=("q_proj", "v_proj"), seed: int = 0, **lora_kwargs) -> Path:
    """Write a PEFT LoRA adapter for the checkpoint at `model_path` with random B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                     init_lora_weights=False, **lora_kwargs)
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(out, safe_serialization=True, save_embedding_layers=False)
    return Path(out)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def engine_with_adapters(path: Path, adapters: dict[str, Path], **config):
    """An fp32 CPU LLMEngine on the checkpoint at `path` (other EngineConfig fields in `config`) with
    `adapters` (name -> PEFT directory) loaded."""
    from workers import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(**{"model": str(path), "device": "cpu", "dtype": "float32", **config}))
    try:
        for name, source in adapters.items():
            engine.load_adapter(name, str(source))
    except BaseException:
        engine.close()
        raise
    return engine
