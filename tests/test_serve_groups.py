"""Serve's control of whole groups: autoscaling 1 -> 2 -> 1 and the fewest-in-flight router (TP=1 groups).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_serve_groups.py -q

One app per test on the session's Serve instance. The groups run their one rank inline in
the Serve replica (cheap to start). Like test_serve_http.py, the module checks for leaks itself
after deleting its apps, instead of using `ray_session`.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from phyai_ray import DeploymentConfig, EngineArgs, EngineConfig
from phyai_ray.config.deployment import WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig
from tests.conftest import closed_without_leaks, delete_serve_apps, shared_serve
from tests.helpers import post_step, wait_until

PLUGIN = "tests.plugins.serve_plugins:ServeRowTPEntry"
LONG_S = 8.0  # longer than choosing every request the router test compares, on a loaded machine
ARGS = EngineArgs(plugin=PLUGIN, config=EngineConfig(device=DeviceConfig(target="cpu")))


@pytest.fixture(scope="module")
def port() -> int:
    from ray import serve

    port = shared_serve()["port"]
    yield from closed_without_leaks(port, delete_serve_apps)


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


def handle_router(app: str) -> Any:
    """The request router of this process's handles of `app` (Serve makes it on the first request)."""
    import gc

    found = [o for o in gc.get_objects() if type(o).__name__ == "FewestInFlightRouter"
             and o._deployment_id.app_name == app]
    assert len(found) == 1, f"{len(found)} routers of app {app!r} in this process"
    return found[0]


def test_router_sends_each_request_to_the_group_with_fewest_in_flight(port: int) -> None:
    """Deterministic by construction: each request is chosen while those it is compared with still run
    (LONG_S), and the one completion the test relies on is awaited in the router's own count."""
    from ray import serve

    from phyai_ray.serve import create_app, group_handle

    serve.run(create_app(ARGS, DeploymentConfig(replica_count=3)), name="route", route_prefix="/route")
    try:
        handle = group_handle("route")
        handle.step.remote({"x": torch.ones(1, 8)}).result(timeout_s=60)  # the handle's router is up
        router = handle_router("route")

        def counted() -> int:
            return sum(router.in_flight(r) for r in list(router.curr_replicas))

        def send(sleep_s: float) -> Any:
            return handle.step.remote({"x": torch.ones(1, 8), "sleep_s": sleep_s})

        wait_until(lambda: counted() == 0, 10, "the warm-up request to leave the router's count")
        short, *first = [send(0.2), send(LONG_S), send(LONG_S)]  # three idle groups: one each
        spared = short.result(timeout_s=60)["pid"]
        wait_until(lambda: counted() == 2, 10, "the router to count the short request's completion")
        after_short = send(LONG_S)  # the short one's group is the only one with nothing in flight
        burst = [send(1.0) for _ in range(3)]  # then 1 / 1 / 1 in flight: one more each
        first_pids = [r.result(timeout_s=60)["pid"] for r in first]
        assert len(set(first_pids)) == 2 and spared not in first_pids, (spared, first_pids)
        assert after_short.result(timeout_s=60)["pid"] == spared
        assert sorted(r.result(timeout_s=60)["pid"] for r in burst) == sorted([spared, *first_pids])
    finally:
        serve.delete("route")


def test_streamed_completions_reach_a_healthy_group_after_a_rank_is_killed(port: int) -> None:
    """2 groups x TP=2 of reference_lm. Once a killed rank has failed its group, every new streamed
    completion succeeds: the router skips the failed group, or the failed group, refusing the stream
    at open (nothing ran), forwards it to the healthy one. Tokens equal a completion made before."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import openai
    import requests
    from ray import serve

    from phyai_ray import AttentionParallelConfig, DenseParallelConfig, ParallelConfig
    from phyai_ray.serve import create_app

    lm = EngineArgs(plugin="reference_lm", plugin_args={"seed": 0}, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2),
                                                                   attention=AttentionParallelConfig(tp_size=2))))
    deployment = DeploymentConfig.local(replica_count=2, cpus_per_rank=0.5, process_config=WorkerSupervisorConfig(
        startup_timeout_s=120, execution_timeout_s=30))
    serve.run(create_app(lm, deployment), name="lmstreams", route_prefix="/lm")
    try:
        base = f"http://127.0.0.1:{port}/lm"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        body = dict(model="reference_lm", prompt=[1, 2, 3], max_tokens=8, temperature=0)
        want = client.completions.create(**body).choices[0].token_ids

        def streamed(_: int) -> list[int]:
            events = list(client.completions.create(**body, stream=True))  # an error event raises here
            return [t for e in events for c in e.choices for t in c.token_ids]

        assert streamed(0) == want
        victim = requests.get(f"{base}/v1/replicas", timeout=30).json()["replicas"][0]
        os.kill(victim["pids"][1], signal.SIGKILL)

        def victim_failed() -> bool:
            groups = requests.get(f"{base}/v1/replicas", timeout=30).json()["replicas"]
            return any(g["group"] == victim["group"] and g["state"] == "failed" for g in groups)

        wait_until(victim_failed, 30, "the killed rank's group to report itself failed")
        with ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(streamed, range(12)))
        assert outs == [want] * 12
    finally:
        serve.delete("lmstreams")
