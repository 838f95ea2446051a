"""Configuration models: validation with messages, inference of unset domains, mode selection.

Run: .venv/bin/pytest tests/test_config.py -q
"""

from __future__ import annotations

import pydantic
import pytest

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, EngineArgs,
                       EngineConfig, MoeParallelConfig, OuterParallelConfig, ParallelConfig, WorkerSupervisorConfig)
from phyai_ray.errors import DeploymentConfigError, ParallelConfigError, PhyAIError

ALL_MODELS = (ParallelConfig, OuterParallelConfig, DenseParallelConfig, AttentionParallelConfig, MoeParallelConfig,
              DeviceConfig, EngineConfig, EngineArgs, DeploymentConfig, WorkerSupervisorConfig)


# -- ParallelConfig -------------------------------------------------------------------------------

def test_default_is_one_rank_everywhere():
    p = ParallelConfig()
    assert p.infer_replica_world_size() == 1
    assert (p.dense.tp_size, p.dense.dp_size) == (1, 1)
    assert p.attention.ranks() == p.moe.ranks() == 1
    assert p.split_axes() == {}


def test_mismatched_domains_name_their_products():
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=4))
    msg = str(info.value)
    assert "dense=2*1=2 (tp*dp)" in msg
    assert "attention=4*1*1=4 (tp*cp*dp)" in msg
    assert "inferred as data-parallel" in msg  # the hint


def test_three_way_mismatch_names_all_three():
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(cp_size=2),
                       moe=MoeParallelConfig(ep_size=4))
    msg = str(info.value)
    assert "dense=2*1=2" in msg and "attention=1*2*1=2" in msg and "moe=1*4*1=4 (tp*ep*dp)" in msg


def test_config_errors_are_phyai_and_value_errors():
    with pytest.raises(PhyAIError):
        ParallelConfig(dense=DenseParallelConfig(tp_size=2), moe=MoeParallelConfig(tp_size=3))
    with pytest.raises(ValueError):
        ParallelConfig(dense=DenseParallelConfig(tp_size=2), moe=MoeParallelConfig(tp_size=3))


def test_nested_mismatch_raises_the_same_error():
    with pytest.raises(ParallelConfigError, match="dense=2"):
        EngineConfig(parallel={"dense": {"tp_size": 2}, "attention": {"tp_size": 4}})


@pytest.mark.parametrize("given, dense, attention, moe", [
    ({"dense": DenseParallelConfig(tp_size=2)}, (2, 1), (1, 1, 2), (1, 1, 2)),
    ({"attention": AttentionParallelConfig(cp_size=4)}, (1, 4), (1, 4, 1), (1, 1, 4)),
    ({"moe": MoeParallelConfig(ep_size=2, tp_size=2)}, (1, 4), (1, 1, 4), (2, 2, 1)),
    ({"dense": DenseParallelConfig(tp_size=2), "attention": AttentionParallelConfig(tp_size=2)},
     (2, 1), (2, 1, 1), (1, 1, 2)),
])
def test_unset_domains_are_inferred_as_dp(given, dense, attention, moe):
    p = ParallelConfig(**given)
    assert (p.dense.tp_size, p.dense.dp_size) == dense
    assert (p.attention.tp_size, p.attention.cp_size, p.attention.dp_size) == attention
    assert (p.moe.tp_size, p.moe.ep_size, p.moe.dp_size) == moe
    assert p.explicit_domains == frozenset(given)


def test_explicit_none_counts_as_unset():
    p = ParallelConfig(dense=None, attention=AttentionParallelConfig(tp_size=2))
    assert p.dense.dp_size == 2
    assert p.explicit_domains == frozenset({"attention"})
    assert p.split_axes() == {"attention_tp": 2}


@pytest.mark.parametrize("outer, dense, world", [
    ((1, 1), 1, 1), ((4, 1), 2, 8), ((2, 2), 2, 8), ((3, 2), 4, 24), ((1, 2), 1, 2)])
