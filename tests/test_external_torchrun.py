"""External mode: a real `torchrun --nproc_per_node=2` (CPU, gloo) serving a TP=2 plugin.

The TP=2 result must equal the single-rank (inline) result; the non-output rank returns None.
Launcher errors (missing variables, a WORLD_SIZE that is not the config's) are clear and raised
before anything starts.

Run: flock /tmp/phyai-ray-test.lock .venv/bin/pytest tests/test_external_torchrun.py -q
"""

from __future__ import annotations

import threading

import pytest
import torch

from phyai_ray import DeploymentConfig, Engine
from phyai_ray.errors import DeploymentConfigError
from phyai_ray.executors.external import check_world, launcher_env
from placement.topology import Topology
from tests.plugins.tiny import reference
from tests.scripts.external_engine import REQUESTS, args
from tests.scripts.launch import torchrun_json

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("external")
    return torchrun_json("tests.scripts.external_engine", out, "rank{rank}.json", timeout_s=120)


@pytest.mark.torchrun
def test_tp2_result_equals_inline_and_only_output_rank_returns(ranks):
    with Engine(args(1)) as inline:
        assert inline.mode == "inline"
        expected = [inline.step(r) for r in REQUESTS]
    for r, e in zip(REQUESTS, expected):
        assert torch.equal(e, reference(r["x"]))
    assert [o["mode"] for o in ranks] == ["external", "external"]
    assert [o["world_size"] for o in ranks] == [2, 2]
    for got, want in zip(ranks[0]["results"], expected):
        assert torch.equal(torch.tensor(got), want)
    assert ranks[1]["results"] == [None, None]


@pytest.mark.torchrun
def test_each_rank_holds_its_shard(ranks):
    assert ranks[0]["shard"] == [{"rank": 0, "cols": [0, 4], "tp_rank": 0, "tp": 2}]
    assert ranks[1]["shard"] == [{"rank": 1, "cols": [4, 8], "tp_rank": 1, "tp": 2}]


@pytest.mark.torchrun
def test_plugin_error_passes_through_and_rank_stays_healthy(ranks):
    for o in ranks:
        assert o["bad_request"] in ("TypeError", "ValueError", "RuntimeError")
        assert o["healthy_after_bad"] is True


@pytest.mark.torchrun
def test_world_size_mismatch_under_torchrun(ranks):
    for o in ranks:
        assert o["wrong_world"].startswith("DeploymentConfigError: the launcher started WORLD_SIZE=2 processes "
                                           "but the parallel config needs 4 ranks per replica")


# -- launcher errors, in this process ---------------------------------------------------------------


@pytest.fixture
def no_launcher(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_missing_launcher_vars_are_named(no_launcher):
    threads = threading.active_count()
    with pytest.raises(DeploymentConfigError) as info:
        Engine(args(2), DeploymentConfig.external())
    assert "needs the launcher's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in str(info.value)
    assert "torchrun --nproc_per_node=2" in str(info.value)
    assert threading.active_count() == threads


def test_partly_missing_launcher_vars(no_launcher):
    no_launcher.setenv("RANK", "0")
    no_launcher.setenv("WORLD_SIZE", "2")
    with pytest.raises(DeploymentConfigError, match="needs the launcher's LOCAL_RANK, MASTER_ADDR, MASTER_PORT in"):
        Engine(args(2), DeploymentConfig.external())


def test_world_size_mismatch_in_process(no_launcher):
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        no_launcher.setenv(k, v)
    threads = threading.active_count()
    with pytest.raises(DeploymentConfigError, match="WORLD_SIZE=3 processes but the parallel config needs 2 ranks"):
        Engine(args(2), DeploymentConfig.external())
    assert threading.active_count() == threads


def test_launcher_helpers_are_pure():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500", "X": "y"}
    assert launcher_env(env) == {k: env[k] for k in LAUNCHER_VARS}
    topology = Topology.from_parallel(args(2).config.parallel)
    assert check_world(topology, launcher_env(env)) == 1
