"""`wan_shard_test`: a tiny seeded diffusers Wan transformer, sharded by `shard_wan`, for tests.

Every rank builds the same full `WanTransformer3DModel`s from `tiny_wan_config()` and the seed
(a text-to-video one, and an image-to-video one with `I2V`), keeps its share of `ctx.parallel`,
and returns the full transformer output of a request `{"hidden_states", "timestep",
"encoder_hidden_states"}` (tensors, as `sample_inputs` makes them; with
"encoder_hidden_states_image" the image-to-video transformer answers). The single-rank reference
is `tiny_wan(...)` called in the test process on the same inputs.
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray import Entry, register_plugin


def tiny_wan_config(**overrides: Any) -> dict[str, Any]:
    """A Wan 2.1-shaped transformer small enough for 2-core tests: 4 heads of 12 channels, 2 blocks."""
    config = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=4,
                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32)
    return {**config, **overrides}


# Wan 2.1 I2V's extra cross-attention keys/values from an image embedding (added_kv_proj_dim = inner dim);
# its processor takes the LAST 512 text tokens as text, the tokens before them as the image.
I2V = {"image_dim": 8, "added_kv_proj_dim": 48}


def tiny_wan(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The full transformer every rank starts from (fp32, eval mode)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**tiny_wan_config(**overrides)).eval()


def sample_inputs(seed: int = 1, batch: int = 2, frames: int = 3, height: int = 6, width: int = 8,
                  text_tokens: int = 5, per_token_timestep: bool = False, image_tokens: int = 0,
                  **overrides: Any) -> dict[str, Any]:
    """Seeded forward inputs; `per_token_timestep` gives the Wan 2.2 TI2V timestep [batch, tokens],
    `image_tokens` an image embedding for the `I2V` transformer (then the text is 512 tokens)."""
    config = tiny_wan_config(**overrides)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, config["in_channels"], frames, height, width, generator=gen)
    text = torch.randn(batch, text_tokens, config["text_dim"], generator=gen)
    if per_token_timestep:
        tokens = frames * (height // 2) * (width // 2)
        timestep = torch.randint(0, 1000, (batch, tokens), generator=gen).float()
    else:
        timestep = torch.tensor([999.0, 500.0][:batch] + [250.0] * max(0, batch - 2))
    inputs = {"hidden_states": x, "timestep": timestep, "encoder_hidden_states": text}
    if image_tokens:
        inputs["encoder_hidden_states"] = torch.randn(batch, 512, config["text_dim"], generator=gen)
        inputs["encoder_hidden_states_image"] = torch.randn(batch, image_tokens, I2V["image_dim"], generator=gen)
    return inputs


class WanShardModel:
    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        from phyai_ray.models.diffusers_pipeline.wan_parallel import shard_wan

        seed = int(plugin_args.get("seed", 0))
        self.t2v = shard_wan(tiny_wan(seed), ctx)
        self.i2v = shard_wan(tiny_wan(seed, **I2V), ctx)

    @torch.no_grad()
    def step(self, request: dict[str, Any]) -> torch.Tensor:
        model = self.i2v if "encoder_hidden_states_image" in request else self.t2v
        return model(**request, return_dict=False)[0]


@register_plugin
class WanShardEntry(Entry):
    name = "wan_shard_test"
    parallel_domains = frozenset({"dense", "attention"})

    def validate_parallel(self, parallel: Any) -> None:
        from phyai_ray.models.diffusers_pipeline.wan_parallel import validate_wan_parallel

        validate_wan_parallel(tiny_wan_config(), parallel)

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> WanShardModel:
        return WanShardModel(plugin_args, ctx)
