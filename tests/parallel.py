"""`make test` runs the suite in two pytest-xdist workers (2 cores), each module whole in one of them, in an
order that keeps each worker's tiers apart (tests/tiers.py): one worker runs the shared cluster's modules, then
takes own-cluster modules; the other runs the modules without Ray, then takes own-cluster modules. So no cluster
starts twice in a worker, the shared cluster's Serve tests run beside CPU work rather than beside other clusters
starting, and while one worker waits (a CLI's Ray starting, Serve replacing a replica, a registry call timing
out) the other has the CPU. Both take the own-cluster modules longest first (OWN_CLUSTER_SECONDS), so that the
suite ends on short ones and both workers end at about the same time.

xdist's own `--dist loadgroup` marks groups by renaming node ids, which pytest 9 no longer allows; and only the
workers know a module's tier (its tests' fixtures and markers). So each worker writes the tiers it collected to a
file that the controller's scheduler reads once every worker has collected.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

TIERS_FILE = "LORASERVE_TEST_TIERS"   # env: the controller's directory for the workers' tier files
SHARED_TIER, OWN_TIER = 1, 2   # tests/tiers.py's levels (0: no Ray)


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        os.environ[TIERS_FILE] = tempfile.mkdtemp(prefix="tiers-")   # the workers start after this: they inherit it


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and TIERS_FILE in os.environ:
        shutil.rmtree(os.environ.pop(TIERS_FILE), ignore_errors=True)


def write_tiers(config, tiers: dict[str, int]) -> None:
    """In a worker: its collection's tier per module file ("tests/test_tp.py" -> 1)."""
    if hasattr(config, "workerinput") and TIERS_FILE in os.environ:
        path = Path(os.environ[TIERS_FILE], f"{config.workerinput['workerid']}.json")
        path.write_text(json.dumps(tiers))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        """Work units: the shared cluster's modules together, and every other module alone. A worker gets its
        next unit when it has at most two tests left (LoadScopeScheduling), chosen by `next_unit`."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.tiers: dict[str, int] | None = None
            self.shared_node = None

        def _split_scope(self, nodeid: str) -> str:
            if self.tiers is None:   # first called once every worker has collected
                files = sorted(Path(os.environ[TIERS_FILE]).glob("*.json"))
                assert files, "no xdist worker wrote its tiers (tests/tiers.py)"
                self.tiers = json.loads(files[0].read_text())
            module = nodeid.split("::", 1)[0]
            return SHARED if self.tiers[module] == SHARED_TIER else f"{self.tiers[module]}:{module}"

        def _assign_work_unit(self, node) -> None:
            if SHARED in self.workqueue:
                self.shared_node = node
            unit = next_unit(list(self.workqueue), took_shared=node is self.shared_node)
            self.workqueue.move_to_end(unit, last=False)   # the unit xdist's _assign_work_unit pops
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False   # file order: next_unit chooses
    return TierScheduling(config, log)


SHARED = "shared cluster"
# Wall seconds of the own-cluster modules in `make test` on 2 cores (the CI machine), to take the longest
# first: a module missing here counts as the longest (it goes first, where its length cannot make a long tail).
OWN_CLUSTER_SECONDS = {"tests/test_cluster_autoscaling.py": 67, "tests/test_cli_service.py": 35,
                       "tests/test_local_cluster_cli.py": 25, "tests/test_cli_start.py": 22,
                       "tests/test_serve_deploy.py": 19, "tests/test_fail_fast.py": 17, "tests/test_placement.py": 11}


def next_unit(units: list[str], took_shared: bool) -> str:
    """The shared cluster first; then, for the worker that ran it, the own-cluster modules, then the rest from
    the last; for the other worker the modules without Ray from the first, then the own-cluster ones. Own-cluster
    modules go longest first (OWN_CLUSTER_SECONDS)."""
    if SHARED in units:
        return SHARED
    own = sorted((unit for unit in units if unit.startswith(f"{OWN_TIER}:")),
                 key=lambda unit: -OWN_CLUSTER_SECONDS.get(unit.split(":", 1)[1], float("inf")))
    rest = [unit for unit in units if not unit.startswith(f"{OWN_TIER}:")]
    return (own + rest[::-1])[0] if took_shared else (rest + own)[0]