def test_infer_replica_world_size(outer, dense, world):
    p = ParallelConfig(outer=OuterParallelConfig(pp_size=outer[0], cfg_size=outer[1]),
                       dense=DenseParallelConfig(tp_size=dense))
    assert p.infer_replica_world_size() == world == outer[0] * outer[1] * p.domain_ranks


def test_split_axes_leaves_out_inferred_dp_only():
    p = ParallelConfig(outer=OuterParallelConfig(pp_size=2), dense=DenseParallelConfig(tp_size=2, dp_size=2),
                       attention=AttentionParallelConfig(tp_size=4))
    assert p.split_axes() == {"pp": 2, "dense_tp": 2, "dense_dp": 2, "attention_tp": 4}


def test_describe_is_one_line_with_world_size():
    p = ParallelConfig(outer=OuterParallelConfig(pp_size=2), dense=DenseParallelConfig(tp_size=2))
    assert p.describe() == ("pp=2 cfg=1 dense(tp=2,dp=1) attention(tp=1,cp=1,dp=2) moe(tp=1,ep=1,dp=2) -> 4 ranks")


@pytest.mark.parametrize("model, kwargs", [
    (ParallelConfig, {"tp_size": 2}),
    (DenseParallelConfig, {"cp_size": 2}),
    (OuterParallelConfig, {"pipeline": 2}),
    (DeviceConfig, {"device": "cuda"}),
    (EngineConfig, {"replica_count": 2}),
    (EngineArgs, {"plugin": "x", "replicas": 2}),
    (DeploymentConfig, {"replicas": 2}),
    (WorkerSupervisorConfig, {"timeout": 1}),
])
def test_unknown_fields_are_rejected(model, kwargs):
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        model(**kwargs)


@pytest.mark.parametrize("build", [
    lambda: OuterParallelConfig(cfg_size=3),
    lambda: OuterParallelConfig(pp_size=0),
    lambda: DenseParallelConfig(tp_size=0),
    lambda: AttentionParallelConfig(cp_size=-1),
    lambda: MoeParallelConfig(ep_size=5000),
    lambda: DeviceConfig(target="tpu"),
    lambda: DeviceConfig(params_dtype="int8"),
    lambda: WorkerSupervisorConfig(execution_timeout_s=0),
    lambda: WorkerSupervisorConfig(base_port=80),
    lambda: DeploymentConfig(replica_count=0),
    lambda: DeploymentConfig(placement_strategy="RANDOM"),
])
def test_out_of_range_values_are_rejected(build):
    with pytest.raises(ValueError):
        build()


@pytest.mark.parametrize("obj, field, value", [
    (ParallelConfig(), "dense", DenseParallelConfig(tp_size=2)),
    (DenseParallelConfig(), "tp_size", 2),
    (OuterParallelConfig(), "pp_size", 2),
    (DeviceConfig(), "target", "cuda"),
    (EngineConfig(), "device", DeviceConfig()),
    (EngineArgs(plugin="x"), "plugin", "y"),
    (DeploymentConfig(), "replica_count", 3),
    (WorkerSupervisorConfig(), "execution_timeout_s", 1.0),
])
def test_configs_are_frozen(obj, field, value):
    before = getattr(obj, field)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        setattr(obj, field, value)
    assert getattr(obj, field) == before


def _all_fields(model: type[pydantic.BaseModel]):
    for name, field in model.model_fields.items():
        yield f"{model.__name__}.{name}", field


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.__name__)
def test_every_field_is_documented(model):
    missing = [name for name, field in _all_fields(model) if not (field.description or "").strip()]
    assert not missing, f"fields without a description: {missing}"
    assert model.model_fields, f"{model.__name__} has no fields"


