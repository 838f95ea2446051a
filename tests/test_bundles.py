"""Bundles per replica and device assignment (`placement/bundles.py`), as tables.

Run: .venv/bin/pytest tests/test_bundles.py -q
"""

from __future__ import annotations

import pytest

from placement.bundles import ReplicaPlan, assign_devices, describe_plan, plan_replicas, rank_bundle


@pytest.mark.parametrize("devices, replicas, ranks, expected", [
    (None, 3, 2, [None, None, None]),
    ((0,), 1, 1, [(0,)]),
    ((0, 1, 2, 3), 2, 2, [(0, 1), (2, 3)]),
    ((0, 1, 2, 3), 4, 1, [(0,), (1,), (2,), (3,)]),
    ((0, 1, 2, 3), 1, 4, [(0, 1, 2, 3)]),
    ((3, 2, 7, 5, 1, 0), 3, 2, [(3, 2), (7, 5), (1, 0)]),  # order given, not sorted
])
def test_assign_devices(devices, replicas, ranks, expected):
    assert assign_devices(devices, replicas, ranks) == expected


@pytest.mark.parametrize("devices, replicas, ranks, message", [
    ((0, 1, 2), 2, 2, r"devices=\(0, 1, 2\) lists 3 devices but 2 replica\(s\) x 2 rank\(s\) need exactly 4"),
    ((0, 1, 2, 3, 4), 1, 4, "need exactly 4"),
    ((0, 0), 1, 2, r"devices=\(0, 0\) repeats a device"),
])
def test_assign_devices_errors(devices, replicas, ranks, message):
    with pytest.raises(ValueError, match=message):
        assign_devices(devices, replicas, ranks)


@pytest.mark.parametrize("use_gpu, cpus, bundle", [
    (False, 1.0, {"CPU": 1.0}),
    (False, 2, {"CPU": 2.0}),
    (True, 1.0, {"CPU": 1.0, "GPU": 1.0}),
    (True, 0.5, {"CPU": 0.5, "GPU": 1.0}),
])
def test_rank_bundle(use_gpu, cpus, bundle):
    assert rank_bundle(use_gpu, cpus) == bundle


def test_plan_two_gpu_replicas_of_two_ranks():
    plans = plan_replicas(ranks_per_replica=2, replica_count=2, use_gpu=True, devices=(0, 1, 2, 3))
    assert plans == [
        ReplicaPlan(0, ({"CPU": 1.0, "GPU": 1.0},) * 2, "STRICT_PACK", (0, 1)),
        ReplicaPlan(1, ({"CPU": 1.0, "GPU": 1.0},) * 2, "STRICT_PACK", (2, 3)),
    ]
    assert [p.world_size for p in plans] == [2, 2]
    assert describe_plan(plans) == (
        "replica 0: 2 rank(s), STRICT_PACK, bundle={'CPU': 1.0, 'GPU': 1.0} devices=[0, 1]\n"
        "replica 1: 2 rank(s), STRICT_PACK, bundle={'CPU': 1.0, 'GPU': 1.0} devices=[2, 3]")


def test_plan_cpu_replicas_without_devices():
    plans = plan_replicas(ranks_per_replica=4, replica_count=3, use_gpu=False, cpus_per_rank=2, strategy="SPREAD")
    assert [p.index for p in plans] == [0, 1, 2]
    assert all(p.bundles == ({"CPU": 2.0},) * 4 and p.strategy == "SPREAD" and p.devices is None for p in plans)
    assert "bundle={'CPU': 2.0}" in describe_plan(plans) and "devices" not in describe_plan(plans)


def test_bundles_are_independent_dicts():
    plan = plan_replicas(ranks_per_replica=2, replica_count=1, use_gpu=False)[0]
    plan.bundles[0]["CPU"] = 9.0
    assert plan.bundles[1]["CPU"] == 1.0


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "ANYWHERE"}, "placement strategy 'ANYWHERE' is not one of STRICT_PACK, PACK, SPREAD, STRICT_SPREAD"),
    ({"cpus_per_rank": 0}, "cpus_per_rank=0 leaves a CPU rank without resources"),
    ({"devices": (0,)}, "lists 1 devices but 2 replica"),
])
def test_plan_errors(kwargs, message):
    base = {"ranks_per_replica": 1, "replica_count": 2, "use_gpu": False}
    with pytest.raises(ValueError, match=message):
        plan_replicas(**{**base, **kwargs})


def test_placement_imports_no_ray():
    import subprocess
    import sys

    code = "import placement, placement.bundles, placement.topology, sys; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
