"""The embedded default model of `make serve`: a tiny Qwen3 checkpoint, a real tokenizer and two LoRA adapters.

Built locally and deterministically (fixed corpus, fixed seeds, no network) into
`<cache>/demo`; a second call finds it complete and returns at once. The
weights are random, so the text is nonsense: the demo shows the serving path
(routing, batching, adapters, streaming), not a language model.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

FORMAT_VERSION = "2"    # bump when the generated files change, so old caches are rebuilt
# ChatML as Qwen3's template writes it, tools included: the tools' signatures in a system turn, an
# assistant's calls as hermes-style <tool_call> blocks, tool results as <tool_response> in a user turn.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"
    "{% elif m['role'] == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] }}\n{% endif %}"
    "{% for call in m.tool_calls %}{% if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    "{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": {{ call['function']['arguments'] | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ray Serve routes requests to replicas that hold LoRA adapters.",
    "Tensor parallel shards split the attention heads across devices.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Hello world! How are you today? 0123456789",
    "Low-rank adapters add a small update B A to a frozen weight matrix.",
    "def main():\n    return sum(range(10))\n",
] * 4
# name -> (rank, alpha, target modules, seed)
DEMO_ADAPTERS = {
    "demo-a": (8, 16, ("q_proj", "v_proj"), 1),
    "demo-b": (16, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 2),
}


def default_cache_dir() -> Path:
    """`$LORASERVE_CACHE`, else `.cache/` of this checkout (git-ignored), else ~/.cache/loraserve."""
    if os.environ.get("LORASERVE_CACHE"):
        return Path(os.environ["LORASERVE_CACHE"]).expanduser().resolve()
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".cache"
    return Path.home() / ".cache" / "loraserve"


def ensure_demo(cache_dir: str | Path | None = None) -> tuple[Path, dict[str, str]]:
    """(model directory, {adapter name: adapter directory}), generated on first use."""
    root = Path(cache_dir or default_cache_dir()).resolve() / "demo"
    adapters = {name: str(root / "adapters" / name) for name in DEMO_ADAPTERS}
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / ".demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # replicas or CLIs starting together build it once
        if not _is_complete(root):
            _build(root)
    return root / "model", adapters


def _is_complete(root: Path) -> bool:
    marker = root / "COMPLETE"
    return marker.is_file() and marker.read_text() == FORMAT_VERSION


def _build(root: Path) -> None:
    staging = root.with_name(root.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model_dir = staging / "model"
    tokenizer = train_tokenizer(model_dir, vocab_size=512)
    hf_config = write_model(model_dir, vocab_size=len(tokenizer),
                            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    for name, (rank, alpha, targets, seed) in DEMO_ADAPTERS.items():
        write_adapter(staging / "adapters" / name, hf_config, rank, alpha, targets, seed)
    (staging / "COMPLETE").write_text(FORMAT_VERSION)
    shutil.rmtree(root, ignore_errors=True)
    staging.rename(root)


def train_tokenizer(path: Path, vocab_size: int):
    """A byte-level BPE trained on CORPUS, with a chat template, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)
    return fast


def write_model(path: Path, vocab_size: int, eos_token_id: int, seed: int = 0):
    import torch   # here, not at the top: `deployments.app` imports this module in processes that run no model
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=True,
                         eos_token_id=eos_token_id, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return config


def write_adapter(path: Path, hf_config, rank: int, alpha: int, targets: tuple[str, ...], seed: int) -> None:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) with random A and B."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    q_out = hf_config.num_attention_heads * hf_config.head_dim
    kv_out = hf_config.num_key_value_heads * hf_config.head_dim
    shapes = {"q_proj": ("self_attn", hidden, q_out), "k_proj": ("self_attn", hidden, kv_out),
              "v_proj": ("self_attn", hidden, kv_out), "o_proj": ("self_attn", q_out, hidden),
              "gate_proj": ("mlp", hidden, inter), "up_proj": ("mlp", hidden, inter),
              "down_proj": ("mlp", inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module in targets:
            block, in_dim, out_dim = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
              "base_model_name_or_path": "loraserve-demo"}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
