"""Every named layout of the reference plugin reproduces the single-rank logits (float32, rel. err <= 1e-5).

The 2-rank layouts run under a real torchrun (external mode, one launch for all of them) and as
Ray replicas (local mode); the 4- and 8-rank layouts run as Ray replicas.

Run: flock /tmp/phyai-ray-test.lock .venv/bin/pytest tests/test_reference_dit_parallel.py -q
"""

from __future__ import annotations

import pytest
import torch

from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig
from phyai_ray.models.reference_dit.layouts import LAYOUTS, sample_requests
from tests.scripts.launch import describe, torchrun

TOLERANCE = 1e-5
TWO_RANK = [n for n, p in LAYOUTS.items() if p.infer_replica_world_size() == 2]
MANY_RANK = [n for n, p in LAYOUTS.items() if p.infer_replica_world_size() > 2]


def engine_args(layout: str) -> EngineArgs:
    config = EngineConfig(device=DeviceConfig(target="cpu"), parallel=LAYOUTS[layout])
    return EngineArgs(plugin="reference_dit", plugin_args={"seed": 0}, config=config)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def assert_matches(layout: str, got: list, expected: list) -> None:
    assert len(got) == len(expected), layout
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == torch.float32 and g.shape == e.shape, (layout, i, g.dtype, g.shape)
        err = relative_error(g, e)
        assert err <= TOLERANCE, f"{layout}: request {i} relative error {err:.2e} > {TOLERANCE}"


@pytest.fixture(scope="module")
def expected() -> list[torch.Tensor]:
    with Engine(engine_args("single")) as engine:
        assert engine.mode == "inline"
        return [engine.step(r) for r in sample_requests()]


def test_matrix_covers_the_acceptance_cases():
    assert {"tp2", "cp2", "adp2_ep2", "ep2", "moe_tp2", "pp2", "cfg2"} <= set(TWO_RANK)
    assert {"tp2_cfg2", "pp2_tp2", "pp2_cfg2_tp2"} <= set(MANY_RANK)
    assert LAYOUTS["pp2_cfg2_tp2"].infer_replica_world_size() == 8


@pytest.mark.torchrun
def test_two_rank_layouts_under_torchrun(expected, tmp_path):
    proc = torchrun("examples.reference_torchrun", ["--layout", ",".join(TWO_RANK), "--out", str(tmp_path)],
                    nproc=2, timeout_s=120)
    assert proc.returncode == 0, describe(proc)
    for layout in TWO_RANK:
        assert_matches(layout, torch.load(tmp_path / f"{layout}.pt"), expected)
    assert "rank 1: pp2" in proc.stdout, describe(proc)  # the output rank of PP2 is the last stage's


@pytest.mark.ray
@pytest.mark.parametrize("layout", TWO_RANK + MANY_RANK)
def test_layout_as_ray_replica(layout, expected, ray_session):
    with Engine(engine_args(layout), DeploymentConfig.local()) as engine:
        assert engine.mode == "local"
        futures = [engine.submit(r) for r in sample_requests()]
        got = [f.result(timeout=120) for f in futures]
    assert_matches(layout, got, expected)


@pytest.mark.ray
def test_ray_example_with_two_replicas(ray_session, capsys):
    from examples.reference_ray_local import main

    assert main(["--layout", "cfg2", "--replicas", "2"]) <= TOLERANCE
    assert "cfg2 on Ray: logits (4, 8, 128)" in capsys.readouterr().out
