"""Writes tiny random LeRobot 0.4.4 policies and LeRobot's own action chunks for them (tests/data/lerobot/).

Run in the reference venv (scripts/lerobot_reference/build_venv.sh, or `make lerobot-reference`):

    /tmp/lerobot-venv/bin/python scripts/lerobot_reference/make_reference.py --policy smolvla --out tests/data/lerobot

For a policy P it writes, all offline and seeded (the same files on every run):

    P/pretrained_model/     config.json, model.safetensors, policy_preprocessor.json,
                            policy_postprocessor.json and their normalizer .safetensors, as
                            LeRobot's save_pretrained writes them (state MEAN_STD, action QUANTILES)
    P/backbone/             the tiny local backbone folder the policy names (SmolVLM config,
                            tokenizer and processor; PaliGemma's tokenizer built with `tokenizers`)
    P/cases.safetensors     robots' observations (float images in [0, 1] CHW, raw states), their
                            noise [chunk_size, max_action_dim], RTC's previous chunks, and the chunks
                            LeRobot's predict_action_chunk returned after its postprocessor:
                            alone, all robots as one batch, and with RTC (one robot per call: LeRobot
                            has one inference_delay per call)
    P/cases.json            the prompts, camera keys and RTC settings of those cases

The tests compare phyai-ray's `lerobot_policy` plugin against these files and never need LeRobot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 20261202
STATE_DIM, ACTION_DIM = 6, 5
CAMERAS = ("observation.images.top", "observation.images.wrist")
IMAGE_CHW = (3, 24, 40)  # not square: resize-with-padding has work to do
PROMPTS = ("pick up the red cube", "open the drawer slowly", "stack")
RTC = [  # per robot: (k previous actions, inference_delay, execution_horizon)
    (8, 2, 6), (10, 0, 4), (5, 3, 8)]


def stats(dim: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    mean = torch.randn(dim, generator=gen) * 0.3
    std = torch.rand(dim, generator=gen) + 0.5
    q01 = mean - 2 * std + 0.1 * torch.rand(dim, generator=gen)
    q99 = mean + 2 * std - 0.1 * torch.rand(dim, generator=gen)
    return {"mean": mean, "std": std, "q01": q01, "q99": q99, "min": mean - 3 * std, "max": mean + 3 * std}


def features() -> tuple[dict, dict]:
    from lerobot.configs.types import FeatureType, PolicyFeature

    inputs = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))}
    for key in CAMERAS:
        inputs[key] = PolicyFeature(type=FeatureType.VISUAL, shape=IMAGE_CHW)
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))}
    return inputs, outputs


def normalization() -> dict:
    from lerobot.configs.types import NormalizationMode

    return {"VISUAL": NormalizationMode.IDENTITY, "STATE": NormalizationMode.MEAN_STD,
            "ACTION": NormalizationMode.QUANTILES}


def train_bpe(words: list[str], vocab_size: int, specials: list[str]):
    """A byte-level BPE tokenizer trained on a few sentences (the newline a token of its own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(words, trainer)
    return tok


CORPUS = [p + "\n" for p in PROMPTS] + ["pick place open close the a cube drawer red blue slowly stack\n"] * 4


def smolvla_backbone(folder: Path) -> None:
    """A tiny SmolVLM folder: config.json, tokenizer (with SmolVLM's image tokens) and processor."""
    from transformers import PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMProcessor
    from transformers.models.smolvlm import SmolVLMImageProcessor

    specials = ["<|endoftext|>", "<pad>", "<image>", "<fake_token_around_image>", "<global-img>",
                "<end_of_utterance>"]
    raw = train_bpe(CORPUS, 320, specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<pad>",
        unk_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                              "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"})
    vocab = len(tok)
    text = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab,
                rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  image_size=32, patch_size=8, num_channels=3)
    config = SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=2,
                           image_token_id=tok.convert_tokens_to_ids("<image>"), vocab_size=vocab)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tok.save_pretrained(folder)
    image_processor = SmolVLMImageProcessor(size={"longest_edge": 32}, max_image_size={"longest_edge": 32},
                                            do_image_splitting=False)
    try:
        from transformers.models.smolvlm import SmolVLMVideoProcessor

        processor = SmolVLMProcessor(image_processor=image_processor, tokenizer=tok,
                                     video_processor=SmolVLMVideoProcessor(), image_seq_len=4)
    except ImportError:  # an older transformers: no video processor
        processor = SmolVLMProcessor(image_processor=image_processor, tokenizer=tok, image_seq_len=4)
    processor.save_pretrained(folder)


