"""The adapter registry survives and belongs to its application (the shared loopback Ray; two replicas, one
after the update).

A hot-load that finds other weights at an adapter's same source reaches every replica, not only the one
that took the call.

While the registry hangs or is dead, generation, `/v1/models` and `/metrics` answer from the last copies and
hot-load / unload are a clean 503; killed, it restarts with every adapter it knew; an update of the app keeps
its adapters; deleting the app deletes the registry and its persisted state, so the next deployment starts
with only its configured adapters; a registry whose app is gone drops itself.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import pytest
import requests

from factories import make_adapter
from serve_fixtures import wait_until

APP, BASE = "reg", "tiny"


@pytest.fixture(scope="module")
def files(model_dir, tmp_path_factory):
    model = model_dir("qwen3")
    root = tmp_path_factory.mktemp("registry_adapters")
    return {"model": model, "a": make_adapter(model, root / "a", r=8, seed=1),
            "hot": make_adapter(model, root / "hot", r=4, seed=2),
            "new": make_adapter(model, root / "new", r=4, seed=3)}


def app_args(files, **overrides) -> dict:
    return {**dict(model=str(files["model"]), served_model_name=BASE, adapters={"a": str(files["a"])}, device="cpu",
                   max_model_len=256, max_lora_rank=8, num_replicas=2), **overrides}


@pytest.fixture(scope="module")
def url(files, shared_serve):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(app_args(files)), name=APP, route_prefix="/")
    return shared_serve


def server():
    from ray import serve
    return serve.get_deployment_handle("LLMServer", app_name=APP)


def registry_pid() -> int:
    from ray._private.state import actors

    from deployments.adapter_registry import registry_name
    alive = [a for a in actors(actor_state_name="ALIVE").values()
             if a["ActorClassName"] == "AdapterRegistry" and a["Name"] == registry_name(APP, BASE)]
    assert len(alive) == 1, alive
    return alive[0]["Pid"]


def models(url: str) -> list[str]:
    response = requests.get(f"{url}/v1/models", timeout=30)
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


def complete(url: str, model: str) -> requests.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
    return requests.post(f"{url}/v1/completions", json=body, timeout=60)


def assert_clean_503(exc: BaseException) -> None:
    from deployments.errors import error_body
    status, body = error_body(exc)
    message = body["error"]["message"]
    assert status == 503 and body["error"]["code"] == "service_unavailable", body
    assert "registry" in message and not any(word in message.lower() for word in ("actor", "pid", "0x", "ray::"))


def test_a_hung_then_killed_registry_fails_no_request_and_comes_back_with_every_adapter(url, files):
    server().load_adapter.remote("hot", str(files["hot"])).result(timeout_s=120)
    assert models(url) == [BASE, "a", "hot"]
    assert requests.get(f"{url}/metrics", timeout=30).status_code == 200   # a scrape, as Prometheus would
    pid = registry_pid()
    os.kill(pid, signal.SIGSTOP)   # hung: every call to it times out
    try:
        assert models(url) == [BASE, "a", "hot"]          # the ingress's last copies
        metrics = requests.get(f"{url}/metrics", timeout=30)
        assert metrics.status_code == 200 and f'model="{BASE}",replica=' in metrics.text
        for model in (BASE, f"{BASE}:a", f"{BASE}:hot"):    # each replica's last copy
            assert complete(url, model).status_code == 200
        # both wait out the registry's call timeout: sent together, they wait it once
        calls = [server().load_adapter.remote("new", str(files["new"])), server().unload_adapter.remote("hot")]
        for call in calls:
            with pytest.raises(Exception) as caught:
                call.result(timeout_s=60)
            assert_clean_503(caught.value)
    finally:
        os.kill(pid, signal.SIGKILL)   # Ray restarts it; the state comes back from the GCS KV
    killed_at = time.monotonic()

    def hot_loads() -> bool:
        try:
            server().load_adapter.remote("new", str(files["new"])).result(timeout_s=30)
            return True
        except Exception as exc:  # noqa: BLE001
            assert_clean_503(exc)
            return False

    wait_until(hot_loads, 10, "hot-load to work again after the registry was killed", interval=0.2)
    print(f"hot-load works again {time.monotonic() - killed_at:.1f}s after the kill")
    assert registry_pid() != pid
    assert models(url) == [BASE, "a", "hot", "new"]
    for model in (f"{BASE}:hot", f"{BASE}:new"):
        assert complete(url, model).status_code == 200


def replica_versions(name: str) -> dict[str, str | None]:
    """Each live replica's content digest of `name`'s current version, as it last reported."""
    import ray

    from deployments.adapter_registry import NAMESPACE, registry_name
    registry = ray.get_actor(registry_name(APP, BASE), namespace=NAMESPACE)
    stats = ray.get(registry.replica_stats.remote(), timeout=30)
    return {rid: s.get("engine", {}).get("lora", {}).get("versions", {}).get(name) for rid, s in stats.items()}


def load_on_both_replicas(name: str, path) -> dict[str, str]:
    """Hot-load until both replicas hold `name` (a replica loads a hot-loaded adapter when a call or request
    for it reaches it; plain handle calls are spread over the replicas). Returns each one's digest."""
    for _ in range(24):
        server().load_adapter.remote(name, str(path)).result(timeout_s=120)
        deadline = time.monotonic() + 2.0   # the replicas report their versions every second
        while True:
            versions = replica_versions(name)
            if len(versions) == 2 and None not in versions.values():
                return versions
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    raise AssertionError(f"24 hot-loads of {name!r} never reached both replicas: {versions}")


