"""`reference_lm`: a small causal transformer that generates tokens, tensor-parallel, seeded weights.

    config.py   plugin_args, topology checks, the request model and its per-prompt sequences
    model.py    causal attention over a paged KV cache (the layers of `phyai_ray.nn`), the iteration protocol
    score.py    the trainer side: log-probs of a completion in plain torch (no engine, no cache)
    entry.py    the plugin entry (a request -> one sequence per prompt -> one TokenOutput per prompt)

Its KV blocks, sampling and decoder loop are the LLM runtime's (`phyai_ray.llm`), shared with `hf_causal_lm`.
"""

from phyai_ray.models.reference_lm.config import ReferenceLMConfig
from phyai_ray.models.reference_lm.entry import ReferenceLMEntry
from phyai_ray.models.reference_lm.model import ReferenceLM
from phyai_ray.models.reference_lm.score import full_weights, score

__all__ = ["ReferenceLM", "ReferenceLMConfig", "ReferenceLMEntry", "full_weights", "score"]