def smolvla_policy(backbone: Path):
    from lerobot.policies.rtc.configuration_rtc import RTCConfig
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.configs.types import RTCAttentionSchedule

    inputs, outputs = features()
    cfg = SmolVLAConfig(
        input_features=inputs, output_features=outputs, normalization_mapping=normalization(),
        chunk_size=10, n_action_steps=10, max_state_dim=8, max_action_dim=8,
        resize_imgs_with_padding=(32, 32), tokenizer_max_length=16, num_steps=5,
        vlm_model_name=str(backbone), load_vlm_weights=False, num_vlm_layers=4, num_expert_layers=-1,
        self_attn_every_n_layers=2, expert_width_multiplier=0.75, device="cpu",
        rtc_config=RTCConfig(enabled=True, prefix_attention_schedule=RTCAttentionSchedule.EXP,
                             max_guidance_weight=5.0, execution_horizon=6))
    return SmolVLAPolicy(cfg)


# pi0 / pi0.5: tiny sizes under LeRobot's GemmaConfig and SigLIP's field names (plugin_args["sizes"] of the
# tests); LeRobot builds only its named variants, so the reference patches its constructors here.
PI_SIZES = {
    "paligemma": {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 4, "num_kv_heads": 1, "head_dim": 8},
    "action_expert": {"width": 16, "depth": 2, "mlp_dim": 32, "num_heads": 4, "num_kv_heads": 1, "head_dim": 8},
    "vision": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
               "patch_size": 8},
}
PALIGEMMA = "google/paligemma-3b-pt-224"  # the name LeRobot's pi0 / pi0.5 processors load


def pi_backbone(folder: Path) -> int:
    """A tiny PaliGemma-like tokenizer (byte-level BPE with <bos> prepended, as PaliGemma's does)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    corpus = CORPUS + ["Task: pick up the red cube, State: 0 12 127 128 200 255 31 64 99;\nAction: "] * 4
    raw = train_bpe(corpus, 360, ["<pad>", "<eos>", "<bos>", "<unk>"])
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>")
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    return len(tok)


def pi_policy(kind: str, backbone: Path):
    """A tiny pi0 / pi0.5: LeRobot's variant table and its PaliGemma / Gemma constructors patched to PI_SIZES."""
    import importlib

    from lerobot.configs.types import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig
    import lerobot.processor.tokenizer_processor as tokenizer_processor

    vocab = pi_backbone(backbone)
    modeling = importlib.import_module(f"lerobot.policies.{kind}.modeling_{kind}")
    configuration = importlib.import_module(f"lerobot.policies.{kind}.configuration_{kind}")
    sizes = {"gemma_2b": PI_SIZES["paligemma"], "gemma_300m": PI_SIZES["action_expert"]}
    modeling.get_gemma_config = lambda variant: modeling.GemmaConfig(**sizes[variant])
    real_vlm, real_expert = modeling.PaliGemmaForConditionalGeneration, modeling.GemmaForCausalLM

    def tiny_vlm(config):
        for key, value in PI_SIZES["vision"].items():
            setattr(config.vision_config, key, value)
        config.vision_config.projection_dim = PI_SIZES["paligemma"]["width"]
        config.text_config.vocab_size = vocab
        config._vocab_size = vocab  # noqa: SLF001
        config.image_token_index = 0
        return real_vlm(config=config)

    def tiny_expert(config):
        config.vocab_size = vocab
        return real_expert(config=config)

    modeling.PaliGemmaForConditionalGeneration, modeling.GemmaForCausalLM = tiny_vlm, tiny_expert
    real_tokenizer = tokenizer_processor.AutoTokenizer.from_pretrained
    tokenizer_processor.AutoTokenizer.from_pretrained = \
        lambda name, *a, **k: real_tokenizer(str(backbone) if name == PALIGEMMA else name, *a, **k)
    config_class = configuration.PI0Config if kind == "pi0" else configuration.PI05Config
    policy_class = modeling.PI0Policy if kind == "pi0" else modeling.PI05Policy
    inputs, outputs = features()
    cfg = config_class(
        input_features=inputs, output_features=outputs, normalization_mapping=normalization(),
        chunk_size=10, n_action_steps=10, max_state_dim=8, max_action_dim=8, num_inference_steps=5,
        image_resolution=(32, 32), tokenizer_max_length=48 if kind == "pi05" else 16, device="cpu",
        rtc_config=RTCConfig(enabled=True, prefix_attention_schedule=RTCAttentionSchedule.LINEAR,
                             max_guidance_weight=8.0, execution_horizon=6))
    return policy_class(cfg), vocab


