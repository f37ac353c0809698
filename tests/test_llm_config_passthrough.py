"""LLMConfig passes the engine's settings through `engine_kwargs`, typed and checked by EngineConfig itself; the
earlier top-level spelling (serve_config.yaml files, scripts) still means the same."""
import pytest
from pydantic import ValidationError

from deployments.config import LLMConfig
from workers.config import EngineConfig


def test_engine_kwargs_are_typed_and_checked_by_engine_config():
    config = LLMConfig(model="/m", engine_kwargs={"max_num_seqs": "8", "lora_target_modules": ["q_proj"],
                                                  "tensor_parallel_size": 2})
    engine = config.engine_config()
    assert (engine.max_num_seqs, engine.lora_target_modules, engine.tensor_parallel_size) == (8, ("q_proj",), 2)
    assert engine.max_loaded_loras == EngineConfig(model="/m").max_loaded_loras   # EngineConfig's default
    assert len(config.placement_group_bundles()) == 3
    for kwargs, match in (({"device": "tpu"}, "device must be auto or one of"),
                          ({"max_num_seqs": "many"}, "max_num_seqs"),
                          ({"model": "/other"}, "model is a field of this config itself")):
        with pytest.raises(ValidationError, match=match):
            LLMConfig(model="/m", engine_kwargs=kwargs)


def test_the_top_level_spelling_still_works_and_means_the_same():
    old = LLMConfig(model="/m", device="cpu", tensor_parallel_size=2, max_model_len=512, max_lora_rank=16)
    new = LLMConfig(model="/m", engine_kwargs=dict(device="cpu", tensor_parallel_size=2, max_model_len=512,
                                                   max_lora_rank=16))
    assert old == new and old.engine_config() == new.engine_config()
    both = LLMConfig(model="/m", max_num_seqs=4, engine_kwargs={"cpu_threads": 2})
    assert (both.engine.max_num_seqs, both.engine.cpu_threads) == (4, 2)
    with pytest.raises(ValidationError, match="max_num_seqs is given twice"):
        LLMConfig(model="/m", max_num_seqs=4, engine_kwargs={"max_num_seqs": 8})
