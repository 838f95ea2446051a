"""Simulated multi-node placement with `ray.cluster_utils.Cluster` (two raylets, fake GPUs).

Run: `.venv/bin/pytest tests/test_multinode.py`. Replaces the session's Ray instance for this
module; the next Ray test starts a fresh one.
"""

from __future__ import annotations

import os

import pytest
import torch

from actors.placement_groups import bundle_nodes, create_replica_group, node_targets, remove_group
from phyai_ray import DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig, \
    ParallelConfig
from placement.bundles import plan_replicas
from tests.conftest import stop_local_ray
from tests.plugins.tiny import TinyRowTPEntry, reference

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    stop_local_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2})
    cluster.add_node(num_cpus=4, num_gpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _gpu_groups(strategy: str, spread: bool):
    plans = plan_replicas(ranks_per_replica=2, replica_count=2, use_gpu=True, strategy=strategy)
    targets = node_targets(plans, spread)
    groups = [create_replica_group(p, target_node=t, timeout_s=30, name=f"test-{p.index}")
              for p, t in zip(plans, targets)]
    try:
        return [bundle_nodes(pg) for pg in groups]
    finally:
        for pg in groups:
            remove_group(pg)


def test_strict_pack_keeps_each_gpu_replica_on_one_node_and_spread_uses_both_nodes(two_node_cluster):
    nodes = _gpu_groups("STRICT_PACK", spread=True)
    assert all(len(set(replica)) == 1 and replica[0] for replica in nodes), nodes
    assert nodes[0][0] != nodes[1][0], f"replicas share node {nodes[0][0]}"


def test_strict_spread_puts_each_rank_of_a_replica_on_its_own_node(two_node_cluster):
    nodes = _gpu_groups("STRICT_SPREAD", spread=True)
    assert all(len(set(replica)) == 2 for replica in nodes), nodes


def test_engine_replicas_land_on_different_nodes_and_compute_the_single_rank_answer(two_node_cluster):
    args = EngineArgs(plugin=TinyRowTPEntry, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    with Engine(args, DeploymentConfig.cluster(address="auto", replica_count=2)) as engine:
        assert engine.mode == "cluster"
        x = torch.randn(4, 8)
        for result in [f.result(timeout=60) for f in [engine.submit({"x": x}) for _ in range(10)]]:
            torch.testing.assert_close(result, reference(x))
        placed = [s.nodes for s in engine.replica_status()]
    assert all(len(set(n)) == 1 for n in placed), placed
    assert placed[0][0] != placed[1][0], placed
