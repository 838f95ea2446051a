"""`BatchingConfig`: how a replica's scheduler groups queued requests into one step.

On by default for plugins that declare it: `max_batch_size=None` means the plugin's own default
(`Entry.default_max_batch_size`: 64 for reference_dit, minilm and reference_policy, 1 for the
others), with no delay, so an idle replica runs a lone request at once and only what queued while
a step ran joins the next one. `max_batch_size=1` (`--max-batch-size 1`) turns it off.

    DeploymentConfig.local(replica_count=2, batching=BatchingConfig(max_batch_size=32, max_batch_delay_ms=2))
    phyai-ray serve --plugin reference_dit --max-batch-size 32 --max-batch-delay-ms 2
    serve run phyai_ray.serve:build_app plugin=reference_dit max_batch_size=32 max_batch_delay_ms=2

It lives in `DeploymentConfig`, beside `replica_count` and the queue bounds of `process_config`,
because it decides how requests are scheduled onto replicas, not what a replica computes: the
same plugin and `EngineConfig` give the same results with batching on or off, and one model can
be deployed batched behind HTTP and unbatched in a latency-critical robot loop. Batching applies
only to plugins whose per-rank model has `step_batch(requests)`; for others it changes nothing.

Plugins with the iteration protocol (`phyai_ray.plugins.iteration`, e.g. `reference_lm`) are
batched per iteration instead, always: up to `max_num_seqs` sequences run at once, each iteration
processes at most `max_num_batched_tokens` tokens, and `cache_after_update` says what a running
sequence's cache becomes when the weights change under it (vLLM's knobs, same names). Plugins
whose sequences cost in every step (a denoising step re-costs each running request) read
`step_budget` instead, defaulting to what the model states, and take turns when it is full (`over_budget`).

`scheduling` orders both kinds of queue: "deadline" (the default) serves the earliest deadline
first, "fifo" the earliest arrival. Without per-request deadlines the two are the same order.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from phyai_ray.config.base import ConfigModel
from phyai_ray.errors import DeploymentConfigError


class BatchingConfig(ConfigModel):
    """Dynamic batching inside one replica group: Triton's dynamic batcher, Ray Serve's @serve.batch."""

    max_batch_size: int | None = Field(
        None, ge=1, le=1 << 20, description="Most samples (Entry.request_size of each request) one step runs; "
        "1 turns batching off; unset: the plugin's default (64 for reference_dit, minilm and reference_policy, "
        "else 1). A single request larger than this runs as a batch of its own.")
    max_batch_delay_ms: float = Field(
        0.0, ge=0, le=60_000, description="0: dispatch whatever waits as soon as the ranks have room (a batch "
        "forms from the requests that queued while the previous step ran). > 0: when fewer than max_batch_size "
        "samples wait, wait up to this long after the oldest one arrived for more (never past half its "
        "own time limit, nor so late that its step would end after its deadline): more throughput at light load, up to this much more latency.")
    preferred_batch_sizes: tuple[int, ...] = Field(
        (), description="Batch sizes to dispatch as soon as they are reached (e.g. the sizes a CUDA graph was "
        "captured for): a batch that can end exactly at one is cut there and dispatched without waiting.")

    scheduling: Literal["deadline", "fifo"] = Field(
        "deadline", description="Which queued request runs (or joins a batch, or gets a sequence slot) next: "
        "'deadline' (earliest deadline first: a request's own deadline, from Engine.submit(deadline_s=), "
        "X-Request-Deadline-Ms, OIP parameters.deadline_ms or openpi's deadline_ms, else its arrival plus "
        "default_deadline_s) or 'fifo' (arrival order). Either way a request whose own deadline passes "
        "before it starts is answered at once with DeadlineMissedError and never runs.")
    default_deadline_s: float | None = Field(
        10.0, gt=0, le=86_400, description="The queue-order deadline of a request that gives none of its own: "
        "earliest-deadline-first sorts it as due this long after arrival (it is never failed for it); the "
        "iteration loop adds its planned steps x the recent iteration time, so a long job never sorts ahead of "
        "a deadline request due before it could end (executors/turns.py). 10 s: "
        "far behind any robot deadline (tens to hundreds of ms), so those still go first, yet well inside "
        "the 30-60 s a typical HTTP client waits, so a bulk request beside a saturated fleet is served "
        "instead of waiting behind every deadline request. None: such requests sort by their own time limit "
        "(execution_timeout_s when set, else the hang limit).")
    late: Literal["finish", "drop"] = Field(
        "finish", description="What a request with its own deadline gets when its result is ready only after "
        "that deadline: 'finish' delivers it (timing says deadline_met=false), 'drop' answers "
        "DeadlineMissedError instead (fail closed: a robot never executes a stale action chunk). Each "
        "request may override it (Engine.submit(late=...), openpi's late, OIP parameters.late).")
    max_num_seqs: int = Field(
        256, ge=1, le=1 << 16, description="Iteration protocol: most sequences running at once in one replica; "
        "the others wait (first come, first served) and join as slots free up.")
    max_num_batched_tokens: int = Field(
        4096, ge=1, le=1 << 24, description="Iteration protocol: most tokens one iteration processes (a prompt's "
        "prefill counts its length, every running sequence 1); a prompt longer than this runs in an iteration "
        "of its own.")
    step_budget: int | None = Field(
        None, ge=1, le=1 << 40, description="Iteration protocol, plugins whose running sequences cost in every "
        "step (diffusion, flow policies: plugins.admission.per_step): the most cost, in the plugin's units (e.g. "
        "latent tokens x CFG branches), of the sequences stepping in one iteration. Unset: the plugin's own "
        "default (diffusers_pipeline: two requests of its folder's recommended shape).")
    over_budget: Literal["turns", "wait"] = Field(
        "turns", description="Iteration protocol, plugins whose per-rank model can pause a sequence: 'turns': what "
        "step_budget cannot hold takes turns per step (earliest deadline, then least remaining work), so a short "
        "request beside a long one ends first; 'wait': a sequence joins only when it fits beside every running one.")
    cache_after_update: Literal["recompute", "keep"] = Field(
        "recompute", description="Iteration protocol: a sequence frozen by pause(mode='keep') across a weight update "
        "(or a sleep) rebuilds its cache from its whole history under the new weights ('recompute': every later "
        "log-prob is the new weights' own), or continues on the cache as computed ('keep': cheaper, the tokens "
        "after the update attend to keys and values of the old weights).")

    @model_validator(mode="after")
    def _check_sizes(self) -> "BatchingConfig":
        limit = self.max_batch_size if self.max_batch_size is not None else 1 << 20
        bad = [s for s in self.preferred_batch_sizes if not 1 <= s <= limit]
        if bad or len(set(self.preferred_batch_sizes)) != len(self.preferred_batch_sizes):
            raise DeploymentConfigError(
                f"preferred_batch_sizes={self.preferred_batch_sizes} must be distinct sizes in [1, max_batch_size="
                f"{self.max_batch_size}], e.g. (8, 16) with max_batch_size=16")
        return self

    def resolve(self, plugin_default: int) -> "BatchingConfig":
        """This config with `max_batch_size` set: as given, else the plugin's default (checked again)."""
        if self.max_batch_size is not None:
            return self
        return BatchingConfig(**{**self.model_dump(), "max_batch_size": plugin_default})

    @property
    def enabled(self) -> bool:
        """Batching is on (after `resolve`; unresolved, only an explicit size above 1 counts)."""
        return (self.max_batch_size or 1) > 1

    @property
    def max_delay_s(self) -> float:
        return self.max_batch_delay_ms / 1000.0
