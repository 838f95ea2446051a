"""Shared fixtures: one Ray instance (and one Serve instance) per session, a leak check after every Ray
test, GPU gating.

Ray tests take the `ray_session` fixture (or are marked `ray`); after each such test no actor of
ours may be alive and no placement group may remain (read from Ray's GCS tables, which work
without the dashboard).
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

import pytest

RAY_CPUS = 8


def requires_gpus(n: int):
    """Skip unless `n` CUDA GPUs are visible: `@requires_gpus(2)`."""
    try:
        import torch
        have = torch.cuda.device_count()
    except Exception:
        have = 0
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPU(s), found {have}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        uses_ray = {"ray_session", "two_node_cluster"} & set(getattr(item, "fixturenames", ()))
        if uses_ray and not item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.ray)
        if item.get_closest_marker("gpu") and not _gpu_count():
            item.add_marker(pytest.mark.skip(reason="gpu test: no CUDA GPU visible"))


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Add every phase's time (setup, call, teardown) to its test file's total."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The 15 test files that took longest (the suite's budget is watched per file, not only per test)."""
    if len(_FILE_SECONDS) < 2:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section("slowest 15 test files")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")


def _gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny models (`pytest.mark.usefixtures("one_torch_thread")`): a
    forward is microseconds of math, and OpenMP threads would only spin against each other and
    against the machine's other work."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def init_local_ray() -> None:
    """Start the test session's local Ray instance (8 logical CPUs, no dashboard), unless one is running
    (module fixtures call this; the instance is shared by the whole session)."""
    if os.environ.get("PHYAI_TEST_FAST"):
        pytest.skip("starts Ray: `make test-fast` leaves the Ray tests to `make test`")
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Workers find `tests.plugins` through PYTHONPATH inherited from this process (the raylet is its
    # child), not through a job runtime_env: with one, a 2-rank engine took about 15% more CPU and wall
    # time to start here.
    root = os.getcwd()
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=True)


def stop_local_ray() -> None:
    """Shut down the session's Serve instance (if started) and Ray, e.g. before a test starts a cluster of
    its own; the next `init_local_ray` / `shared_serve` starts both again. Serve first: its client would
    otherwise keep the gone controller's handle."""
    import ray

    if not ray.is_initialized():
        return
    if _SERVE:
        from ray import serve

        serve.shutdown()
        _SERVE.clear()
    ray.shutdown()


@pytest.fixture(scope="session")
def _ray_shutdown_at_exit():
    yield
    stop_local_ray()


@pytest.fixture
def ray_session(_ray_shutdown_at_exit):
    """The session's local Ray instance; started on first use (again, if a multi-node test replaced it)."""
    import ray

    init_local_ray()
    yield ray


# Ids of the actors and placement groups that module fixtures keep alive on purpose (`held`): the
# per-test leak check and `live_actors` / `live_placement_groups` do not count them.
_HELD: set[str] = set()


def live_actors() -> list[dict]:
    """Actors of ours (phyai-ray rank actors and helpers) that are not dead, from the GCS table."""
    import ray

    table = ray._private.state.actors()
    return [a for a in table.values() if a.get("State") != "DEAD" and _ours(a) and a.get("ActorID") not in _HELD]


def live_placement_groups() -> list[dict]:
    import ray

    return [pg for pg in ray.util.placement_group_table().values()
            if pg.get("state") != "REMOVED" and pg.get("placement_group_id") not in _HELD]


def held(make: Any, close: Any = None) -> Iterator[Any]:
    """In a module fixture (`yield from held(lambda: Engine(...))`): the actors and placement groups that
    `make()` starts are held on purpose while the module's tests share them (the leak check after each
    test does not count them); then as `closed_without_leaks`."""
    init_local_ray()
    before = _our_ids()
    value = make()
    mine = _our_ids() - before
    _HELD.update(mine)

    def release_and_close() -> None:
        _HELD.difference_update(mine)
        (close or value.close)()

    yield from closed_without_leaks(value, release_and_close)


