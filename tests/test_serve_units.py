"""The Serve edge without Ray: config -> placement, OpenAI request validation, error mapping, metrics text,
the CLI's arguments, and the deterministic demo model."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from deployments import protocol as oai
from deployments.cli import config_from_args, parse_args
from deployments.config import LLMConfig
from deployments.errors import ModelNotFoundError, classify, error_body
from deployments.metrics import render_prometheus
from lora.errors import AdapterNotFoundError, AdapterRankError
from workers.errors import EngineDeadError, RequestError
from workers.device import PLATFORMS
from workers.ray_utils import worker_bundle_indices


@pytest.mark.parametrize("device, tp, bundles, actor", [
    ("cpu", 1, [{"CPU": 1.0}], {"num_cpus": 1.0}),
    ("npu", 1, [{"CPU": 1.0, "NPU": 1.0}], {"num_cpus": 1.0, "resources": {"NPU": 1.0}}),
    ("cuda", 1, [{"CPU": 1.0, "GPU": 1.0}], {"num_cpus": 1.0, "num_gpus": 1.0}),
    ("npu", 8, [{"CPU": 1.0}] + [{"NPU": 1.0}] * 8, {"num_cpus": 1.0}),
    ("cpu", 2, [{"CPU": 1.0}] + [{"CPU": 1.0}] * 2, {"num_cpus": 1.0}),
])
def test_placement_is_the_replica_bundle_plus_one_device_bundle_per_rank(device, tp, bundles, actor):
    config = LLMConfig(model="/m", device=device, tensor_parallel_size=tp)
    assert config.placement_group_bundles() == bundles
    assert config.ray_actor_options() == actor
    options = config.deployment_options()
    assert options["placement_group_strategy"] == "STRICT_PACK" and options["num_replicas"] == 1
    if tp > 1:   # the worker group takes the last tp bundles of the replica's group
        assert worker_bundle_indices(bundles, PLATFORMS[device], tp) == list(range(1, tp + 1))


@pytest.mark.parametrize("kwargs, match", [
    ({"num_replicas": 2, "autoscaling_config": {"min_replicas": 1}}, "not both"),
    ({"engine_kwargs": {"no_such_field": 1}}, "no_such_field"),
    ({"adapters": {"a:b": "/x"}}, "a:b"),
    ({"max_loras_per_batch": 8, "max_loaded_loras": 2}, "max_loaded_loras"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"unknown": 1}, "unknown"),
])
def test_bad_configs_fail_at_the_edge(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        LLMConfig(model="/m", **kwargs)


def test_served_model_names():
    assert LLMConfig().base_model_name == "loraserve-demo"
    assert LLMConfig(model="/models/qwen3-8b/").base_model_name == "qwen3-8b"
    assert LLMConfig(model="Qwen/Qwen3-8B").base_model_name == "Qwen/Qwen3-8B"
    assert LLMConfig(model="/m", served_model_name="x").base_model_name == "x"


def test_openai_requests_refuse_what_they_cannot_honour():
    with pytest.raises(ValidationError, match="n"):
        oai.CompletionRequest(model="m", prompt="x", n=17)
    with pytest.raises(ValidationError, match="streamed"):
        oai.CompletionRequest(model="m", prompt="x", n=2, best_of=3, stream=True)
    assert oai.CompletionRequest(model="m", prompt="x", n=2, best_of=3).best_of == 3
    with pytest.raises(ValidationError, match="temperature"):
        oai.CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "temperature": NaN}')
    with pytest.raises(ValidationError, match="best_of"):
        oai.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], best_of=2)
    ok = oai.CompletionRequest(model="m", prompt=["a", "b"], best_of=1, logit_bias={}, user="u")
    assert ok.prompts() == ["a", "b"] and oai.CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]]
    with pytest.raises(ValidationError, match="unknown_field"):
        oai.CompletionRequest(model="m", prompt="x", unknown_field=1)
    parts = [{"type": "text", "text": "hi"}]
    chat = oai.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": parts}], max_completion_tokens=5)
    assert chat.chat_messages() == [{"role": "user", "content": "hi"}] and chat.to_sampling_params().max_tokens == 5
    with pytest.raises(ValueError, match="image_url"):
        oai.ChatMessage(role="user", content=[{"type": "image_url", "image_url": {}}]).text()


def test_logprobs_computed_only_when_the_answer_needs_them():
    """A served request that shows no logprobs and ranks nothing asks the engine for none (a logsumexp over the
    vocabulary per step saved); logprobs asked, or best_of > n ranking by them, turn them on."""
    chat = lambda **kw: oai.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)
    completion = lambda **kw: oai.CompletionRequest(model="m", prompt="x", **kw)
    assert not chat().to_sampling_params().logprobs and not completion().to_sampling_params().logprobs
    assert chat(logprobs=True).to_sampling_params().logprobs and completion(logprobs=0).to_sampling_params().logprobs
    assert completion(n=2, best_of=3).to_sampling_params().logprobs
    assert not completion(n=2, best_of=2).to_sampling_params().logprobs


@pytest.mark.parametrize("exc, status", [
    (AdapterNotFoundError("adapter 'x' is not loaded"), 404), (ModelNotFoundError("m"), 404),
    (AdapterRankError("adapter 'x': rank 16 > max_lora_rank 8"), 400), (ValueError("max_tokens"), 400),
    (EngineDeadError("dead: actor 5f3a pid 4242"), 503), (RequestError("failed at 10.0.0.7"), 500),
    (RuntimeError("bug in /srv/loraserve/x.py"), 500),
])
def test_errors_map_to_openai_bodies(exc, status):
    assert classify(exc)[0] == status
    code, body = error_body(exc, request_id="rid-1")
    assert code == status and set(body["error"]) >= {"message", "type", "code"}
    if status < 500:   # a caller's mistake is named; our own failure says what kind it was, and the request id
        assert body["error"]["message"] == str(exc)
    else:
        assert str(exc) not in body["error"]["message"] and "rid-1" in body["error"]["message"]


def test_an_error_from_another_replica_keeps_its_status_and_message():
    from ray.exceptions import RayTaskError

    wrapped = RayTaskError("generate", "Traceback ...", AdapterNotFoundError("adapter 'x' is not loaded"))
    wrapped = wrapped.as_instanceof_cause()
    assert error_body(wrapped) == (404, {"error": {"message": "adapter 'x' is not loaded", "type": "NotFoundError",
                                                   "code": "model_not_found", "param": None}})


def test_metrics_text_labels_every_sample_with_model_and_replica():
    text = render_prometheus({"r1": {"metrics": {'requests_total{kind="lora",outcome="stop"}': 3,
                                                 "kv_cache_free_blocks": 7}},
                              "r2": {"metrics": {'requests_total{kind="base",outcome="length"}': 1}}}, "tiny")
    assert text.splitlines() == [
        "# TYPE loraserve_kv_cache_free_blocks gauge",
        'loraserve_kv_cache_free_blocks{model="tiny",replica="r1"} 7',
        "# TYPE loraserve_requests_total counter",
        'loraserve_requests_total{model="tiny",replica="r1",kind="lora",outcome="stop"} 3',
        'loraserve_requests_total{model="tiny",replica="r2",kind="base",outcome="length"} 1',
    ]


def test_cli_arguments_become_the_config():
    args = parse_args(["serve", "--model", "/m", "--lora", "a=/adapters/a", "--lora", "b=org/b", "--tp", "8",
                       "--device", "npu", "--port", "8123", "--max-lora-rank", "32"])
    config = config_from_args(args)
    engine = config.engine
    assert (config.model, config.adapters, engine.tensor_parallel_size, engine.device, engine.max_lora_rank) == (
        "/m", {"a": "/adapters/a", "b": "org/b"}, 8, "npu", 32)
    assert (args.host, args.port) == ("127.0.0.1", 8123)
    assert config_from_args(parse_args(["serve", "--demo"])).model == "demo"
    scheduling = config_from_args(parse_args(["serve", "--max-num-batched-tokens", "128", "--no-enable-chunked-prefill",
                                              "--no-enable-prefix-caching"])).engine_config()
    assert (scheduling.max_num_batched_tokens, scheduling.enable_chunked_prefill,
            scheduling.enable_prefix_caching) == (128, False, False)
    default = config_from_args(parse_args(["serve"])).engine_config()
    assert default.enable_chunked_prefill and default.enable_prefix_caching and default.max_num_batched_tokens is None
    with pytest.raises(SystemExit):
        parse_args(["serve", "--demo", "--model", "/m"])
    with pytest.raises(SystemExit, match="NAME=SOURCE"):
        config_from_args(parse_args(["serve", "--lora", "nameonly"]))


def test_cli_takes_vllms_max_num_seqs_and_the_lora_target_modules(capsys):
    engine = config_from_args(parse_args(["serve", "--max-num-seqs", "8", "--lora-target-modules", "q_proj",
                                          "v_proj", "q_proj", "--cpu-threads", "2"])).engine_config()
    assert (engine.max_num_seqs, engine.lora_target_modules, engine.cpu_threads) == (8, ("q_proj", "v_proj"), 2)
    default = config_from_args(parse_args(["serve"])).engine_config()
    assert default.max_num_seqs == 64 and "lm_head" in default.lora_target_modules
    # a replica's engine leaves one core to Serve by default (as vLLM's CPU worker); the flag changes it
    assert default.cpu_reserved_cores == 1
    assert config_from_args(parse_args(["serve", "--cpu-reserved-cores", "0"])).engine_config().cpu_reserved_cores == 0
    with pytest.raises(SystemExit):
        parse_args(["serve", "--lora-target-modules", "q_proj", "qproj"])
    assert "invalid choice: 'qproj'" in capsys.readouterr().err


def _digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def test_demo_model_is_deterministic_and_built_once(tmp_path):
    from deployments.app import resolve
    from deployments.demo_model import ensure_demo

    model_a, adapters_a = ensure_demo(tmp_path / "a")
    model_b, _ = ensure_demo(tmp_path / "b")
    assert _digest(model_a.parent) == _digest(model_b.parent)
    stamp = (model_a / "config.json").stat().st_mtime_ns
    assert ensure_demo(tmp_path / "a") == (model_a, adapters_a)
    assert (model_a / "config.json").stat().st_mtime_ns == stamp     # found complete: not rebuilt
    resolved = resolve(LLMConfig(demo_cache_dir=str(tmp_path / "a"), device="cpu"))
    assert resolved.model == str(model_a) and resolved.adapters == adapters_a
    assert resolved.base_model_name == "loraserve-demo"


SERVE_FAILURE = """The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or \
initial health check failing. See controller logs for details. Error:
Traceback (most recent call last):
  File "/venv/ray/serve/_private/deployment_state.py", line 694, in check_ready
