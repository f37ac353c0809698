"""Security at the edge, without Ray: adapter names, regular files only, the config and CLI switches, error messages
that hide internals, the log filter that keeps a caller's mistake out of ERROR, hot-load roots and field lengths (the
strict request schema: test_request_schema.py)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
from factories import make_adapter, read_json
from pydantic import ValidationError

from deployments import utility_requests as utility
from deployments.cli import config_from_args, parse_args
from deployments.config import LLMConfig
from deployments.errors import CallerErrorLogFilter, error_body
from lora.adapter import load_adapter, model_spec_from_hf_config
from lora.names import check_adapter_name
from lora.errors import AdapterConfigError, AdapterError
from lora.peft_format import CONFIG_NAME, SAFETENSORS_NAME
from workers.adapters import AdapterManager

GOOD_NAMES = ["a", "demo-a", "A1.b_c-d", "0", "x" * 128]
BAD_NAMES = ["", "a:b", "a/b", "..", ".hidden", "-a", "_a", "a b", "line\nbreak", "x" * 129, "é", "a\x00", 5, None]


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory):
    model = model_dir("qwen3")
    return model, make_adapter(model, tmp_path_factory.mktemp("sec") / "good", r=4, seed=3)


@pytest.fixture(scope="module")
def spec(adapter):
    return model_spec_from_hf_config(read_json(adapter[0] / "config.json"))


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_valid_adapter_names(name):
    assert check_adapter_name(name, "tiny") == name


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_invalid_adapter_names_are_refused_everywhere(name, spec, adapter):
    with pytest.raises(AdapterError, match="is invalid: expected 1 to 128"):
        check_adapter_name(name)
    manager = AdapterManager(spec, max_lora_rank=8, max_loaded_loras=2, max_loras_per_batch=1)
    try:   # the engine's own door: handle callers and Python users of LLMEngine are covered too
        with pytest.raises(AdapterError, match="is invalid"):
            manager.load(name, str(adapter[1]))
        assert manager.list() == {}
    finally:
        manager.close()
    if isinstance(name, str):
        with pytest.raises(ValidationError, match="is invalid"):
            LLMConfig(model="/m", adapters={name: "/x"})


def test_an_adapter_never_takes_the_base_models_name():
    with pytest.raises(AdapterError, match="base model"):
        check_adapter_name("tiny", "tiny")
    with pytest.raises(ValidationError, match="base model"):
        LLMConfig(model="/m", served_model_name="tiny", adapters={"tiny": "/x"})
    message = str(pytest.raises(AdapterError, check_adapter_name, "y" * 10_000).value)
    assert len(message) < 300   # a 10 kB name is not echoed whole


def _load_guarded(path: Path, spec, fifos: list[Path]):
    """load_adapter on a thread; a load blocked on a FIFO is released (writer opened) and the test fails."""
    result: dict = {}

    def run():
        try:
            result["value"] = load_adapter("x", str(path), spec, max_lora_rank=8)
        except Exception as exc:  # noqa: BLE001
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        for fifo in fifos:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"load_adapter blocked on a FIFO under {path}")
    return result


@pytest.mark.parametrize("target", [CONFIG_NAME, SAFETENSORS_NAME])
def test_only_regular_files_are_opened(adapter, spec, tmp_path, target):
    fifo_dir = tmp_path / "fifo"
    shutil.copytree(adapter[1], fifo_dir)
    (fifo_dir / target).unlink()
    os.mkfifo(fifo_dir / target)
    result = _load_guarded(fifo_dir, spec, [fifo_dir / target])
    assert isinstance(result.get("error"), AdapterConfigError), result
    assert f"{target} is not a regular file" in str(result["error"])

    device_dir = tmp_path / "device"
    shutil.copytree(adapter[1], device_dir)
    (device_dir / target).unlink()
    (device_dir / target).symlink_to("/dev/zero")     # endless: read whole, it would exhaust memory
    result = _load_guarded(device_dir, spec, [])
    assert f"{target} is not a regular file" in str(result.get("error")), result


def test_an_oversized_config_is_not_read(adapter, spec, tmp_path):
    big = tmp_path / "big"
    shutil.copytree(adapter[1], big)
    config = read_json(big / CONFIG_NAME)
    config["padding"] = "x" * (2 << 20)
    (big / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(AdapterConfigError, match="over the limit"):
        load_adapter("x", str(big), spec, max_lora_rank=8)


def test_config_security_fields(monkeypatch, tmp_path):
    monkeypatch.delenv("LORASERVE_API_KEY", raising=False)
    plain = LLMConfig(model="/m")
    assert (plain.api_key, plain.enable_hotload, plain.engine.adapter_roots, plain.max_request_bytes) == (
        None, False, (), 4 << 20)
    assert plain.startup_warnings() == []
    assert "without adapter_roots" in LLMConfig(model="/m", enable_hotload=True).startup_warnings()[0]
    assert LLMConfig(model="/m", enable_hotload=True, adapter_roots=["/srv/a"]).startup_warnings() == []
    monkeypatch.chdir(tmp_path)
    assert LLMConfig(model="/m", adapter_roots=["rel"]).engine.adapter_roots == (str(tmp_path / "rel"),)

    monkeypatch.setenv("LORASERVE_API_KEY", "from-env")
    assert LLMConfig(model="/m").api_key.get_secret_value() == "from-env"
    assert LLMConfig.model_validate({"model": "/m"}).api_key.get_secret_value() == "from-env"   # serve_config.yaml
    explicit = LLMConfig(model="/m", api_key="given")
    assert explicit.api_key.get_secret_value() == "given"
    assert "given" not in repr(explicit) and "given" not in str(explicit.model_dump())   # never in a log line
    with pytest.raises(ValidationError, match="api_key"):
        LLMConfig(model="/m", api_key=" ")
    with pytest.raises(ValidationError, match="max_request_bytes"):
        LLMConfig(model="/m", max_request_bytes=10)


def test_cli_security_flags(capsys, monkeypatch):
    monkeypatch.delenv("LORASERVE_API_KEY", raising=False)
    config = config_from_args(parse_args(["serve", "--api-key", "k1", "--enable-hotload", "--adapter-root", "/srv/a",
                                          "--adapter-root", "/srv/b"]))
    assert (config.api_key.get_secret_value(), config.enable_hotload, config.engine.adapter_roots) == (
        "k1", True, ("/srv/a", "/srv/b"))
    default = config_from_args(parse_args(["serve", "--demo"]))
    assert (default.api_key, default.enable_hotload, default.engine.adapter_roots) == (None, False, ())
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--api-key KEY", "--enable-hotload", "--adapter-root DIR", "LORASERVE_API_KEY"):
        assert flag in help_text, flag


def test_server_failures_hide_their_details():
    from ray.exceptions import RayActorError

    for exc in (RayActorError(error_msg="actor 8f2e... pid=4242 ip=10.1.2.3 namespace=loraserve died"),
                TimeoutError("replicas ['abc123'] did not apply version 7"),
                KeyError("/srv/loraserve/workers/engine.py")):
        status, body = error_body(exc, request_id="rid-9")
        assert status >= 500 and "rid-9" in body["error"]["message"]
        for secret in ("pid", "10.1.2.3", "abc123", "/srv", "namespace"):
            assert secret not in body["error"]["message"]


def test_a_callers_mistake_is_one_info_line_without_traceback():
    log_filter = CallerErrorLogFilter()

    def record_of(exc: BaseException, pathname: str = "/venv/ray/serve/_private/replica.py") -> logging.LogRecord:
        try:
            raise exc
        except BaseException:  # noqa: BLE001
            return logging.makeLogRecord({"name": "ray.serve", "levelno": logging.ERROR, "levelname": "ERROR",
                                          "msg": "Request failed.", "exc_info": sys.exc_info(),
                                          "pathname": pathname})

    mistake = record_of(ValueError("max_tokens (9999) exceeds max_model_len (256)"))
    assert log_filter.filter(mistake)
    assert (mistake.levelno, mistake.exc_info) == (logging.INFO, None)
    assert mistake.getMessage() == "Request failed. (caller error: max_tokens (9999) exceeds max_model_len (256))"
    ours = record_of(RuntimeError("a bug"))
    assert log_filter.filter(ours) and ours.levelno == logging.ERROR and ours.exc_info is not None
    elsewhere = record_of(ValueError("logged by our own code"), pathname="/repo/deployments/adapter_registry.py")
    assert log_filter.filter(elsewhere) and elsewhere.exc_info is not None   # only Serve's request log is quieted


def test_adapter_roots_bound_hot_loads_not_the_configured_adapters(tmp_path):
    """Configured adapters are the operator's: the replica's engine also takes their directories (and where
    their files' symlinks lead) as roots; a caller's hot-load is checked against the hot-load roots alone."""
    from lora.sources import check_source_allowed as check_hotload_source   # the one roots rule
    from lora.errors import AdapterPathError

    root, configured, blobs = tmp_path / "root", tmp_path / "configured", tmp_path / "blobs"
    for d in (root / "ok", configured, blobs):
        d.mkdir(parents=True)
    (blobs / "weights").write_bytes(b"")
    (configured / "adapter_config.json").write_text("{}")
    (configured / "adapter_model.safetensors").symlink_to(blobs / "weights")   # as in a Hub cache snapshot
    config = LLMConfig(model="/m", adapter_roots=[str(root)], adapters={"op": str(configured), "hub": "org/lora"})
    engine = config.replica_engine_config()
    assert engine.adapter_roots == (str(root), str(configured), str(blobs)) and engine.hub_adapters_allowed
    assert config.engine_config().adapter_roots == (str(root),)            # what callers are bound by
    assert LLMConfig(model="/m", adapters={"op": str(configured)}).replica_engine_config().adapter_roots == ()

    check_hotload_source("mine", str(root / "ok"), config.engine.adapter_roots, allow_hub=False)
    refusals = [str(configured), str(root / "ok" / ".." / ".." / "configured"), str(root / "missing"), "/etc"]
    messages = set()
    for source in refusals:
        with pytest.raises(AdapterPathError) as info:
            check_hotload_source("mine", source, config.engine.adapter_roots, allow_hub=False)
        messages.add(str(info.value).replace(repr(source), "SRC"))
    assert messages == {"adapter 'mine': SRC is not an adapter directory inside the allowed adapter roots"}
    with pytest.raises(AdapterPathError, match="Hub ids are not allowed"):
        check_hotload_source("mine", "org/lora", config.engine.adapter_roots, allow_hub=False)
    check_hotload_source("mine", "org/lora", config.engine.adapter_roots, allow_hub=True)
    check_hotload_source("mine", "/anywhere", [], allow_hub=True)          # no roots: the engine checks the path


@pytest.mark.parametrize("model, field, limit", [(utility.LoadLoRAAdapterRequest, "lora_path", 4096),
                                                 (utility.LoadLoRAAdapterRequest, "lora_name", 1024),
                                                 (utility.UnloadLoRAAdapterRequest, "lora_name", 1024)])
def test_an_over_long_adapter_field_is_a_400_naming_the_field_and_the_limit(model, field, limit):
    body = {"lora_name": "a", "lora_path": "/a"} if model is utility.LoadLoRAAdapterRequest else {"lora_name": "a"}
    body[field] = "/" + "x" * (1 << 20)                                    # 1 MB
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(json.dumps(body))
    status, error = error_body(info.value)
    assert status == 400 and error["error"]["code"] == "invalid_request", error
    assert error["error"]["message"] == f"{field}: {(1 << 20) + 1} characters, over the limit of {limit}"
    body[field] = "/" + "x" * (limit - 1)
    assert model.model_validate_json(json.dumps(body))                     # at the limit: accepted