def _our_ids() -> set[str]:
    return {a["ActorID"] for a in live_actors()} | {pg["placement_group_id"] for pg in live_placement_groups()}


def _ours(actor: dict) -> bool:
    name = actor.get("ActorClassName", "") or ""
    return "phyai" in name.lower() or "Rank" in name or "Probe" in name or "EngineActor" in name


def start_serve(port: int, **options: Any) -> None:
    """`serve.start` on 127.0.0.1:`port` for one module. If it fails (e.g. a proxy actor that dies while
    starting on a loaded machine), Serve is shut down before the error goes on: a half-started instance
    would otherwise answer the next module's `serve.start` on this module's port."""
    from ray import serve

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, **options)
    except BaseException:
        serve.shutdown()
        raise


_SERVE: dict[str, int] = {}


def shared_serve() -> dict[str, int]:
    """The session's Serve instance, started on first use: HTTP on 127.0.0.1:`["port"]`, gRPC with the Open
    Inference Protocol servicer on `["grpc_port"]`. Modules deploy their apps on it and delete them at the
    end (`delete_serve_apps`); Serve stops with Ray. Started again if it is gone (a multi-node test
    replaced Ray)."""
    from ray import serve

    from phyai_ray.serve.runtime.server import grpc_options
    from tests.helpers import free_port

    init_local_ray()
    if _SERVE and serve.status().proxies:
        return _SERVE
    port, grpc_port = free_port(), free_port()
    start_serve(port, grpc_options=grpc_options(grpc_port))
    _SERVE.clear()
    _SERVE.update(port=port, grpc_port=grpc_port)
    return _SERVE


def delete_serve_apps() -> None:
    """Delete every app on the session's Serve instance (each call waits until its replicas stopped)."""
    from ray import serve

    for name in list(serve.status().applications):
        serve.delete(name)


def wait_for_no_leaks(timeout_s: float = 15.0) -> tuple[list, list]:
    deadline = time.monotonic() + timeout_s
    while True:
        actors, pgs = live_actors(), live_placement_groups()
        if (not actors and not pgs) or time.monotonic() > deadline:
            return actors, pgs
        time.sleep(0.2)


def closed_without_leaks(value: Any, close: Any = None) -> Iterator[Any]:
    """In a module fixture (`yield from`): yield `value` (an engine), then `close()` (default:
    `value.close()`) and assert that no actor or placement group of ours is left."""
    try:
        yield value
    finally:
        (close or value.close)()
        actors, groups = wait_for_no_leaks(30)
        assert not actors and not groups, f"left behind: {actors} {groups}"


def closed_together(makers: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """In a module fixture (`yield from`): {name: make()} made in order (those made are closed if a later
    one fails to start), yielded, then all closed and checked for leaks at once, so one group's leak
    check never sees another live group's actors."""
    made: dict[str, Any] = {}
    try:
        for name, make in makers.items():
            made[name] = make()
    except BaseException:
        for engine in made.values():
            engine.close()
        raise

    def close() -> None:
        for engine in made.values():
            engine.close()

    yield from closed_without_leaks(made, close)


def submitted_together(engine: Any, requests: list[Any], timeout: float = 120) -> list[Any]:
    """Futures of `requests` admitted together (the engine paused while they arrive, so they share
    every step), all done; asserts they ran as one batch."""
    from concurrent.futures import wait

    engine.pause(mode="keep")
    futures = [engine.submit(r) for r in requests]
    engine.resume()
    wait(futures, timeout=timeout)
    assert max(f.timing()["batch_size"] for f in futures) == len(requests)
    return futures


@pytest.fixture(autouse=True)
def _ray_leak_check(request):
    """After every Ray test: zero actors of ours and zero placement groups left."""
    yield
    if not request.node.get_closest_marker("ray"):
        return
    import ray

    if not ray.is_initialized():
        return
    actors, pgs = wait_for_no_leaks()
    assert not actors, f"leaked actors: {[(a.get('ActorClassName'), a.get('State')) for a in actors]}"
    assert not pgs, f"leaked placement groups: {[(p.get('name'), p.get('state')) for p in pgs]}"