def observations(gen: torch.Generator, n: int) -> list[dict]:
    frames = []
    for i in range(n):
        frame = {"observation.state": torch.randn(STATE_DIM, generator=gen) * 0.8 + 0.1,
                 "task": PROMPTS[i % len(PROMPTS)]}
        for key in CAMERAS:
            frame[key] = torch.rand(IMAGE_CHW, generator=gen)
        frames.append(frame)
    return frames


def batch_of(frames: list[dict]) -> dict:
    out = {key: torch.stack([f[key] for f in frames]) for key in frames[0] if key != "task"}
    out["task"] = [f["task"] for f in frames]
    return out


def run(policy, pre, post, frames: list[dict], noise: torch.Tensor, **rtc) -> torch.Tensor:
    batch = pre(batch_of(frames))
    policy.reset()
    actions = policy.predict_action_chunk(batch, noise=noise, **rtc)
    return post(actions)


def make(policy_name: str, out: Path) -> None:
    from lerobot.policies.factory import make_pre_post_processors

    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    root = out / policy_name
    if root.exists():
        shutil.rmtree(root)
    backbone = root / "backbone"
    if policy_name == "smolvla":
        smolvla_backbone(backbone)
        policy = smolvla_policy(backbone)
        sizes = None
    elif policy_name in ("pi0", "pi05"):
        policy, vocab = pi_policy(policy_name, backbone)
        sizes = {**PI_SIZES, "vocab_size": vocab}
    else:
        raise SystemExit(f"unknown policy {policy_name!r}; one of smolvla, pi0, pi05")
    policy.eval()
    dataset_stats = {"observation.state": stats(STATE_DIM, gen), "action": stats(ACTION_DIM, gen)}
    pre, post = make_pre_post_processors(policy.config, dataset_stats=dataset_stats)
    folder = root / "pretrained_model"
    policy.save_pretrained(folder)
    pre.save_pretrained(folder)
    post.save_pretrained(folder)

    cfg = policy.config
    n = len(RTC)
    frames = observations(gen, n)
    noise = torch.randn(n, cfg.chunk_size, cfg.max_action_dim, generator=gen)
    tensors = {"noise": noise, "state": torch.stack([f["observation.state"] for f in frames])}
    for key in CAMERAS:
        tensors[key] = torch.stack([f[key] for f in frames])
    tensors["alone"] = torch.cat([run(policy, pre, post, [f], noise[i:i + 1]) for i, f in enumerate(frames)])
    tensors["batched"] = run(policy, pre, post, frames, noise)
    rtc_out = []
    for i, (k, delay, horizon) in enumerate(RTC):
        prev_model = torch.randn(1, k, ACTION_DIM, generator=gen) * 0.7  # the model's (normalized) space
        tensors[f"rtc_prev_actions_{i}"] = post(prev_model)[0]  # what a robot holds: the returned space
        rtc_out.append(run(policy, pre, post, [frames[i]], noise[i:i + 1], inference_delay=delay,
                           prev_chunk_left_over=prev_model, execution_horizon=horizon))
    tensors["rtc"] = torch.cat(rtc_out)
    save_file({k: v.contiguous().float() for k, v in tensors.items()}, str(root / "cases.safetensors"))
    meta = {"policy": policy_name, "prompts": [f["task"] for f in frames], "cameras": list(CAMERAS),
            "rtc": [{"k": k, "inference_delay": d, "execution_horizon": s} for k, d, s in RTC],
            "sizes": sizes, "lerobot": __import__("lerobot").__version__, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__}
    (root / "cases.json").write_text(json.dumps(meta, indent=1) + "\n")
    # the folder names its backbone by the path given at build time; keep it relative to the repo
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    for field in ("vlm_model_name",):
        if field in config:
            config[field] = os.path.relpath(config[field])
    config_path.write_text(json.dumps(config, indent=4) + "\n")
    print(f"{policy_name}: {sum(p.numel() for p in policy.parameters())} parameters -> {root}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", required=True, choices=("smolvla", "pi0", "pi05"))
    parser.add_argument("--out", default="tests/data/lerobot", type=Path)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    make(args.policy, args.out)


if __name__ == "__main__":
    main()
