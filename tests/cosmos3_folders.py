"""Tiny random Cosmos3 omni folders written by diffusers itself, for the Cosmos3 tests.

    folder = build_cosmos3(tmp_path / "cosmos3")               # model_index.json, transformer/, vae/, ...
    folder = build_cosmos3(tmp_path / "mute", sound=False)      # no sound_tokenizer (enable_sound refused)
    pipe = load_cosmos3_pipeline(folder)                        # diffusers' own Cosmos3OmniPipeline of it

Nothing is downloaded. Every part is its library's own class built from a small config and saved by
`Cosmos3OmniPipeline.save_pretrained`, the layout of a real checkpoint:

* `Cosmos3OmniTransformer`: 2 decoder layers of hidden 32, 4 query heads on 2 key/value heads of 16
  (grouped queries, as the real 32 on 8), 3-D mRoPE split (4, 2, 2), latent patch 2 over the VAE's 48
  channels, an action head (`action_gen`, action_dim 16, 32 embodiment domains: DROID's 10-wide chunk
  fits) and a sound head (`sound_gen`, sound_dim 8);
* `AutoencoderKLWan` in the Wan 2.2 layout (48 channels, 16x spatial, 4x temporal), as Cosmos3 ships;
* `Cosmos3AVAEAudioTokenizer`, decoder only (8 latent channels, hop 8, 200 samples a second);
* `UniPCMultistepScheduler` with flow sigmas; a word-level fast tokenizer built here with the
  `tokenizers` package, with Qwen's chat markers, `<|vision_start|>` and a chat template.

The folder is saved with `enable_safety_checker=False`: NVIDIA's guardrail is a licensed model that
is not installed here. Weights are random under a fixed seed, perturbed so no layer is an identity or
a zero (diffusers zero-inits the modality embeddings); the per-domain action heads, embeddings drawn
N(0, 1), are scaled to a linear layer's 1 / sqrt(fan_in), so an action chunk is of order 1 as a
trained model's. A transformer forward takes milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ("a robot arm picks up the red cube and places it in bin blue green box on table camera moves left "
         "right slowly fast dog cat runs video image this is of not seconds long fps resolution you are helpful "
         "assistant who will generate videos images from give prompt").split()
SPECIALS = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "system",
            "user")
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + ' <|im_end|> ' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}")
ACTION_DIM, SOUND_DIM, LATENT_CHANNELS = 16, 8, 48


def _tokenizer():
    """Word-level: each word, digit run or punctuation mark a token (unknown ones <unk>); eos <|endoftext|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(dict.fromkeys(SPECIALS + tuple(WORDS) + tuple("0123456789.,:{}[]\"-")))}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<|endoftext|>",
                                        unk_token="<unk>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|vision_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _transformer(vocab_size: int, sound: bool, hidden: int = 32, layers: int = 2):
    from diffusers import Cosmos3OmniTransformer

    return Cosmos3OmniTransformer(head_dim=16, hidden_size=hidden, intermediate_size=hidden * 3 // 2,
                                  num_attention_heads=hidden // 8, num_key_value_heads=hidden // 16,
                                  num_hidden_layers=layers, latent_channel=LATENT_CHANNELS,
                                  latent_patch_size=2, patch_latent_dim=4 * LATENT_CHANNELS, rope_axes_dim=(4, 2, 2),
                                  vocab_size=vocab_size, action_gen=True, action_dim=ACTION_DIM,
                                  num_embodiment_domains=32, sound_gen=sound, sound_dim=SOUND_DIM if sound else None,
                                  unified_3d_mrope_temporal_modality_margin=100).eval()


def _vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=4, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                            out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                            latents_mean=[0.0] * LATENT_CHANNELS, latents_std=[1.0] * LATENT_CHANNELS).eval()


def _sound_tokenizer():
    from diffusers.models.autoencoders.autoencoder_cosmos3_audio import Cosmos3AVAEAudioTokenizer

    return Cosmos3AVAEAudioTokenizer(sampling_rate=200, vocoder_input_dim=SOUND_DIM, dec_dim=4, dec_c_mults=(1, 2),
                                     dec_strides=(2, 4), dec_out_channels=2, encoder_enabled=False).eval()


def _perturb(module: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def build_cosmos3(folder: Path, *, sound: bool = True, seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    """Write a tiny random Cosmos3OmniPipeline folder at `folder` and return it (see the module docstring);
    `hidden` / `layers` size the transformer (hidden / 8 query heads on hidden / 16 key/value heads)."""
    from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

    torch.manual_seed(seed)
    gen = torch.Generator("cpu").manual_seed(seed)
    tokenizer = _tokenizer()
    transformer, vae = _transformer(len(tokenizer), sound, hidden, layers), _vae()
    sound_tokenizer = _sound_tokenizer() if sound else None
    with torch.no_grad():  # the action heads are embeddings (N(0, 1) at init): scaled as a linear's 1 / sqrt(fan_in)
        transformer.action_proj_in.fc.weight.mul_(ACTION_DIM ** -0.5)
        transformer.action_proj_out.fc.weight.mul_(transformer.config.hidden_size ** -0.5)
    for module in (transformer, vae, sound_tokenizer):
        if module is not None:
            _perturb(module, gen)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=tokenizer, vae=vae, scheduler=scheduler,
                               sound_tokenizer=sound_tokenizer, enable_safety_checker=False)
    pipe.save_pretrained(folder)
    return folder


def load_cosmos3_pipeline(folder: Path):
    """diffusers' own pipeline of the folder, on the CPU in float32, its progress bar off."""
    from diffusers import Cosmos3OmniPipeline

    pipe = Cosmos3OmniPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe
