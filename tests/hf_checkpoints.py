"""Tiny random Hugging Face checkpoints written by transformers itself, for `hf_causal_lm` tests.

    folder = write_checkpoint(tmp_path / "qwen2", "qwen2")      # config.json, model.safetensors, tokenizer
    model = load_reference(folder)                               # transformers' own model of that folder

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few sentences (so any
text encodes, multi-byte characters as several tokens), with <s> / </s> / <pad> and ChatML-style
chat markers, a BOS added by its post-processor, and a chat template; the weights are transformers'
random initialisation under a fixed seed, scaled up so that greedy decoding does not repeat one token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Robots fold laundry, pour coffee and stack blocks.",
          "Le café est prêt — voilà! Über straße, naïve façade.", "1 2 3 4 5 6 7 8 9 10 +-*/=()[]{}",
          "def f(x):\n    return x * 2\n", "€ £ ¥ — “quotes” ‘single’ 日本語 中文 한국어"] * 4
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def write_tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def write_checkpoint(folder: Path, family: str, *, tied: bool = False, seed: int = 0, shape: dict | None = None,
                     **overrides: Any) -> Path:
    """A random `family` checkpoint with the test tokenizer in `folder` (created)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    folder.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(folder)
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    fields = dict(SHAPE if shape is None else shape)
    if family == "qwen3":
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    if family == "mistral":
        fields.setdefault("sliding_window", None)
    vocab = overrides.pop("vocab_size", len(tok))  # larger than the tokenizer's, as real checkpoints often are
    config = config_class(vocab_size=vocab, tie_word_embeddings=tied, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                          **fields, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0 if p.dim() > 1 else 1.0).add_(0.02 * torch.randn_like(p) if p.dim() == 1 else 0)
    model.generation_config.eos_token_id = [tok.eos_token_id, config.eos_token_id]
    model.save_pretrained(str(folder))
    return folder


def load_reference(folder: Path) -> Any:
    """transformers' model of `folder` in float32, eval mode: the reference every test compares against."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def reference_greedy(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for `prompt` (no EOS stop) and each token's log-prob (log_softmax of its logits)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, output_scores=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    log_probs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, log_probs
