"""`hf_causal_lm`: Hugging Face causal LMs (Llama, Qwen2, Qwen3, Mistral) from a local folder.

    checkpoint.py  config.json -> the decoder's shape (unsupported fields refused); safetensors slices
    shards.py      which slice of every tensor a rank keeps (tensor parallel over the named groups)
    model.py       the per-rank decoder on the paged KV cache of `phyai_ray.llm` (the iteration protocol)
    request.py     requests: token ids or text, sampling knobs, ignore_eos
    entry.py       the plugin entry (dispatcher side)

The tokenizer and chat template, KV blocks, sampling and the decoder loop are the LLM runtime's
(`phyai_ray.llm`), shared with `reference_lm` and the OpenAI edge.

Run: phyai-ray serve hf_causal_lm --plugin-args '{"model": "/path/to/folder"}'
"""

from phyai_ray.models.hf_causal_lm.checkpoint import Architecture, Checkpoint, CheckpointError
from phyai_ray.models.hf_causal_lm.config import HFCausalLMConfig
from phyai_ray.models.hf_causal_lm.entry import HFCausalLMEntry

__all__ = ["Architecture", "Checkpoint", "CheckpointError", "HFCausalLMConfig", "HFCausalLMEntry"]
