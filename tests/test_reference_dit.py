"""The reference plugin on one rank: determinism, the math, guidance, request and topology checks.

Run: .venv/bin/pytest tests/test_reference_dit.py -q   (no Ray, no torchrun; a few seconds)
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                       EngineArgs, EngineConfig, MoeParallelConfig, OuterParallelConfig, ParallelConfig)
from phyai_ray.errors import ParallelConfigError, RequestRejectedError
from phyai_ray.process_groups import GroupSet
from phyai_ray.models.reference_dit import ReferenceDiTConfig, ReferenceDiTEntry, ReferenceDiTRequest
from phyai_ray.nn import weights as W
from phyai_ray.models.reference_dit.layouts import LAYOUTS, sample_requests
from phyai_ray.plugins.context import RankContext
from phyai_ray.plugins.registry import resolve_plugin
from placement.topology import Topology

SMALL = {"seed": 3, "dim": 32, "heads": 4, "layers": 2, "experts": 4, "top_k": 2, "vocab": 50, "classes": 5}


def run(requests, plugin_args=None, dtype="float32"):
    config = EngineConfig(device=DeviceConfig(target="cpu", params_dtype=dtype))
    with Engine(EngineArgs(plugin="reference_dit", plugin_args=plugin_args or {}, config=config)) as engine:
        assert engine.mode == "inline"
        return [engine.step(r) for r in requests]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# -- an independent, textbook forward pass over the same seeded weights -------------------------------

def naive_branch(cfg: ReferenceDiTConfig, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    emb = W.embedding_weights(cfg)
    x = emb["tokens"][tokens] + emb["positions"][: tokens.shape[1]] + emb["labels"][labels][:, None]
    for i in range(cfg.layers):
        w = W.block_weights(cfg, i)
        x = x + naive_attention(cfg, w, F.layer_norm(x, (cfg.dim,)))
        h = F.layer_norm(x, (cfg.dim,))
        x = x + (naive_moe(cfg, w, h) if cfg.is_moe_block(i) else naive_mlp(w, h))
    head = W.head_weights(cfg)
    return F.linear(F.layer_norm(x, (cfg.dim,)), head["w"], head["b"])


def naive_attention(cfg, w, h):
    b, s, _ = h.shape
    q, k, v = (F.linear(h, w[n]).view(b, s, cfg.heads, cfg.head_dim).transpose(1, 2) for n in ("wq", "wk", "wv"))
    a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, cfg.dim)
    return F.linear(a, w["wo"], w["bo"])


def naive_mlp(w, h):
    return F.linear(F.gelu(F.linear(h, w["w1"], w["b1"])), w["w2"], w["b2"])


def naive_moe(cfg, w, h):
    """Every expert on every token, then the top-k gates (zero elsewhere) mix them."""
    probs = (h @ w["router"].T).softmax(-1)
    top, idx = probs.topk(cfg.top_k, -1)
    gates = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))  # [b, s, E]
    hidden = F.gelu(torch.einsum("bsd,ehd->bseh", h, w["w1"]) + w["b1"])
    experts = torch.einsum("bseh,edh->bsed", hidden, w["w2"]) + w["b2"]
    return (gates[..., None] * experts).sum(-2)


def test_single_rank_equals_the_textbook_forward_with_guidance():
    cfg = ReferenceDiTConfig(**SMALL)
    tokens = torch.randint(0, cfg.vocab, (3, 6), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 4, 2])
    cond, uncond = naive_branch(cfg, tokens, labels), naive_branch(cfg, tokens, torch.full((3,), cfg.classes))
    [got] = run([{"tokens": tokens, "labels": labels, "guidance_scale": 2.5}], SMALL)
    assert rel(got, uncond + 2.5 * (cond - uncond)) <= 1e-5
    assert rel(cond, uncond) > 1e-2  # the condition matters


def test_same_seed_same_logits_other_seed_other_logits():
    requests = sample_requests()
    first, second = run(requests), run(requests)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
        assert a.dtype == torch.float32 and a.shape == (4, 8, 128)
    assert rel(run(requests[:1], {"seed": 1})[0], first[0]) > 0.1


def test_json_lists_equal_tensors_and_guidance_is_linear_in_the_scale():
    tokens = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    base = {"tokens": tokens, "labels": [1, 7]}
    listed = {"tokens": tokens.tolist(), "labels": torch.tensor([1, 7])}
    out0, out1, out3, plain, as_list = run([{**base, "guidance_scale": s} for s in (0.0, 1.0, 3.0)]
                                           + [base, {**listed, "guidance_scale": 3.0}])
    assert torch.equal(out3, as_list)
    assert rel(out1, plain) <= 1e-5  # scale 1 is the conditional branch alone
    assert rel(out3, out0 + 3.0 * (out1 - out0)) <= 1e-5


def test_bfloat16_params_still_return_float32_logits():
    request = sample_requests()[0]
    [full], [half] = run([request]), run([request], dtype="bfloat16")
    assert half.dtype == torch.float32
    assert rel(half, full) < 0.1


def test_plugin_resolves_by_name_and_describes_its_request():
    entry = resolve_plugin("reference_dit")
    assert isinstance(entry, ReferenceDiTEntry)
    assert entry.parallel_domains == {"dense", "attention", "moe", "pipeline", "cfg"}
    body = ReferenceDiTRequest.model_validate({"tokens": [[1, 2]], "guidance_scale": 4})
    assert body.guidance_scale == 4.0 and body.labels is None
    assert set(ReferenceDiTRequest.model_json_schema()["properties"]) == {"tokens", "labels", "guidance_scale"}
    [out] = run([body.model_dump()])
    assert out.shape == (1, 2, 128)


# -- request checks (in the dispatcher, before any rank) ---------------------------------------------

BAD_REQUESTS = [
    ([[1, 2]], TypeError, "expects a dict"),
    ({"x": [[1]]}, ValueError, r"unknown request keys \['x'\]"),
    ({"labels": [1]}, ValueError, "no 'tokens'"),
    ({"tokens": [[1, 2], [3]]}, TypeError, "rectangular nested list"),
    ({"tokens": torch.zeros(2, 3)}, TypeError, "must hold integers, got a torch.float32"),
    ({"tokens": [1, 2, 3]}, ValueError, r"shape \[B, S\] .* got \[3\]"),
    ({"tokens": [[]]}, ValueError, r"got \[1, 0\]"),
    ({"tokens": [[1, 128]]}, ValueError, r"\[0, 128\) \(vocab=128\), got min 1, max 128"),
    ({"tokens": [[-1, 2]]}, ValueError, "got min -1, max 2"),
    ({"tokens": [[1] * 65]}, ValueError, "sequence length 65 > max_seq=64"),
    ({"tokens": [[1], [2]], "labels": [1]}, ValueError, "labels has 1 entries but tokens has batch 2"),
    ({"tokens": [[1]], "labels": [10]}, ValueError, r"\(classes=10\), got min 10, max 10"),
    ({"tokens": [[1]], "guidance_scale": float("nan")}, ValueError, "guidance_scale must be a finite number"),
    ({"tokens": [[1]], "guidance_scale": "4"}, ValueError, "guidance_scale must be a finite number"),
]


@pytest.fixture(scope="module")
def checked_engine():
    """An engine whose entry knows the plugin_args, so the dispatcher checks vocab/classes/max_seq too."""
    with Engine(EngineArgs(plugin=ReferenceDiTEntry({}), plugin_args={})) as engine:
        yield engine


@pytest.mark.parametrize("request_, error, message", BAD_REQUESTS)
def test_bad_request_is_rejected_by_the_engine_with_the_values(request_, error, message, checked_engine):
    with pytest.raises(RequestRejectedError, match=message) as info:
        checked_engine.submit(request_)
    assert type(info.value.__cause__) is error and info.value.plugin == "reference_dit"
    assert checked_engine.replica_status()[0].healthy


def test_engine_configures_the_entry_so_the_dispatcher_checks_the_real_shape():
    with Engine(EngineArgs(plugin="reference_dit", plugin_args={"vocab": 16})) as engine:
        with pytest.raises(ValueError, match=re.escape("[0, 16) (vocab=16), got min 3, max 16")):
            engine.submit({"tokens": [[3, 16]]})  # rejected before the rank sees it
        with pytest.raises(ValueError, match="got min -1"):
            engine.submit({"tokens": [[-1]]})
        assert engine.step({"tokens": [[3, 15]]}).shape == (1, 2, 16)
        assert engine.replica_status()[0].errored == 0


@pytest.mark.parametrize("layout, shape, message", [
    ("adp2_ep2", (3, 8), "batch 3 is not divisible by attention.dp_size=2"),
    ("dp2", (5, 8), "batch 5 is not divisible by dense.dp_size=2; batch 5 is not divisible by moe.dp_size=2"),
    ("cp2", (2, 7), "sequence 7 is not divisible by attention.cp_size=2"),
])
def test_request_that_does_not_split_over_the_topology_is_rejected(layout, shape, message):
    entry = ReferenceDiTEntry()
    entry.check_parallel(LAYOUTS[layout])
    with pytest.raises(ValueError, match=re.escape(message)):
        entry.validate_request({"tokens": torch.zeros(shape, dtype=torch.int64)})
    entry.validate_request({"tokens": torch.zeros(4, 8, dtype=torch.int64)})


# -- topology checks (before any worker starts) ------------------------------------------------------

BAD_TOPOLOGIES = [
    (ParallelConfig(attention=AttentionParallelConfig(tp_size=8)), "heads=4 is not divisible by attention.tp_size=8"),
    (ParallelConfig(dense=DenseParallelConfig(tp_size=3)),
     "hidden (mlp_ratio * dim)=256 is not divisible by dense.tp_size=3"),
    (ParallelConfig(moe=MoeParallelConfig(ep_size=8)), "experts=4 is not divisible by moe.ep_size=8"),
    (ParallelConfig(moe=MoeParallelConfig(tp_size=3)), "expert_hidden=128 is not divisible by moe.tp_size=3"),
    (ParallelConfig(outer=OuterParallelConfig(pp_size=3)), "layers=4 is not divisible by outer.pp_size=3"),
]


@pytest.mark.parametrize("parallel, message", BAD_TOPOLOGIES)
@pytest.mark.parametrize("deployment", [DeploymentConfig.external(), DeploymentConfig.local()], ids=["external",
                                                                                                     "local"])
def test_invalid_topology_fails_before_any_worker_starts(parallel, message, deployment):
    """External mode would fail on the missing launcher and local mode would start Ray: neither happens."""
    plugin_args = {"seed": 0}
    args = EngineArgs(plugin=ReferenceDiTEntry(plugin_args), plugin_args=plugin_args,
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))
    with pytest.raises(ParallelConfigError, match=re.escape(message)):
        Engine(args, deployment)


def test_shape_from_plugin_args_decides_and_create_rechecks_on_every_rank():
    parallel = ParallelConfig(attention=AttentionParallelConfig(tp_size=8))
    ReferenceDiTEntry({"heads": 8, "dim": 64}).check_parallel(parallel)  # 8 heads split over 8 ranks
    unconfigured = ReferenceDiTEntry()
    unconfigured.check_parallel(parallel)  # shape unknown here ...
    topology = Topology.from_parallel(parallel)
    ctx = RankContext(rank=0, world_size=8, replica_index=0, device=torch.device("cpu"), dtype=torch.float32,
                      parallel=parallel, groups=GroupSet(topology, 0))
    with pytest.raises(ParallelConfigError, match="heads=4 is not divisible by attention.tp_size=8"):
        unconfigured.create({}, ctx)  # ... but every rank checks it before building anything


@pytest.mark.parametrize("plugin_args, message", [
    ({"dim": 30, "heads": 4}, "dim=30 does not split into heads=4"),
    ({"top_k": 5}, "top_k=5 is larger than experts=4"),
    ({"layerz": 2}, "layerz"),
])
def test_bad_plugin_args_name_the_field(plugin_args, message):
    with pytest.raises(ValueError, match=message):
        ReferenceDiTConfig.from_args(plugin_args)


def test_inline_example_runs():
    from examples.reference_inline import main

    logits = main(["--guidance", "2.0", "--batch", "1", "--seq", "4"])
    assert logits.shape == (1, 4, 128)
