"""Parallel layouts of `diffusers_pipeline` beyond Wan text-to-video, each equal to diffusers' own pipeline.

    .venv/bin/python -m pytest tests/test_diffusers_layouts.py -q

The ranks run as threads of this process joined by real gloo groups (`on_ranks`: one ProcessGroupGloo
per thread and group over a shared HashStore, so `P`'s all-to-all, all-gather and all-reduce cross
ranks as on Ray), each with its rank's named groups active. Through the per-rank model's own
loop (`DiffusersPipelineEntry.create`, the family's `parallelize`, admit, iterate: requests batched per
step): Cosmos-Predict2.5 under Ulysses 2, Wan 2.1 image-to-video under Ulysses 2 and TP 2, Wan 2.2
I2V-A14B (two experts, boundary_ratio, guidance_scale_2) under CFG 2 and alone inline, against
diffusers' pipelines with the tolerances of each pipeline's own tests: Cosmos 1e-6 of the largest
latent (tests/test_diffusers_cosmos.py), Wan batched per step 1e-5, one Wan request alone 1e-6. The
sharded transformer forward against the unsharded one (1e-5, as tests/test_wan_parallel.py): Cosmos
with the learnable position embedding and per-frame timesteps, and Wan's first-last-frame image path
(pos_embed), each under TP 2, Ulysses 2 and CP 2 x TP 2 (4 ranks). Pure tests: `validate_cosmos_parallel`,
the Cosmos TP shard plan against what `shard_cosmos` keeps, the A14B folder checks, the entry's routing.

Cosmos under TP 2 is checked at the forward: through 3 guided steps (g = 7) the row-parallel sums'
rounding reaches 1.7e-6 of the largest latent, over the 1e-6 of the single-rank Cosmos tests.
"""

from __future__ import annotations

import datetime
import json
import shutil
import threading
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("diffusers")

from phyai_ray import Engine, EngineArgs  # noqa: E402
from phyai_ray.config.parallel import (AttentionParallelConfig as A, DenseParallelConfig as D,  # noqa: E402
                                       MoeParallelConfig as M, OuterParallelConfig as O, ParallelConfig)
from phyai_ray.errors import ParallelConfigError  # noqa: E402
from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry  # noqa: E402
from phyai_ray.models.diffusers_pipeline.cosmos_parallel import (cosmos_tp_shard_dim, shard_cosmos,  # noqa: E402
                                                                 validate_cosmos_parallel)
from phyai_ray.models.diffusers_pipeline.folder import PipelineFolderError  # noqa: E402
from phyai_ray.models.diffusers_pipeline.wan_parallel import shard_wan  # noqa: E402
from phyai_ray.plugins.context import RankContext  # noqa: E402
from phyai_ray.process_groups import GroupSet  # noqa: E402
from placement.topology import Topology  # noqa: E402
from tests import diffusers_cosmos as dc  # noqa: E402
from tests.diffusers_folders import build_wan_i2v, build_wan_i2v_a14b  # noqa: E402
from tests.plugins.wan_shard import I2V as I2V_TRANSFORMER, sample_inputs, tiny_wan  # noqa: E402
from tests.test_diffusers_cosmos import assert_close, request as cosmos_request, wire  # noqa: E402
from tests.test_diffusers_wan_i2v import BASE, PLUGIN, picture, reference as i2v_reference  # noqa: E402
from tests.tolerances import against

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)

CP2 = ParallelConfig(attention=A(cp_size=2))
TP2 = ParallelConfig(attention=A(tp_size=2), dense=D(tp_size=2))
CFG2 = ParallelConfig(outer=O(cfg_size=2))
CP2_TP2 = ParallelConfig(attention=A(tp_size=2, cp_size=2), dense=D(tp_size=2, dp_size=2))
TOLERANCE = 1e-5  # a sharded forward against the unsharded one (tests/test_wan_parallel.py)


# -- ranks in one process -----------------------------------------------------------------------------------

def _gloo(store: Any, rank: int, size: int) -> Any:
    """Rank `rank` of a `size`-rank gloo process group rendezvousing through `store` (blocks for its peers)."""
    from torch.distributed import ProcessGroup, ProcessGroupGloo

    group = ProcessGroup(store, rank, size)
    backend = ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=60))
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group


def _groups(store: Any, topology: Topology, rank: int) -> GroupSet:
    """This rank's named groups, one gloo group per distinct member tuple (every rank makes them in the
    same name order, so each rendezvous finds its peers)."""
    from torch.distributed import PrefixStore

    made: dict[tuple[int, ...], Any] = {}
    for name, members in topology.rank_groups(rank).items():
        if len(members) > 1 and members not in made:
            made[members] = _gloo(PrefixStore(str(members), store), members.index(rank), len(members))
    return GroupSet(topology, rank, {name: made[m] for name, m in topology.rank_groups(rank).items() if m in made})


