"""`cluster.yaml` is a tested artifact: it must pass Ray's own cluster-launcher schema.

Run: .venv/bin/pytest tests/test_cluster_yaml.py -q
Nothing here starts Ray or talks to a cloud; it is the check `ray up` runs before launching.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster.yaml"


def ray_schema_path() -> Path:
    """ray/autoscaler/ray-schema.json of the installed Ray, found without importing Ray."""
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None, "ray is not installed in this environment"
    path = Path(spec.origin).parent / "autoscaler" / "ray-schema.json"
    assert path.is_file(), f"Ray's cluster schema is missing at {path}; the installed ray has moved it"
    return path


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(ray_schema_path().read_text())


def test_cluster_yaml_matches_rays_schema(config, schema) -> None:
    jsonschema.validate(config, schema)


def test_cluster_yaml_survives_rays_own_prepare_and_validate(config) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_schema_check_is_real(config, schema) -> None:
    broken = copy.deepcopy(config)
    broken["head_start_ray_command"] = ["typo of a known key"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu.head"]["resources"]["GPU"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_head_and_workers_have_gpus(config) -> None:
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"].get("GPU", 0) >= 1
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert workers and all(t["resources"].get("GPU", 0) >= 1 for t in workers)
    assert sum(t.get("min_workers", 0) for t in workers) <= config["max_workers"]


def test_nodes_install_this_package_and_start_ray(config) -> None:
    setup = " ".join(config["setup_commands"])
    assert "pip install -e ~/phyai-ray" in setup
    assert config["file_mounts"]["~/phyai-ray"] == "."
    assert (ROOT / "pyproject.toml").is_file()  # "." is the repository root when `ray up` runs from it
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in config["worker_start_ray_commands"])