def test_new_weights_at_the_same_source_reach_every_replica(url, files, tmp_path):
    """Files rewritten in place, then hot-loaded again under the same name and path: "replaced" on the
    replica that took the call, and the other replica, which holds the name too, reads them again."""
    place = tmp_path / "renewed"
    shutil.copytree(files["hot"], place)
    new = load_on_both_replicas("ref", files["new"])
    old = load_on_both_replicas("renewed", place)
    assert len(set(old.values())) == 1 and set(old.values()) != set(new.values())
    for item in files["new"].iterdir():
        shutil.copy(item, place / item.name)
    assert server().load_adapter.remote("renewed", str(place)).result(timeout_s=120)["status"] == "replaced"
    # the hot-load returns once every live replica applied it; their stats follow at the next report
    wait_until(lambda: replica_versions("renewed") == new, 10, "every replica to serve the renewed weights")
    for name in ("renewed", "ref"):
        server().unload_adapter.remote(name).result(timeout_s=60)


def test_an_update_of_the_app_keeps_its_hot_loaded_adapters(url, files):
    from ray import serve

    from deployments.app import build_app

    server().load_adapter.remote("hot", str(files["hot"])).result(timeout_s=120)
    # new replicas (one: what follows needs no second)
    serve.run(build_app(app_args(files, max_ongoing_requests=8, num_replicas=1)), name=APP, route_prefix="/")
    assert "hot" in models(url)
    assert complete(url, f"{BASE}:hot").status_code == 200


def test_deleting_the_app_deletes_its_registry_so_a_new_one_starts_with_its_configured_adapters(url, files):
    import ray
    from ray import serve
    from ray.experimental import internal_kv

    from deployments.adapter_registry import NAMESPACE, registry_name
    from deployments.app import build_app

    server().load_adapter.remote("hot", str(files["hot"])).result(timeout_s=120)
    name = registry_name(APP, BASE)
    assert internal_kv._internal_kv_get(name, namespace=NAMESPACE) is not None
    serve.delete(APP)
    with pytest.raises(ValueError):   # dropped before the deletion returned
        ray.get_actor(name, namespace=NAMESPACE)
    assert internal_kv._internal_kv_get(name, namespace=NAMESPACE) is None

    serve.run(build_app(app_args(files, num_replicas=1)), name=APP, route_prefix="/")
    assert models(url) == [BASE, "a"]
    assert complete(url, f"{BASE}:hot").status_code == 404


def gone(registry_key: str) -> bool:
    """No registry actor of this name lives (it dropped itself)."""
    import ray

    from deployments.adapter_registry import NAMESPACE

    try:
        ray.get_actor(registry_key, namespace=NAMESPACE)
        return False
    except ValueError:
        return True


def test_a_registry_whose_app_is_gone_drops_itself(url):
    import ray
    from ray.experimental import internal_kv

    from deployments.adapter_registry import NAMESPACE, AdapterRegistry

    key = "adapters:ghost:tiny"
    ghost = AdapterRegistry.options(name=key, namespace=NAMESPACE, lifetime="detached").remote(
        "ghost", key, 0.1, app_check_s=0.5)
    ray.get(ghost.seed.remote({"x": "/nowhere"}))   # its first call starts the watch
    assert internal_kv._internal_kv_get(key, namespace=NAMESPACE) is not None

    wait_until(lambda: gone(key), 30, "the registry of an app Serve does not know to drop itself")
    assert internal_kv._internal_kv_get(key, namespace=NAMESPACE) is None


def test_a_registry_asks_serve_about_its_app_only_once_no_replica_reports(url):
    """A replica's heartbeat says its app exists: while one reports, the registry neither asks Serve nor imports
    Serve's client; once they all went silent it asks, and drops itself (the app is unknown to Serve)."""
    import ray

    from deployments.adapter_registry import NAMESPACE, AdapterRegistry

    key = "adapters:ghost2:tiny"
    ghost = AdapterRegistry.options(name=key, namespace=NAMESPACE, lifetime="detached").remote(
        "ghost2", key, 0.1, app_check_s=0.2)
    deadline = time.monotonic() + 2.0   # ten app checks' time
    while time.monotonic() < deadline:
        ray.get(ghost.report.remote("replica-1", 0, {}), timeout=10)   # the first call starts the watch
        time.sleep(0.1)
    serve_imported = ray.get(ghost.__ray_call__.remote(lambda self: "ray.serve" in sys.modules), timeout=10)
    assert not serve_imported, "the registry asked Serve although a replica reported"

    wait_until(lambda: gone(key), 30, "the registry to drop itself once no replica reports")


def test_replicas_wait_on_a_long_poll_that_a_change_ends_at_once(shared_ray):
    """What each replica's mirror waits on between heartbeats (adapter_mirror.py): a change wakes it, so a
    hot-load reaches every replica without waiting for the next heartbeat."""
    import ray

    from deployments.adapter_registry import NAMESPACE, AdapterRegistry

    key = "adapters:longpoll:tiny"
    registry = AdapterRegistry.options(name=key, namespace=NAMESPACE).remote("longpoll", key, 1.0, app_check_s=600)
    try:
        version = ray.get(registry.seed.remote({}))
        waiting = registry.changes.remote(version, 60)
        assert ray.wait([waiting], timeout=1)[0] == []   # no change: it waits
        ray.get(registry.register.remote("x", "/nowhere", "0123abcd"))
        assert ray.get(waiting, timeout=10) == version + 1   # the change ended it, long before its 60 s
        assert ray.get(registry.changes.remote(version, 60), timeout=10) == version + 1   # known to be behind
        assert ray.get(registry.changes.remote(version + 1, 0.2), timeout=10) == version + 1   # the heartbeat's
    finally:
        ray.get(registry.drop.remote())
        ray.kill(registry)
