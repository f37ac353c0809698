"""No per-adapter fault is an engine fault (issue 19): ranks install the engine's validated copy (never
the files), so files changed after a load change nothing; an adapter that a rank cannot install fails
its own requests, and every other request completes with its reference output on a healthy engine.
TP 1 in process, TP 2 on real Ray actors (CPU / gloo, loopback)."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import PROMPTS, make_adapter
from lora_fixtures import ALL7
from workers import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow   # make test-fast skips it: engines with faulty adapters

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
NAMES = [None, "A", "B", "A", None, "B"]


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


def _adapters(model, out):
    return {name: make_adapter(model, out / name, r=8, alpha=16, target_modules=ALL7, seed=seed)
            for seed, name in enumerate(("A", "B", "other"))}


def _engine(model, adapters, tp=1):
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_lora_rank=16,
                                    max_model_len=128, tensor_parallel_size=tp))
    for name in ("A", "B"):
        engine.load_adapter(name, str(adapters[name]))
    return engine


def _run(engine, names=NAMES):
    outs = engine.generate([PROMPTS[i] for i in range(len(names))], GREEDY, adapters=names)
    return [(o.finish_reason, o.error, o.token_ids) for o in outs]


def _spoil(path, how: str, other):
    weights = path / "adapter_model.safetensors"
    if how == "deleted":
        shutil.rmtree(path)
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "nan":
        tensors = load_file(weights)
        save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, weights)
    else:   # replaced by other valid weights (a trainer saving into the same directory)
        shutil.copy(other / "adapter_model.safetensors", weights)


def _poison(executor, name: str):
    """Rank-side fault: the copy a rank installs has a B of the wrong shape, so its slot load raises."""
    get = executor.get_adapter   # a WorkerGroup's (it ships adapters to the ranks) or the ModelRunner's (TP 1)

    def poisoned(ref):
        adapter = get(ref)
        if ref.name != name:
            return adapter
        weights = {key: dataclasses.replace(w, lora_b=w.lora_b[:-1]) for key, w in adapter.weights.items()}
        return dataclasses.replace(adapter, weights=weights)

    executor.get_adapter = poisoned
    if hasattr(executor, "_shipped"):   # a WorkerGroup: what it shipped before is shipped again, poisoned
        executor._shipped = type(executor._shipped)()
    return get


def _check_isolated(engine, reference):
    """A's requests fail with a clear error, the others get their reference tokens; the engine lives on."""
    got = _run(engine)
    for (reason, error, tokens), (_, _, want), name in zip(got, reference, NAMES):
        if name == "A":
            assert reason == "error" and "adapter 'A' could not be installed on rank" in error, error
        else:
            assert (reason, error, tokens) == ("length", None, want), name
    assert engine.is_healthy()


@pytest.mark.parametrize("how", ["deleted", "truncated", "nan", "replaced"])
def test_files_changed_after_a_load_change_nothing_tp1(model, tmp_path, how):
    adapters = _adapters(model, tmp_path)
    engine = _engine(model, adapters)
    reference = _run(engine)
    _spoil(adapters["A"], how, adapters["other"])
    assert _run(engine) == reference


def test_a_rank_that_cannot_install_an_adapter_fails_only_its_requests_tp1(model, tmp_path):
    engine = _engine(model, _adapters(model, tmp_path))
    reference = _run(engine)
    engine.adapters.forget_slot(engine.adapters.current("A"))      # A is installed again, from the poisoned copy
    original = _poison(engine.executor, "A")
    _check_isolated(engine, reference)
    engine.executor.get_adapter = original
    assert _run(engine) == reference      # the next request for A loads it into a slot again


def test_tp2_ranks_never_read_adapter_files_and_isolate_a_bad_install(model, tmp_path, shared_ray):
    adapters = _adapters(model, tmp_path)
    reference = _run(_engine(model, adapters))
    engine = _engine(model, adapters, tp=2)
    assert _run(engine) == reference
    for how in ("truncated", "deleted"):   # the files are gone: the ranks install what the engine checked
        _spoil(adapters["A"], how, adapters["other"])
        engine.adapters.forget_slot(engine.adapters.current("A"))
        assert _run(engine) == reference, how
    engine.adapters.forget_slot(engine.adapters.current("A"))
    original = _poison(engine.executor, "A")
    _check_isolated(engine, reference)
    engine.executor.get_adapter = original
    assert _run(engine) == reference
    engine.close()
