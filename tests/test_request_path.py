"""benchmarks/request_path.py's analysis on windows made by hand: which files are the request's, and the path
that joins the stages (the service itself is measured by running the benchmark; docs/architecture.md and
tests/test_docs_config.py hold its result)."""
from __future__ import annotations

import pytest

from benchmarks import request_path
from benchmarks.request_path import analyse

STAGES = (("ingress", "deployments/openai_api.py"), ("engine process", "workers/core.py"),
          ("engine process", "lora/native.py"), ("ingress", "deployments/openai_api.py"))


def window(*pids: set[str]) -> dict[int, set[str]]:
    return dict(enumerate(pids))


def ingress(*extra: str) -> set[str]:
    return {"deployments/openai_api.py:route", "deployments/openai_api.py:route -> <serve>", *extra}


def engine(*extra: str) -> set[str]:
    return {"workers/core.py:step", "<serve> -> workers/core.py:step", "workers/core.py:step -> workers/kv.py:attend",
            "workers/kv.py:attend", "workers/kv.py:attend -> lora/native.py:call", "lora/native.py:call", *extra}


@pytest.fixture(autouse=True)
def stages(monkeypatch, tmp_path):
    monkeypatch.setattr(request_path, "STAGES", STAGES)
    monkeypatch.setattr(request_path, "ROLES", (("deployments/openai_api.py", "ingress"),
                                                ("workers/core.py", "engine process")))
    for name in ("deployments/openai_api.py", "workers/core.py", "workers/kv.py",
                 "workers/metrics.py", "lora/native.py"):   # the files' lines are counted
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("pass\n")
    monkeypatch.setattr(request_path, "ROOT", tmp_path)


def test_the_path_joins_the_stages_through_a_carrier_and_the_helpers_are_the_rest():
    helper = {"workers/core.py:step -> workers/metrics.py:count", "workers/metrics.py:count"}
    busy = window(ingress(), engine(*helper))
    result = analyse(busy, window({"deployments/openai_api.py:health"}, set()), busy)
    assert result["path"] == ["deployments/openai_api.py", "workers/core.py", "workers/kv.py", "lora/native.py"]
    assert result["num_path_files"] == 4
    assert set(result["files"]) == {*result["path"], "workers/metrics.py"}
    assert result["files"]["workers/metrics.py"]["called_by"] == ["workers/core.py"]
    assert ("", "<serve>") in [tuple(hop) for hop in result["hops"]]


def test_two_callers_of_one_helper_pass_nothing_to_each_other():
    """The core and the kernel both call `kv.attend`: down into it from the core and up out of it to the kernel
    is no chain (a helper two files call passes nothing between them), so no path rather than a false one;
    when the helper calls the kernel, the chain is real."""
    engine_side = {"workers/core.py:step", "<serve> -> workers/core.py:step", "lora/native.py:call",
                   "workers/kv.py:attend", "workers/core.py:step -> workers/kv.py:attend"}
    valley = window(ingress(), engine_side | {"lora/native.py:call -> workers/kv.py:attend"})
    with pytest.raises(RuntimeError, match="no measured chain of calls"):
        analyse(valley, window(set(), set()), valley)
    chain = window(ingress(), engine_side | {"workers/kv.py:attend -> lora/native.py:call"})
    assert analyse(chain, window(set(), set()), chain)["path"][-2:] == ["workers/kv.py", "lora/native.py"]


def test_what_the_idle_window_also_ran_or_one_request_window_alone_ran_is_not_the_requests():
    first = window(ingress("deployments/openai_api.py:timer"), engine("workers/core.py:poll"))
    second = window(ingress(), engine("workers/core.py:poll"))
    idle = window(set(), {"workers/core.py:poll"})
    functions = analyse(first, idle, second)["files"]
    assert "timer" not in functions["deployments/openai_api.py"]["functions"]
    assert "poll" not in functions["workers/core.py"]["functions"]
