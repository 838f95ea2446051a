"""Tiny random diffusers pipeline folders, built offline for the `diffusers_pipeline` tests.

    folder = build_wan(tmp_path / "wan21")                      Wan 2.1 text-to-video
    folder = build_wan(tmp_path / "wan22", two_experts=True)    Wan 2.2: transformer_2, boundary_ratio
    folder = build_wan(tmp_path / "ti2v", ti2v=True)            Wan 2.2 TI2V layout (expand_timesteps,
                                                                a 48-channel VAE with 16x spatial factor)

Every component is built by its own library's class from a small config (diffusers'
`WanTransformer3DModel`, `AutoencoderKLWan`, a flow-matching scheduler; transformers'
`UMT5EncoderModel`; a word-level fast tokenizer made with `tokenizers`), seeded, then saved with
`WanPipeline.save_pretrained`: the same folder layout as a real checkpoint, nothing downloaded.
A transformer forward on a 9-frame 32x32 video takes milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ("a robot arm picks up the red cube and places it in bin blue green box on table "
         "camera moves left right slowly fast dog cat runs").split()


def _tokenizer():
    """A word-level fast tokenizer with T5's special tokens (pad 0, eos 1, unk 2), as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(dict.fromkeys(WORDS))}}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def _text_encoder(vocab_size: int):
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=16,
                        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return UMT5EncoderModel(config).eval()


def _transformer(in_channels: int, out_channels: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=in_channels, out_channels=out_channels, text_dim=32, freq_dim=32,
                                 ffn_dim=32, num_layers=2, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()


def _vae(ti2v: bool):
    from diffusers import AutoencoderKLWan

    if ti2v:  # Wan 2.2's 48-channel residual VAE: 16x spatial, patchified by 2 inside
        return AutoencoderKLWan(base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                                out_channels=12, patch_size=2, scale_factor_spatial=16,
                                latents_mean=[0.0] * 48, latents_std=[1.0] * 48).eval()
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def _perturb(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Random weights everywhere, so no layer is an identity or a zero (diffusers zero-inits some)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def build_wan(folder: Path, *, two_experts: bool = False, ti2v: bool = False, seed: int = 0,
              scheduler: str = "unipc") -> Path:
    """Write a tiny random WanPipeline folder at `folder` and return it (see the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline

    torch.manual_seed(seed)
    gen = torch.Generator("cpu").manual_seed(seed)
    tokenizer = _tokenizer()
    text_encoder = _text_encoder(len(tokenizer))
    channels = 48 if ti2v else 16
    transformer = _transformer(channels, channels)
    transformer_2 = _transformer(channels, channels) if two_experts else None
    vae = _vae(ti2v)
    for module in (text_encoder, transformer, transformer_2, vae):
        if module is not None:
            _perturb(module, gen)
    if scheduler == "unipc":
        sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    else:
        sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=sched,
                       transformer=transformer, transformer_2=transformer_2,
                       boundary_ratio=0.6 if two_experts else None, expand_timesteps=ti2v)
    pipe.save_pretrained(folder)
    return folder


def _image_encoder():
    """A tiny CLIP vision tower: 32x32 images in 8x8 patches -> 17 tokens of width 32."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=16)
    return CLIPVisionModel(config).eval()


def _image_processor():
    """CLIP's preprocessing sized for the tiny tower (resize the short edge to 32, crop 32x32). Built with
    transformers' PIL backend (no torchvision here) and saved under the class name real checkpoints carry."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def build_wan_i2v(folder: Path, *, first_last: bool = False, seed: int = 0) -> Path:
    """Write a tiny random WanImageToVideoPipeline folder (the Wan 2.1 I2V layout) at `folder`; with
    `first_last`, the first-last-frame layout (FLF2V: the transformer's pos_embed_seq_len = 2 x 17 tokens).

    The transformer takes 16 noisy + 4 mask + 16 condition = 36 channels and the CLIP tower's
    second-to-last hidden states through `image_dim` / `added_kv_proj_dim`; the VAE, text encoder and
    tokenizer are build_wan's. model_index.json names the image processor "CLIPImageProcessor" as a
    real checkpoint does (transformers loads it with the PIL backend when torchvision is absent)."""
    import json

    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    gen = torch.Generator("cpu").manual_seed(seed)
    tokenizer = _tokenizer()
    text_encoder = _text_encoder(len(tokenizer))
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=16 + 4 + 16, out_channels=16, text_dim=32, freq_dim=32,
                                        ffn_dim=32, num_layers=2, cross_attn_norm=True,
                                        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=32,
                                        added_kv_proj_dim=24, pos_embed_seq_len=2 * 17 if first_last else None).eval()
    vae, image_encoder = _vae(False), _image_encoder()
    for module in (text_encoder, transformer, vae, image_encoder):
        _perturb(module, gen)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=sched,
                                   transformer=transformer, image_encoder=image_encoder,
                                   image_processor=_image_processor())
    pipe.save_pretrained(folder)
    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text())
    index_file.write_text(json.dumps({**index, "image_processor": ["transformers", "CLIPImageProcessor"]}, indent=2))
    return folder


def build_wan_i2v_a14b(folder: Path, *, seed: int = 0, boundary_ratio: float = 0.6) -> Path:
    """Write a tiny random Wan 2.2 I2V-A14B folder (WanImageToVideoPipeline with two experts) at `folder`.

    `transformer` (high noise, t >= boundary_ratio x 1000) and `transformer_2` (low noise) each take 16
    noisy + 4 mask + 16 condition = 36 channels and no image embeddings (image_dim null): the image
    conditions through the VAE only, and model_index.json names no image_encoder / image_processor, as
    the real checkpoint. The text encoder, tokenizer and VAE are build_wan's."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    torch.manual_seed(seed)
    gen = torch.Generator("cpu").manual_seed(seed)
    tokenizer = _tokenizer()
    text_encoder = _text_encoder(len(tokenizer))
    transformer, transformer_2 = _transformer(16 + 4 + 16, 16), _transformer(16 + 4 + 16, 16)
    vae = _vae(False)
    for module in (text_encoder, transformer, transformer_2, vae):
        _perturb(module, gen)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=sched,
                                   transformer=transformer, transformer_2=transformer_2,
                                   boundary_ratio=boundary_ratio)
    pipe.save_pretrained(folder)
    return folder