ray.exceptions.RayTaskError(RuntimeError): \x1b[36mray::ServeReplica:loraserve:LLMServer.initialize_and_get_metadata()\
\x1b[39m (pid=5919, ip=127.0.0.1)
RuntimeError: Traceback (most recent call last):
  File "/work/main/deployments/llm_server.py", line 57, in __init__
    self.engine = AsyncLLMEngine(await asyncio.to_thread(_build_engine, config))
  File "/work/main/lora/sources.py", line 46, in resolve_source
    raise AdapterPathError(f"adapter {name!r}: ...")
lora.errors.AdapterPathError: adapter 'demo-a': '/c/demo-a' is not an adapter directory inside the allowed adapter roots
"""


def test_a_failed_deployment_is_reported_by_the_replicas_own_exception():
    """Serve's application message only names the deployment; the CLI says what the replica raised."""
    from types import SimpleNamespace

    from deployments.placement import deploy_error, exception_line

    def status(value, message):
        return SimpleNamespace(status=SimpleNamespace(value=value), message=message)

    app = SimpleNamespace(message="Failed to update the deployments ['LLMServer'].",
                          deployments={"OpenAIIngress": status("HEALTHY", ""),
                                       "LLMServer": status("DEPLOY_FAILED", SERVE_FAILURE)})
    error = deploy_error(app)
    assert str(error) == ("an LLMServer replica failed to start: lora.errors.AdapterPathError: adapter 'demo-a': "
                          "'/c/demo-a' is not an adapter directory inside the allowed adapter roots")
    assert "Traceback" in error.details and error.details.startswith("LLMServer: The deployment failed")
    # without a traceback (e.g. a health check that timed out): Serve's deployment message, never the app's
    app.deployments["LLMServer"] = status("DEPLOY_FAILED", "The deployment failed: health check timed out")
    assert str(deploy_error(app)) == "The deployment failed: health check timed out"
    assert exception_line("ValueError: EngineConfig: bad\n") == "ValueError: EngineConfig: bad"
    assert exception_line("no exception here") is None
