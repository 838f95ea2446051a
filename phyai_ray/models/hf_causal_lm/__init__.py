"""`hf_causal_lm`: Hugging Face causal LMs (Llama, Qwen2, Qwen3, Mistral) from a local folder.

    checkpoint.py  config.json -> the decoder's shape (unsupported fields refused); safetensors slices
    shards.py      which slice of every tensor a rank keeps (tensor parallel over the named groups)
    model.py       the per-rank decoder on `reference_lm`'s slot KV cache (the iteration protocol)
    tokenizer.py   the checkpoint's tokenizer and chat template (tokenizers + jinja2), incremental text
    request.py     requests: token ids or text, sampling knobs, ignore_eos
    entry.py       the plugin entry (dispatcher side)

Run: phyai-ray serve hf_causal_lm --plugin-args '{"model": "/path/to/folder"}'
"""

from phyai_ray.models.hf_causal_lm.checkpoint import Architecture, Checkpoint, CheckpointError
from phyai_ray.models.hf_causal_lm.config import HFCausalLMConfig
from phyai_ray.models.hf_causal_lm.entry import HFCausalLMEntry

__all__ = ["Architecture", "Checkpoint", "CheckpointError", "HFCausalLMConfig", "HFCausalLMEntry"]
