"""The test tiers (docs/testing.md), imported by tests/conftest.py: `ray` marks every test that starts or uses a
Ray cluster (set here for the users of the shared cluster's fixtures and for tests marked `own_cluster`);
`make test-fast` runs the others. A test outside `ray` that calls ray.init fails, so a new Ray test cannot slip
into the fast tier unmarked.

Import this after the Ray environment is set (conftest does): it imports ray.
"""
from __future__ import annotations

import functools

import pytest
import ray

from parallel import write_tiers
from shared_cluster import CLUSTER

RAY_FIXTURES = {"shared_ray", "shared_serve"}
RAY_INITS = [0]   # ray.init calls in this process: a test not marked `ray` must make none
_INITS_BEFORE = pytest.StashKey[int]()
_ray_init = ray.init


@functools.wraps(_ray_init)
def _counted_ray_init(*args, **kwargs):
    RAY_INITS[0] += 1
    return _ray_init(*args, **kwargs)


ray.init = _counted_ray_init


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects by these markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if RAY_FIXTURES & set(item.fixturenames) or item.get_closest_marker("own_cluster"):
            item.add_marker(pytest.mark.ray)
    # No Ray first, then the shared cluster's modules, then those that stop it to own one: one start per
    # process. By module (its most demanding test), so that no module's fixtures are built twice.
    tier: dict[str, int] = {}
    for item in items:
        level = 2 if item.get_closest_marker("own_cluster") else 1 if item.get_closest_marker("ray") else 0
        tier[item.module.__name__] = max(tier.get(item.module.__name__, 0), level)
    items.sort(key=lambda item: tier[item.module.__name__])   # stable: the order within a tier is kept
    write_tiers(config, {item.nodeid.split("::", 1)[0]: tier[item.module.__name__] for item in items})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_INITS_BEFORE] = RAY_INITS[0]
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    if not item.get_closest_marker("ray") and RAY_INITS[0] > item.stash[_INITS_BEFORE]:
        raise AssertionError(f"{item.nodeid} started Ray but is not marked `ray`, so `make test-fast` would run "
                             f"it: use the shared_serve / shared_ray fixtures or mark its module own_cluster")
    return result


@pytest.fixture(scope="module", autouse=True)
def _own_cluster(request):
    """A module with tests marked own_cluster starts its own Ray (or needs none running): the shared one stops
    first (local_ray stops it too)."""
    if any(item.get_closest_marker("own_cluster") for item in request.session.items if item.module is request.module):
        CLUSTER.stop()


@pytest.fixture(scope="module")
def shared_ray(request):
    """The session's loopback Ray (with Serve; tests/shared_cluster.py) for this module; what the module left
    (Serve apps, actors, placement groups) is deleted at its end. Yields Serve's base URL."""
    yield CLUSTER.start()
    CLUSTER.reset(request.module.__name__)


@pytest.fixture(scope="module")
def shared_serve(shared_ray):
    """Serve's base URL on the shared cluster. Deploy under an app name no other module uses (its replicas'
    logs are found by it); the apps are deleted at the module's end."""
    return shared_ray


def pytest_sessionfinish(session, exitstatus):
    CLUSTER.stop()
