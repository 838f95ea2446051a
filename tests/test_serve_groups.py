"""Serve's control of whole groups: autoscaling 1 -> 2 -> 1 and the fewest-in-flight router (TP=1 groups).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_serve_groups.py -q

One Serve instance for the module, one app per test. The groups run their one rank inline in
the Serve replica (cheap to start). Like test_serve_http.py, the module checks for leaks itself
after `serve.shutdown()` instead of using `ray_session`.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from phyai_ray import DeploymentConfig, EngineArgs, EngineConfig
from phyai_ray.config.deployment import WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig
from tests.conftest import RAY_CPUS, wait_for_no_leaks
from tests.helpers import free_port, post_step, wait_until

PLUGIN = "tests.plugins.serve_plugins:ServeRowTPEntry"
ARGS = EngineArgs(plugin=PLUGIN, config=EngineConfig(device=DeviceConfig(target="cpu")))
SLACK_S = 0.1  # the routing approximation the test allows: a router's view lags by up to this


@pytest.fixture(scope="module")
def port() -> int:
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(num_cpus=RAY_CPUS, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        actors, groups = wait_for_no_leaks(30)
        assert not actors and not groups, f"left behind: {actors} {groups}"


def running_groups(app: str) -> int:
    from ray import serve

    states = serve.status().applications[app].deployments["ReplicaGroup"].replica_states
    return states.get("RUNNING", 0)


def test_autoscaling_adds_a_group_under_load_and_removes_it_after(port: int) -> None:
    from ray import serve

    from phyai_ray.serve import create_app

    app = create_app(ARGS, DeploymentConfig(process_config=WorkerSupervisorConfig(execution_timeout_s=30)),
                     min_replicas=1, max_replicas=2, target_ongoing_requests=1,
                     autoscaling_config={"upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
                                         "look_back_period_s": 1.0, "metrics_interval_s": 0.5})
    serve.run(app, name="autoscale", route_prefix="/autoscale")
    url = f"http://127.0.0.1:{port}/autoscale"
    try:
        assert running_groups("autoscale") == 1
        stop, statuses = threading.Event(), []

        def load() -> None:  # a slow plugin: 4 clients, each keeps one 0.4 s request in flight
            while not stop.is_set():
                statuses.append(post_step(url, {"x": torch.ones(1, 8)}, sleep_s=0.4).status_code)

        with ThreadPoolExecutor(4) as pool:
            for _ in range(4):
                pool.submit(load)
            try:
                wait_until(lambda: running_groups("autoscale") == 2, 60, "Serve to scale up to 2 groups")
            finally:
                stop.set()
        assert statuses and set(statuses) == {200}, set(statuses)
        wait_until(lambda: running_groups("autoscale") == 1, 60, "Serve to scale back to 1 group")
        assert post_step(url, {"x": torch.ones(1, 8)}).status_code == 200
    finally:
        serve.delete("autoscale")


def in_flight(records: list[dict[str, Any]], group: int, at: float, skip: int) -> int:
    """Requests of `group` sent before `at` and not yet finished then (request `skip` left out)."""
    return sum(1 for i, r in enumerate(records) if i != skip and r["group"] == group and r["sent"] < at < r["done"])


def routed_to_fewest(records: list[dict[str, Any]], i: int, groups: set[int]) -> bool:
    """At some moment within SLACK_S of its send, request i's group had no more in flight than any other."""
    sent = records[i]["sent"]
    for at in (sent - SLACK_S, sent - SLACK_S / 2, sent, sent + SLACK_S / 2, sent + SLACK_S):
        mine = in_flight(records, records[i]["group"], at, i)
        if all(mine <= in_flight(records, g, at, i) for g in groups):
            return True
    return False


def test_router_sends_each_request_to_the_group_with_fewest_in_flight(port: int) -> None:
    from ray import serve

    from phyai_ray.serve import create_app, group_handle

    serve.run(create_app(ARGS, DeploymentConfig(replica_count=3)), name="route", route_prefix="/route")
    try:
        handle = group_handle("route")
        handle.step.remote({"x": torch.ones(1, 8)}).result(timeout_s=60)  # the handle's router is up
        durations = [1.2, 0.05, 0.05, 0.6, 0.05, 0.3, 0.05, 0.9, 0.05, 0.05]
        records: list[dict[str, Any]] = []
        with ThreadPoolExecutor(40) as pool:
            waits = []
            for i in range(40):
                record = {"sent": time.monotonic()}
                response = handle.step.remote({"x": torch.ones(1, 8), "sleep_s": durations[i % len(durations)]})
                records.append(record)
                waits.append(pool.submit(_finish, response, record))
                time.sleep(0.08)
            for wait in waits:
                wait.result(timeout=60)
        groups = {r["group"] for r in records}
        assert len(groups) == 3, groups
        bad = [i for i in range(len(records)) if not routed_to_fewest(records, i, groups)]
        assert not bad, [(i, records[i]) for i in bad]
    finally:
        serve.delete("route")


def _finish(response: Any, record: dict[str, Any]) -> None:
    result = response.result(timeout_s=60)
    record["done"], record["group"] = time.monotonic(), result["pid"]