def on_ranks(parallel: ParallelConfig, build: Callable[[Any], Any], run: Callable[[Any], Any]) -> list:
    """Every rank's `run(build(ctx))`, in rank order: one thread per rank of `parallel`, each with its named
    groups over gloo. Builds take turns (loading is not thread-safe; it needs no collective); the runs
    go together."""
    from torch.distributed import HashStore

    store, topology, turn = HashStore(), Topology.from_parallel(parallel), threading.Lock()
    results: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            groups = _groups(store, topology, r)
            ctx = RankContext(rank=r, world_size=topology.world_size, replica_index=0, device=torch.device("cpu"),
                              dtype=torch.float32, parallel=parallel, groups=groups)
            with groups.activate(), torch.no_grad():
                with turn:
                    built = build(ctx)
                results[r] = run(built)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(topology.world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    for r in sorted(results):
        if isinstance(results[r], BaseException):
            raise results[r]
    assert len(results) == topology.world_size, f"ranks {sorted(results)} of {topology.world_size} finished"
    return [results[r] for r in range(topology.world_size)]


def through_the_loop(args: dict, parallel: ParallelConfig, requests: list[dict]) -> list[torch.Tensor]:
    """Rank 0's latents of `requests`, admitted together and iterated to the end on both ranks."""
    entry = DiffusersPipelineEntry(args)
    entry.check_parallel(parallel)
    payloads = [entry.sequences({**r, "output_type": "latent"})[0].payload for r in requests]

    def run(model: Any) -> list[torch.Tensor]:
        for ident, payload in enumerate(payloads):
            model.admit(ident, payload)
        done: dict[int, torch.Tensor] = {}
        while len(done) < len(payloads):
            done.update({k: d.value["video"] for k, d in model.iterate().items() if d.stop_reason == "completed"})
        return [done[k] for k in range(len(payloads))]

    return on_ranks(parallel, lambda ctx: entry.create(args, ctx), run)[0]


# -- through the loop, against diffusers ----------------------------------------------------------------------

COSMOS = [cosmos_request("text", num_inference_steps=3, seed=41),
          cosmos_request("image", num_inference_steps=2, guidance_scale=3.0, seed=42)]
I2V = [{**BASE, "image": picture(1), "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 1},
       {**BASE, "image": picture(2, 32, 32), "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 2}]
A14B = [{**BASE, "image": picture(5), "num_inference_steps": 4, "guidance_scale": 4.0, "guidance_scale_2": 2.0,
         "seed": 5},
        {**BASE, "prompt": "a dog runs left", "image": picture(6), "num_inference_steps": 3, "guidance_scale": 1.0,
         "seed": 6}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {"cosmos": dc.write_cosmos_folder(root / "cosmos"), "i2v": build_wan_i2v(root / "i2v"),
            "a14b": build_wan_i2v_a14b(root / "a14b")}


def plugin_args(folders, key: str) -> dict:
    args = {"model": str(folders[key])}
    return {**args, "safety_checker": dc.STAND_IN} if key == "cosmos" else args


def test_cosmos_under_ulysses_2_equals_the_pipeline(folders):
    from tests.test_diffusers_cosmos import reference

    got = through_the_loop(plugin_args(folders, "cosmos"), CP2, [wire(r) for r in COSMOS])
    pipe = dc.load_cosmos_pipeline(folders["cosmos"])
    pipe.set_progress_bar_config(disable=True)
    for latents, r in zip(got, COSMOS):
        assert_close(torch.as_tensor(latents), reference(pipe, r))


@pytest.mark.parametrize("key, parallel", [("i2v", CP2), ("i2v", TP2), ("a14b", CFG2)], ids=["i2v-cp2", "i2v-tp2",
                                                                                           "a14b-cfg2"])
def test_image_to_video_layouts_equal_the_pipeline(folders, key, parallel):
    requests = I2V if key == "i2v" else A14B
    for latents, r in zip(through_the_loop(plugin_args(folders, key), parallel, requests), requests):
        torch.testing.assert_close(latents, i2v_reference(folders[key], r), **against("diffusers", "batched"))


def test_a14b_alone_uses_both_experts_and_equals_the_pipeline(folders):
    from diffusers import WanImageToVideoPipeline

    folder = folders["a14b"]
    scheduler = WanImageToVideoPipeline.from_pretrained(folder).scheduler
    scheduler.set_timesteps(A14B[0]["num_inference_steps"])
    boundary = 0.6 * scheduler.config.num_train_timesteps
    assert (scheduler.timesteps >= boundary).any() and (scheduler.timesteps < boundary).any()
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder)})) as engine:
        got = engine.step({**A14B[0], "output_type": "latent"})["video"]
        torch.testing.assert_close(got, i2v_reference(folder, A14B[0]), **against("diffusers", "alone"))
        other = engine.step({**A14B[0], "guidance_scale_2": 5.0, "output_type": "latent"})["video"]
        assert (other - got).abs().max() > 1e-4, "guidance_scale_2 guides the low-noise expert's steps"
        with pytest.raises(ValueError, match="last_image needs a first-last-frame folder"):
            engine.step({**A14B[0], "last_image": picture(7)})


# -- the sharded transformer forward against the unsharded one ------------------------------------------------

def tiny_cosmos(**overrides: Any) -> torch.nn.Module:
    from diffusers import CosmosTransformer3DModel

    from phyai_ray.models.diffusers_pipeline.cosmos import supply_torchvision

    supply_torchvision()
    torch.manual_seed(0)
    config = dict(in_channels=5, out_channels=4, num_attention_heads=4, attention_head_dim=12, num_layers=2,
                  mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=4, max_size=(8, 16, 16),
                  extra_pos_embed_type="learnable")
    model = CosmosTransformer3DModel(**{**config, **overrides}).eval()
    with torch.no_grad():  # diffusers zero-inits the learnable position embedding
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    return model


def cosmos_inputs(frames: int = 3, height: int = 6, width: int = 8) -> dict:
    """A Cosmos forward as the family calls it: per-frame timesteps [B, 1, T, 1, 1], the condition and
    padding masks; 3 x 3 x 4 = 36 tokens (18 per rank, or heads split)."""
    gen = torch.Generator().manual_seed(9)
    return dict(hidden_states=torch.randn(2, 4, frames, height, width, generator=gen),
                timestep=torch.rand(2, 1, frames, 1, 1, generator=gen),
                encoder_hidden_states=torch.randn(2, 7, 16, generator=gen),
                condition_mask=torch.zeros(2, 1, frames, height, width), padding_mask=torch.zeros(1, 1, 16, 16),
                return_dict=False)


def first_last_inputs() -> dict:
    """A Wan first-last-frame forward: two image rows per video ([2B, 4, image_dim]) that the transformer
    folds into one row of 8 tokens and adds its pos_embed to; 3 x 3 x 3 = 27 tokens (14 and 13 per rank)."""
    inputs = sample_inputs(seed=7, width=6, image_tokens=4)
    gen = torch.Generator().manual_seed(8)
    return {**inputs, "encoder_hidden_states_image": torch.randn(4, 4, I2V_TRANSFORMER["image_dim"], generator=gen)}


FORWARDS = {  # name: (full transformer, shard, inputs)
    "cosmos": (tiny_cosmos, shard_cosmos, cosmos_inputs),
    "wan-first-last-frame": (lambda: tiny_wan(0, **I2V_TRANSFORMER, pos_embed_seq_len=8), shard_wan,
                             first_last_inputs),
}


def forward_and_query_shape(model: Any, inputs: dict) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The forward's output and the shape of the first block's queries [B, tokens, heads x head_dim]."""
    seen = []
    first = (model.transformer_blocks if hasattr(model, "transformer_blocks") else model.blocks)[0].attn1
    handle = first.to_q.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    try:
        return model(**inputs)[0], seen[0]
    finally:
        handle.remove()


@pytest.mark.parametrize("parallel", [TP2, CP2, CP2_TP2], ids=["tp2", "cp2", "cp2-tp2"])
@pytest.mark.parametrize("name", sorted(FORWARDS))
def test_sharded_forward_equals_one_rank(name, parallel):
    make, shard, inputs = FORWARDS[name]
    with torch.no_grad():
        want, full = forward_and_query_shape(make(), inputs())
    ranks = on_ranks(parallel, lambda ctx: shard(make(), ctx), lambda model: forward_and_query_shape(model, inputs()))
    for got, queries in ranks:
        assert queries[1] * queries[2] * 2 <= full[1] * full[2] + full[2], f"{name}: {queries} is not a share of {full}"
        err = (got - want).abs().max().item()
        assert got.shape == want.shape and err <= TOLERANCE, f"{name}: max abs error {err:.2e} > {TOLERANCE}"


# -- checks before any rank starts ----------------------------------------------------------------------------

COSMOS_CONFIG = {"num_attention_heads": 2, "attention_head_dim": 16, "mlp_ratio": 2.0}


@pytest.mark.parametrize("parallel", [ParallelConfig(), CP2, TP2, CFG2, ParallelConfig(outer=O(cfg_size=2),
                                                                                      attention=A(cp_size=2))])
def test_validate_cosmos_accepts(parallel):
    validate_cosmos_parallel(COSMOS_CONFIG, parallel)


@pytest.mark.parametrize("parallel, config, why", [
    (ParallelConfig(attention=A(cp_size=4)), {}, "num_attention_heads=2 is not divisible by attention.tp_size "
                                                 "* attention.cp_size = 1 * 4"),
    (ParallelConfig(attention=A(dp_size=2)), {}, "attention.dp_size=2"),
    (ParallelConfig(outer=O(pp_size=2)), {}, "outer.pp_size=2"),
    (ParallelConfig(attention=A(tp_size=2)), {}, "dense.tp_size=1 != attention.tp_size=2"),
    (ParallelConfig(moe=M(ep_size=2)), {}, "Cosmos has no mixture-of-experts layers"),
    (TP2, {"mlp_ratio": 1.5, "attention_head_dim": 11},
     "the FFN's hidden units=33 is not divisible by dense.tp_size=2"),
    (TP2, {"img_context_dim_in": 8}, "img_context_dim_in=8 with attention.tp_size=2"),
])
def test_validate_cosmos_refuses_naming_the_rule(parallel, config, why):
    with pytest.raises(ParallelConfigError, match="the Cosmos transformer cannot run") as err:
        validate_cosmos_parallel({**COSMOS_CONFIG, **config}, parallel)
    assert why in str(err.value) and "Supported:" in str(err.value)


def fake_ctx(parallel: ParallelConfig, tp_rank: int) -> SimpleNamespace:
    """Group ranks of one rank of a TP group, enough to BUILD a shard (building needs no collective)."""
    sizes = {"attention_tp": parallel.attention.tp_size, "dense_tp": parallel.dense.tp_size,
             "attention_cp": parallel.attention.cp_size}
    return SimpleNamespace(rank=tp_rank, parallel=parallel, group_size=lambda g: sizes.get(g, 1),
                           group_rank=lambda g: tp_rank if g in ("attention_tp", "dense_tp") else 0)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_shard_cosmos_keeps_the_chunks_its_shard_dim_names(tp_rank):
    from phyai_ray.models.diffusers_pipeline.cosmos_parallel import cosmos_shard_of

    full = tiny_cosmos().state_dict()
    shard = shard_cosmos(tiny_cosmos(), fake_ctx(TP2, tp_rank)).state_dict()
    assert shard.keys() == full.keys()
    split = [name for name in full if cosmos_tp_shard_dim(name) is not None]
    assert len(split) == 2 * (2 * 4 + 2)  # per block: q, k, v, out of two attentions; the FFN's up and down
    for name, tensor in full.items():
        dim = cosmos_tp_shard_dim(name)
        want = tensor if dim is None else tensor.chunk(2, dim)[tp_rank]
        assert torch.equal(shard[name], want), name
        assert torch.equal(cosmos_shard_of(f"transformer.{name}", tensor, fake_ctx(TP2, tp_rank)), want), name


def test_shard_cosmos_on_one_rank_changes_nothing_and_refuses_twice():
    model = tiny_cosmos()
    assert shard_cosmos(model, fake_ctx(ParallelConfig(), 0)) is model
    sharded = shard_cosmos(tiny_cosmos(), fake_ctx(TP2, 0))
    with pytest.raises(ValueError, match="already applied"):
        shard_cosmos(sharded, fake_ctx(TP2, 0))


def test_the_entry_routes_each_folder_to_its_transformers_rules(folders):
    for key in ("cosmos", "i2v", "a14b"):
        entry = DiffusersPipelineEntry(plugin_args(folders, key))
        for parallel in (CP2, TP2, CFG2):
            entry.check_parallel(parallel)
        family = "Cosmos" if key == "cosmos" else "Wan"
        with pytest.raises(ParallelConfigError, match=f"the {family} transformer cannot run .*ring attention"):
            entry.check_parallel(ParallelConfig(attention=A(cp_size=4)))


def _edited(folder, tmp_path, index=None, transformer_2=None):
    target = tmp_path / "edited"
    shutil.copytree(folder, target)
    for file, change in (("model_index.json", index), ("transformer_2/config.json", transformer_2)):
        if change:
            data = json.loads((target / file).read_text())
            (target / file).write_text(json.dumps({**data, **change}))
    return target


@pytest.mark.parametrize("edit, rule", [
    ({"index": {"transformer_2": [None, None]}}, r"model_index.json: WanImageToVideoPipeline with boundary_ratio=0.6 "
                                                 r"and no transformer_2"),
    ({"index": {"boundary_ratio": None}}, r"transformer/config.json: WanImageToVideoPipeline with image_dim=null"),
    ({"transformer_2": {"image_dim": 32}}, r"transformer_2/config.json: WanImageToVideoPipeline with image_dim=32 "
                                           r"unlike the transformer's image_dim=None"),
])
def test_a14b_folders_that_cannot_run_are_refused_naming_the_file(folders, tmp_path, edit, rule):
    with pytest.raises(PipelineFolderError, match=rule):
        DiffusersPipelineEntry({"model": str(_edited(folders["a14b"], tmp_path, **edit))})
