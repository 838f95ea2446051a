"""Replica ranks in a placement group someone else owns (`DeploymentConfig(placement=PlacementSpec(...))`).

Run: `.venv/bin/pytest tests/test_placement_spec.py`
"""

from __future__ import annotations

import pytest
import torch

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeploymentConfigError, DeviceConfig, Engine, EngineArgs,
                       EngineConfig, ParallelConfig, PlacementSpec)
from tests.conftest import live_actors
from tests.plugins.tiny import TinyRowTPEntry, reference


def _args(tp: int) -> EngineArgs:
    return EngineArgs(plugin=TinyRowTPEntry, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=tp))))


class _FakeGroup:
    """Stands in for a PlacementGroup in pure validation tests (bundle_specs and id are all they read)."""

    def __init__(self, bundles: int) -> None:
        self.bundle_specs = [{"CPU": 1}] * bundles
        self.id = "fake"


def test_spec_validation_names_the_values():
    with pytest.raises(DeploymentConfigError, match=r"bundle_indices=\(0, 3\) must be distinct indices into the "
                                                    r"placement group's 3 bundle"):
        PlacementSpec(_FakeGroup(3), (0, 3))
    with pytest.raises(DeploymentConfigError, match="is not a Ray PlacementGroup"):
        PlacementSpec(object(), (0,))
    spec = PlacementSpec(_FakeGroup(3), (1, 2))
    with pytest.raises(DeploymentConfigError, match=r"lists 1 PlacementSpec\(s\) but replica_count=2"):
        DeploymentConfig(placement=spec, replica_count=2)
    with pytest.raises(DeploymentConfigError, match="mode='inline' has none"):
        DeploymentConfig(mode="inline", placement=spec)
    with pytest.raises(DeploymentConfigError, match=r"name 2 bundle\(s\) but the parallel config needs 4"):
        DeploymentConfig(placement=spec).resolve_mode(4)
    assert DeploymentConfig(placement=spec).resolve_mode(2) == "local"


def test_replica_runs_in_the_owners_bundles_and_leaves_the_group(ray_session):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 0.5}] * 3, strategy="PACK", name="owner-phyai-test")
    ray.get(pg.ready(), timeout=30)
    try:
        deployment = DeploymentConfig(placement=PlacementSpec(pg, (2, 0)), cpus_per_rank=0.5)
        with Engine(_args(2), deployment) as engine:
            x = torch.randn(3, 8)
            torch.testing.assert_close(engine.step({"x": x}), reference(x))
            assert {i.placement_group_id for i in engine._executors[0].ranks.group.infos} == {pg.id.hex()}
        state = ray.util.placement_group_table(pg)["state"]
        assert state == "CREATED"  # the owner's group stays; only our ranks are gone
        assert not [a for a in live_actors() if "Rank" in (a.get("ActorClassName") or "")]
    finally:
        remove_placement_group(pg)
