"""The test tiers hold (tests/tiers.py): the markers are registered, `make test-fast` selects tests and none
that starts Ray (read from each test's code, its module's helpers and fixtures included: a CLI's own Ray too),
and a test outside `ray` that calls ray.init fails."""
from __future__ import annotations

import ast
import shlex
from functools import cache
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# What starts a Ray cluster, in this process or another: names called, and words in a command line or code string.
STARTERS = {"local_ray", "init_local_ray", "start_cli", "LoopbackAutoscalingCluster",
            "stop_processes_of", "ray.init"}
STARTER_WORDS = ("deployments.cli", "init_local_ray")


def fast_tier_args() -> list[str]:
    """The pytest arguments of the Makefile's test-fast target."""
    [line] = [line for line in (ROOT / "Makefile").read_text().splitlines() if "-m pytest" in line and "-m " in
              line.split("-m pytest", 1)[1]]
    return shlex.split(line.split("-m pytest", 1)[1])


@cache
def module_tree(module: str) -> ast.Module:
    return ast.parse((TESTS / f"{module}.py").read_text())


def _referenced(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
            names.add(f"{sub.value.id}.{sub.attr}")
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and \
                any(word in sub.value for word in STARTER_WORDS):
            names.add("ray.init")
        elif isinstance(sub, ast.arg):   # a test's or fixture's parameters: the fixtures it uses
            names.add(sub.arg)
    return names


def starts_ray(module: str, function: str) -> bool:
    """Whether `function` of tests/`module`.py, or a function or fixture of its module that it uses, starts Ray."""
    defined = {node.name: node for node in module_tree(module).body if isinstance(node, ast.FunctionDef)}
    seen, todo = set(), [function]
    while todo:
        name = todo.pop()
        if name in seen or name not in defined:
            continue
        seen.add(name)
        names = _referenced(defined[name])
        if names & STARTERS:
            return True
        todo += names & defined.keys()
    return False


def test_markers_are_registered(request):
    markers = [line.split(":", 1)[0] for line in request.config.getini("markers")]
    assert {"ray", "own_cluster", "slow"} <= set(markers), markers
    assert request.config.option.strict_markers or "--strict-markers" in request.config.getini("addopts")


def test_the_static_reading_finds_the_known_ray_tests():
    """The reading below is only as good as these: tests that start Ray in process, in a CLI, by hand."""
    assert starts_ray("test_placement", "test_npu_workers_in_their_own_group")   # fixture
    assert starts_ray("test_cli_service", "test_no_process_of_the_service_listens_beyond_loopback")   # start_cli
    assert starts_ray("test_cli_start", "test_a_replica_that_fails_to_start_prints_its_own_exception_and_where_"
                                        "its_log_is")   # start_cli
    assert starts_ray("test_serve_deploy", "test_serve_run_serve_config_answers_a_completion")   # code string
    assert not starts_ray("test_local_cluster_cli", "test_the_readme_has_the_four_steps_on_loopback_and_no_"
                                                    "default_port")


def test_no_test_of_this_run_outside_ray_starts_ray(request):
    """Whatever this run selected (`make test-fast`: the fast tier; `make test`: everything), a test that starts
    Ray is marked `ray`; and the fast tier is `-m "not ray and ..."` with tests in it."""
    args = fast_tier_args()
    assert args[args.index("-m") + 1].startswith("not ray and "), args
    items = [item for item in request.session.items if item.path.parent == TESTS]
    fast = [item for item in items if not item.get_closest_marker("ray")]
    assert fast and request.node in fast
    unmarked = [item.nodeid for item in fast   # this module's ray.init probe below starts nothing
                if item.path != Path(__file__) and starts_ray(item.path.stem, item.originalname)]
    assert not unmarked, f"start Ray but are not marked `ray` (tests/tiers.py): {unmarked}"


def test_a_test_outside_ray_that_calls_ray_init_fails(request):
    """tests/tiers.py's hooks on a test outside `ray`, and on one inside, that call ray.init (with an argument it
    refuses, so that no Ray starts)."""
    import ray

    from tiers import _INITS_BEFORE, pytest_runtest_setup, pytest_runtest_teardown

    class Item:
        def __init__(self, marked: bool):
            self.nodeid, self.stash, self.marked = f"probe[{marked}]", {}, marked

        def get_closest_marker(self, name):
            return name == "ray" and self.marked or None

    def run_hooks(item) -> None:
        setup = pytest_runtest_setup(item)
        next(setup)
        with pytest.raises(StopIteration):
            setup.send(None)
        with pytest.raises(RuntimeError, match="not_an_argument"):
            ray.init(not_an_argument=1)
        teardown = pytest_runtest_teardown(item, None)
        next(teardown)
        with pytest.raises(StopIteration):
            teardown.send(None)

    run_hooks(Item(marked=True))
    with pytest.raises(AssertionError, match=r"probe\[False\] started Ray but is not marked `ray`"):
        run_hooks(Item(marked=False))
    request.node.stash[_INITS_BEFORE] += 2   # the probes' calls are not this test's: its own check stays


def test_the_two_workers_keep_the_tiers_apart():
    """`make test`'s scheduler (tests/parallel.py): the shared cluster's modules go first to one worker, which then
    takes own-cluster modules; the other takes modules without Ray from the first, then own-cluster ones; both take
    the own-cluster modules longest first, a module of unknown length before the known (units are "<tier>:<module
    file>")."""
    from parallel import OWN_CLUSTER_SECONDS, SHARED, next_unit

    short, long = sorted(OWN_CLUSTER_SECONDS, key=OWN_CLUSTER_SECONDS.get)[:2]
    units = ["0:a", "0:b", SHARED, f"2:{short}", f"2:{long}", "2:new"]
    assert next_unit(units, took_shared=False) == SHARED   # whichever worker asks first
    units.remove(SHARED)
    assert next_unit(units, took_shared=False) == "0:a"
    assert next_unit(units, took_shared=True) == "2:new"
    units.remove("2:new")
    assert next_unit(units, took_shared=True) == f"2:{long}"
    assert next_unit(["0:b", f"2:{short}"], took_shared=False) == "0:b"
    assert next_unit([f"2:{short}"], took_shared=False) == f"2:{short}"
    assert next_unit(["0:a", "0:b"], took_shared=True) == "0:b"
