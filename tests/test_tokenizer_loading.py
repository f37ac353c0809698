"""A replica loads the tokenizer class the engine's AutoTokenizer chose, by name (workers/tokenizer.py): the same
tokenizer as AutoTokenizer's, without AutoTokenizer's config machinery (it imports torch). Its chat template takes
a caller's chat_template_kwargs as values of the template's own variables, and nothing else."""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from factories import make_tokenizer, with_thinking_switch
from workers.tokenizer import load_tokenizer, render_chat, tokenizer_class_of

TEXTS = ["Hello world", " leading space and\ttabs\n", "über naïve 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.special_tokens_map == theirs.special_tokens_map and ours.get_vocab() == theirs.get_vocab()
    for text in TEXTS:
        ids = theirs(text).input_ids
        assert ours(text).input_ids == ids and ours.decode(ids) == theirs.decode(ids)
        assert ours(text, add_special_tokens=False).input_ids == theirs(text, add_special_tokens=False).input_ids
    render = dict(tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES, **render) == theirs.apply_chat_template(MESSAGES, **render)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("declared", [None, "Qwen2Tokenizer", "LlamaTokenizerFast", "PreTrainedTokenizerFast"])
def test_the_class_autotokenizer_chose_loads_the_same_tokenizer(model_dir, tmp_path, arch, declared):
    """Each test architecture, with the tokenizer_class its tokenizer_config declares as real checkpoints do."""
    path = tmp_path / "model"
    shutil.copytree(model_dir(arch), path)
    if declared:
        config_file = path / "tokenizer_config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": declared}))
    theirs = AutoTokenizer.from_pretrained(path)
    same_tokenizer(load_tokenizer(path, tokenizer_class_of(theirs)), theirs)


def test_without_a_class_or_one_from_outside_transformers_autotokenizer_decides(model_dir):
    path = model_dir("qwen3")
    theirs = AutoTokenizer.from_pretrained(path)
    same_tokenizer(load_tokenizer(path), theirs)
    same_tokenizer(load_tokenizer(path, "my_package.tokenization:MyTokenizer"), theirs)   # remote code: not imported


def test_chat_template_kwargs_set_the_templates_variables_and_nothing_else(tmp_path):
    make_tokenizer(tmp_path / "plain")
    tokenizer = load_tokenizer(with_thinking_switch(tmp_path / "plain", tmp_path / "qwen3"))
    chat = [{"role": "user", "content": "Hi"}]

    def rendered(**kwargs) -> str:
        return tokenizer.decode(render_chat(tokenizer, chat, **kwargs))

    plain = rendered()
    assert plain.endswith("<|im_start|>assistant\n")
    assert rendered(chat_template_kwargs={"enable_thinking": False}) == plain + "<think>\n\n</think>\n\n"
    # a name the template does not read changes nothing (vLLM drops it too); reasoning_effort is one here
    assert rendered(chat_template_kwargs={"enable_thinking": True, "reasoning_effort": "low", "x": [1]}) == plain
    assert rendered(chat_template_kwargs={"add_generation_prompt": False}) == plain[:-len("<|im_start|>assistant\n")]
    continued = tokenizer.decode(render_chat(tokenizer, chat + [{"role": "assistant", "content": "Sure, I"}],
                                             chat_template_kwargs={"add_generation_prompt": False,
                                                                   "continue_final_message": True}))
    assert continued.endswith("<|im_start|>assistant\nSure, I")
    # the renderer's own options and names are not the caller's to set: how it tokenizes, which template
    for name, value in [("tokenize", True), ("chat_template", "{{ 7 }}"), ("return_dict", True),
                        ("max_length", 1), ("truncation", True), ("messages", []), ("raise_exception", "x")]:
        with pytest.raises(ValueError, match=name):
            render_chat(tokenizer, chat, chat_template_kwargs={name: value})
