"""Tiny random Cosmos-Predict2.5 pipeline folders written by diffusers itself, for the Cosmos tests.

    folder = write_cosmos_folder(tmp_path / "cosmos")             # model_index.json, transformer/, vae/, ...
    pipe = load_cosmos_pipeline(folder)                            # diffusers' own pipeline of that folder

Nothing is downloaded. The parts are diffusers' and transformers' own classes built from small configs:
`CosmosTransformer3DModel` (2 blocks, 2 heads of 16), `AutoencoderKLWan` (z_dim 4, spatial factor 8,
temporal factor 4, as the real Wan 2.1 VAE Cosmos uses), a 2-layer `Qwen2_5_VLForConditionalGeneration`
as the text encoder (the pipeline concatenates its normalised hidden states, 2 x 16 = 32 channels,
projected by the transformer's `crossattn_proj`), a WordLevel tokenizer built here with the `tokenizers`
package plus a chat template, and UniPC with flow sigmas. Weights are diffusers' random initialisation
under a fixed seed, so the same call writes the same folder. A forward takes milliseconds.

Cosmos checkpoints are licensed with a guardrail (NVIDIA's `cosmos_guardrail`, a licensed model). The
tests give `StandInSafetyChecker` instead, by import path: `tests.diffusers_cosmos:StandInSafetyChecker`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

STAND_IN = "tests.diffusers_cosmos:StandInSafetyChecker"
UNSAFE_WORD = "forbidden"  # a prompt holding it is refused
UNSAFE_HEIGHT = 48  # a video of this height is refused (check_video_safety returns None)
WORDS = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "a", "robot", "arm",
         "welds", "metal", "in", "the", "snow", "bus", "moves", "city", "red", "green", "video", "of", "poor",
         "quality", "you", "are", "helpful", "who", "will", "provide", "prompts", "to", "an", "image",
         "generator", ".", ",", UNSAFE_WORD)
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' }}"
                 "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{{ ' <|im_end|> ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}")
Z_DIM = 4
TEXT_HIDDEN, TEXT_LAYERS = 16, 2
MAX_SEQUENCE_LENGTH = 32  # the pipeline pads every prompt to this many tokens (its default is 512)


class StandInSafetyChecker:
    """A stand-in for the Cosmos guardrail with its interface that refuses something real:
    `check_text_safety(prompt) -> bool` refuses prompts holding the word "forbidden";
    `check_video_safety(uint8 [frames, H, W, 3])` returns None (refused, as NVIDIA's checker does for an
    unsafe video) for a video UNSAFE_HEIGHT pixels high, else the video unchanged; `to(device)` records
    the device and returns itself. It holds no weights; `calls` counts the checks made in this process."""

    calls = {"text": 0, "video": 0}

    def __init__(self) -> None:
        self.device = None

    def to(self, device: Any = None, *args: Any, **kwargs: Any) -> "StandInSafetyChecker":
        self.device = device
        return self

    def check_text_safety(self, prompt: str) -> bool:
        StandInSafetyChecker.calls["text"] += 1
        return UNSAFE_WORD not in prompt.lower()

    def check_video_safety(self, video: np.ndarray) -> np.ndarray | None:
        StandInSafetyChecker.calls["video"] += 1
        return None if video.shape[1] == UNSAFE_HEIGHT else video


def diffusers_stand_in() -> Any:
    """The stand-in as diffusers' pipeline needs it: an instance of the name the pipeline module binds to
    `CosmosSafetyChecker`, since diffusers runs the video check only on such instances (and the name's own
    constructor refuses to build without `cosmos_guardrail`)."""
    from diffusers.pipelines.cosmos import pipeline_cosmos2_5_predict as module

    class _Checker(StandInSafetyChecker, module.CosmosSafetyChecker):
        def __init__(self) -> None:  # skips the guardrail's constructor on purpose
            pass

    return _Checker()


def write_tokenizer(folder: Path) -> Any:
    """A whitespace WordLevel tokenizer over WORDS (others map to <unk>) with a chat template, saved."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def build_components(seed: int = 0, *, layers: int = 2) -> dict[str, Any]:
    """The five model parts of a tiny Cosmos-Predict2.5 pipeline (no tokenizer), random under `seed`."""
    import torch
    from diffusers import AutoencoderKLWan, CosmosTransformer3DModel, UniPCMultistepScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    text_config = dict(vocab_size=len(WORDS), hidden_size=TEXT_HIDDEN, intermediate_size=32,
                       num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                       pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "mrope_section": [1, 1, 2]})
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                         patch_size=2, spatial_merge_size=1, temporal_patch_size=1, fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, image_token_id=len(WORDS) - 1,
                              video_token_id=len(WORDS) - 1, vision_start_token_id=0, vision_end_token_id=0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    transformer = CosmosTransformer3DModel(
        in_channels=Z_DIM + 1, out_channels=Z_DIM, num_attention_heads=2, attention_head_dim=16, num_layers=layers,
        mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=4, max_size=(8, 16, 16), patch_size=(1, 2, 2),
        rope_scale=(1.0, 1.0, 1.0), concat_padding_mask=True, extra_pos_embed_type=None,
        use_crossattn_projection=True, crossattn_proj_in_channels=TEXT_HIDDEN * TEXT_LAYERS,
        encoder_hidden_states_channels=16).eval()
    vae = AutoencoderKLWan(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                           latents_std=[1.5, 0.8, 1.2, 2.0]).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=1.0,
                                        use_karras_sigmas=True, sigma_min=0.002, sigma_max=80.0,
                                        final_sigmas_type="zero")
    return dict(text_encoder=text_encoder, transformer=transformer, vae=vae, scheduler=scheduler)


def write_cosmos_folder(folder: Path, seed: int = 0, **kwargs: Any) -> Path:
    """Save a tiny random `Cosmos2_5_PredictBasePipeline` to `folder` (created) with diffusers' own
    `save_pretrained`; model_index.json names no safety checker (none can be saved without the guardrail)."""
    from diffusers import Cosmos2_5_PredictBasePipeline

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(folder / "tokenizer")
    parts = build_components(seed, **kwargs)
    pipe = Cosmos2_5_PredictBasePipeline(tokenizer=tokenizer, safety_checker=diffusers_stand_in(), **parts)
    pipe.register_modules(safety_checker=None)
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return folder


def load_cosmos_pipeline(folder: Path) -> Any:
    """diffusers' pipeline of `folder` in float32 with the stand-in guardrail: the reference of every test."""
    import torch
    from diffusers import Cosmos2_5_PredictBasePipeline

    from phyai_ray.models.diffusers_pipeline.cosmos import supply_torchvision

    supply_torchvision()
    return Cosmos2_5_PredictBasePipeline.from_pretrained(str(folder), torch_dtype=torch.float32,
                                                         safety_checker=diffusers_stand_in())


class DownloadingSafetyChecker(StandInSafetyChecker):
    """A checker whose constructor fetches its files from the Hugging Face hub, as NVIDIA's does: built
    offline (the default), it fails at once instead of downloading."""

    def __init__(self, repo: str = "nvidia/Cosmos-Guardrail1") -> None:
        from huggingface_hub import snapshot_download

        super().__init__()
        self.files = snapshot_download(repo)