def test_engine_args_nest_and_default():
    args = EngineArgs(plugin="tiny_row_tp", plugin_args={"in_features": 4},
                      config={"device": {"target": "cpu"}, "parallel": {"dense": {"tp_size": 2}}})
    assert args.config.device.target == "cpu"
    assert args.config.parallel.infer_replica_world_size() == 2
    assert EngineArgs(plugin="x").config.parallel.infer_replica_world_size() == 1
    with pytest.raises(ValueError, match="plugin"):
        EngineArgs()


def test_device_config_resolution():
    assert DeviceConfig(target="auto").resolve_target(cuda_available=True) == "cuda"
    assert DeviceConfig(target="auto").resolve_target(cuda_available=False) == "cpu"
    assert DeviceConfig(target="cpu").resolve_target(cuda_available=True) == "cpu"
    import torch
    assert DeviceConfig(params_dtype="bfloat16").torch_dtype() is torch.bfloat16


# -- DeploymentConfig: the mode table -------------------------------------------------------------

@pytest.mark.parametrize("deployment, ranks, mode", [
    (DeploymentConfig(), 1, "inline"),
    (DeploymentConfig(), 2, "local"),
    (DeploymentConfig(replica_count=2), 1, "local"),
    (DeploymentConfig(devices=(0,)), 1, "local"),
    (DeploymentConfig(address="ray://head:10001"), 1, "cluster"),
    (DeploymentConfig.local(), 1, "local"),
    (DeploymentConfig.local(devices=(0, 1, 2, 3), replica_count=2), 2, "local"),
    (DeploymentConfig.cluster(address="auto", replica_count=3), 4, "cluster"),
    (DeploymentConfig.external(), 1, "external"),
    (DeploymentConfig.external(), 8, "external"),
    (DeploymentConfig(mode="inline"), 1, "inline"),
])
def test_mode_table(deployment, ranks, mode):
    assert deployment.resolve_mode(ranks) == mode


def test_inline_with_several_ranks_is_an_error():
    with pytest.raises(DeploymentConfigError, match="needs 2 ranks per replica"):
        DeploymentConfig(mode="inline").resolve_mode(2)


@pytest.mark.parametrize("kwargs, message", [
    ({"devices": ()}, "lists no device"),
    ({"devices": (0, 0)}, r"devices=\(0, 0\) must be distinct"),
    ({"devices": (-1, 0)}, "non-negative"),
    ({"mode": "inline", "replica_count": 2}, "runs exactly one replica, got replica_count=2"),
    ({"mode": "external", "replica_count": 2}, "runs exactly one replica"),
    ({"mode": "inline", "devices": (0,)}, "needs managed workers"),
    ({"mode": "external", "devices": (0, 1)}, "needs managed workers"),
    ({"mode": "local", "address": "auto"}, "only applies to mode='cluster'"),
])
def test_bad_deployments_say_why(kwargs, message):
    with pytest.raises(DeploymentConfigError, match=message):
        DeploymentConfig(**kwargs)


def test_local_builder_carries_process_config():
    proc = WorkerSupervisorConfig(base_port=29500, execution_timeout_s=5)
    d = DeploymentConfig.local(devices=(0, 1, 2, 3), replica_count=2, process_config=proc)
    assert (d.mode, d.devices, d.replica_count, d.process_config.base_port) == ("local", (0, 1, 2, 3), 2, 29500)
    assert d.process_config.execution_timeout_s == 5
    assert DeploymentConfig.cluster().address == "auto"


@pytest.mark.parametrize("devices, replicas, ranks", [((0, 1, 2), 2, 1), ((0, 1), 1, 4), ((0,), 2, 1)])
def test_device_count_checked_with_the_topology(devices, replicas, ranks):
    d = DeploymentConfig(devices=devices, replica_count=replicas)
    with pytest.raises(DeploymentConfigError, match=f"lists {len(devices)} devices but {replicas} replica\\(s\\) x "
                                                    f"{ranks} rank\\(s\\) need exactly {replicas * ranks}"):
        d.resolve_mode(ranks)
    assert DeploymentConfig(devices=tuple(range(replicas * ranks)), replica_count=replicas).resolve_mode(ranks) \
        == "local"
