"""`Entry`: what a plugin declares, and how the engine checks a topology against it.

    @register_plugin
    class TinyTPEntry(Entry):
        name = "tiny_tp"
        parallel_domains = frozenset({"dense"})
        def create(self, plugin_args, ctx):
            return TinyTP(plugin_args, ctx)

By default a plugin declares no domain, so it runs on one rank only: a topology it cannot run
fails before any worker starts instead of silently running unrelated copies of the model.
"""

from __future__ import annotations

from typing import Any, ClassVar

from phyai_ray.errors import ParallelConfigError
from phyai_ray.plugins.admission import TokenBudget

KNOWN_DOMAINS = frozenset({"dense", "attention", "moe", "pipeline", "cfg"})


def axis_domain(axis: str) -> str:
    """The domain an axis of `ParallelConfig.split_axes()` belongs to: dense_tp -> dense, pp -> pipeline."""
    return {"pp": "pipeline", "cfg": "cfg"}.get(axis, axis.split("_")[0])


class Entry:
    """Base class of a plugin. Subclass it, set `name`, implement `create`."""

    name: ClassVar[str] = ""
    parallel_domains: ClassVar[frozenset[str]] = frozenset()
    request_model: ClassVar[Any] = None  # optional pydantic model describing one request (HTTP body)
    # BatchingConfig.max_batch_size when the deployment leaves it unset (None): a plugin whose per-rank
    # model has `step_batch` and batches well says so here (reference_dit, minilm, reference_policy: 64);
    # 1 keeps every request a step of its own. Delay 0: nothing waits when the replica is idle.
    default_max_batch_size: ClassVar[int] = 1

    def configure(self, plugin_args: dict[str, Any]) -> None:
        """Learn the engine's plugin_args before any check runs (e.g. the model shape); optional."""

    def validate_parallel(self, parallel: Any) -> None:
        """Tighten the topology rules; raise `ParallelConfigError` with the numbers to reject one."""

    def validate_request(self, request: Any) -> Any:
        """Reject a bad request before any rank sees it: raise (the engine answers `RequestRejectedError`).

        Return None to run `request` as it is, or the form to run instead (its parsed form, e.g. the
        prompts tokenized): `batch_key`, `request_size`, `sequences`, `gather` and the ranks then receive
        that, and nothing validates it again (`phyai_ray/validation.py`)."""

    def batch_key(self, request: Any) -> Any:
        """Requests with different keys never share a batch (shape, guidance scale, sampling parameters).

        Runs in the dispatcher, after `validate_request`, only when batching is on; the key must be
        hashable. Default: one key for every request."""
        return None

    def request_size(self, request: Any) -> int:
        """How many samples `request` carries (counted against `max_batch_size`); runs in the dispatcher."""
        return 1

    def affinity_key(self, request: Any) -> Any:
        """What requests that should share a replica have in common (a prompt's leading tokens: its
        cached prefix), hashable; None: none. Read by the dispatcher with `DeploymentConfig.routing =
        "affinity"`, after `validate_request`. Default: None."""
        return None

    def sequences(self, request: Any) -> list[Any]:
        """Plugins with the iteration protocol: the request's sequences (`plugins.iteration.SequenceSpec`),
        batched per iteration with every other request's; runs in the dispatcher. Not overridden: the
        plugin runs whole requests (step / step_batch)."""
        raise NotImplementedError(f"plugin {self.display_name()} does not split requests into sequences")

    def gather(self, request: Any, outputs: list[Any]) -> Any:
        """The request's result from one output per sequence, in order: the sequence's `Delta.value`
        when it gave one, else its `TokenOutput` (default: that list)."""
        return outputs

    def admission(self, batching: Any) -> Any:
        """Plugins with the iteration protocol: the `AdmissionPolicy` that decides which waiting
        sequences join the next iteration (`phyai_ray.plugins.admission`), built once per replica.
        Default: `TokenBudget(batching.max_num_seqs, batching.max_num_batched_tokens)`, for token
        plugins whose `SequenceSpec.cost` is a prompt's length. A diffusion plugin returns e.g.
        `CostBudget(batching.max_num_seqs, latent_tokens_per_step)`."""
        return TokenBudget(batching.max_num_seqs, batching.max_num_batched_tokens)

    @property
    def iterative(self) -> bool:
        """Whether the plugin splits requests into sequences (the iteration protocol)."""
        return type(self).sequences is not Entry.sequences

    def max_sequence_tokens(self) -> int | None:
        """Token plugins: the longest prompt + completion the model takes (the OpenAI route refuses
        longer requests before it copies them); None when there is no such limit."""
        return None

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> Any:
        """Build the per-rank model; it needs a `step(request)` method (and `step_batch(requests)` to batch)."""
        raise NotImplementedError(f"plugin {self.display_name()} must implement create(plugin_args, ctx)")

    def display_name(self) -> str:
        return self.name or type(self).__qualname__

    def served_name(self) -> str:
        """The model's name on the protocols (OpenAI's `model`, OIP's model name) unless the app sets one."""
        return self.display_name()

    def check_parallel(self, parallel: Any) -> None:
        """Reject axes in undeclared domains, then run the plugin's own `validate_parallel`."""
        unknown = set(self.parallel_domains) - KNOWN_DOMAINS
        if unknown:
            raise ParallelConfigError(
                f"plugin {self.display_name()} declares unknown parallel_domains {sorted(unknown)}; "
                f"known domains: {sorted(KNOWN_DOMAINS)}")
        undeclared = {a: s for a, s in parallel.split_axes().items()
                      if axis_domain(a) not in self.parallel_domains}
        if undeclared:
            shown = ", ".join(f"{a}={s}" for a, s in undeclared.items())
            declared = sorted(self.parallel_domains) or "none (single rank only)"
            raise ParallelConfigError(
                f"plugin {self.display_name()} implements parallel domains {declared}, but the config "
                f"splits {shown}; use a topology within those domains, or a plugin that declares them")
        self.validate_parallel(parallel)

    # -- optional signatures: Open Inference Protocol metadata (checked before validate_request), openpi metadata
    inputs: ClassVar[tuple[Any, ...]] = ()  # TensorSpec (phyai_ray.plugins.signature) of each tensor input
    outputs: ClassVar[tuple[Any, ...]] = ()  # TensorSpec of each output; names a tensor result's output

    def policy_metadata(self) -> dict[str, Any]:
        """The first frame a robot-policy client receives (openpi's WebSocket protocol); {} by default."""
        return {}
