"""The iteration protocol: plugins whose work is a loop of steps, batched per iteration.

A request is split into sequences (`Entry.sequences`); the replica runs ONE loop over every
running sequence of every request, and sequences join and leave between iterations. A sequence
is whatever the plugin advances one step at a time: a prompt decoded one token per iteration, a
video latent denoised one step per iteration, a robot's action chunk one flow step per iteration.

    Entry.sequences(request)      -> [SequenceSpec(payload, cost, group), ...]     in the dispatcher
    Entry.admission(batching)     -> AdmissionPolicy: which waiting sequences join the next iteration
    per-rank model (every rank, the same plan, the same forward):
        admit(seq_id, payload)    a new sequence: its first step (an LLM's prefill) runs in the next iterate()
        drop(seq_id)              forget a sequence (cancelled, past its deadline, aborted); free its slot
        recompute(seq_id)         rebuild this sequence's state from its history under the current
                                  weights, in the next iterate() (an LLM: its KV cache from the prompt
                                  and every token so far; after a weight update or a sleep)
        iterate()                 -> {seq_id: Delta}: ONE iteration over every running sequence;
                                  a finished sequence frees its own slot
    Entry.gather(request, outputs) -> the request's result, from one output per sequence, in order:
                                  the sequence's `Delta.value` when it gave one, else a `TokenOutput`

A sequence's output is tokens (LLMs: `Delta.token_ids`, `log_probs`, `top_logprobs`, the words stay
where they mean tokens) or a value (`Delta.value`: a denoised latent, an action chunk), first-class
either way: the loop records the weight version of the iteration that produced each token, and of
the one that gave the value, so a value plugin's result carries its weight_version too.

Admission (`AdmissionPolicy`): before every iteration the loop asks the plugin's policy which
waiting sequences join, head first, given what runs (`Candidate`: cost in the plugin's own units,
group, progress, whether it is being rebuilt). The first refusal ends the round: nothing overtakes
the sequence refused. `phyai_ray.plugins.admission` has the policies: `TokenBudget` (the default:
max_num_seqs and max_num_batched_tokens), `CostBudget` (every running sequence costs every
iteration, as a denoising step does) and `GroupLimit` (at most K groups, e.g. LoRA adapters or
latent shapes, per iteration). A policy with `report(capacity)` also sees the ranks' KV cache: a
per-rank model whose `iterate()` returns `Deltas` with a `KVReport` (free blocks, block size, the
tokens its own sequences take next) lets `KVBlocks` admit only what the ranks can start at once.

Every plan reaches every rank of the replica in the same order, so ranks that share collectives
run the same iterations; only the output rank's deltas are read. `RankRunner.iterate(plan)` applies
a plan: drops, then recomputes, then admits, then pauses and resumes (turns), then one `iterate()`.
Turns need two more methods of the per-rank model, `pause_sequence(seq_id)` and `resume_sequence(seq_id)` (a model
built on `phyai_ray.stepwise.sequence.Running` delegates them to it); see `IterationPlan`.

A request's failure is its own: an `admit` that raises (the model keeps nothing of that sequence),
a `Delta(stop_reason="error", error=exc)` or a `SequenceError` naming sequences fails only those
requests, and the replica keeps its ranks (docs/concepts/replicas.md has the failure table).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

ITERATION_METHODS = ("admit", "drop", "recompute", "iterate")


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence of a request: what `admit` receives, what it costs, and its group.

    `cost` is in the plugin's own units, per iteration while it runs, as its admission policy reads
    it: tokens of an LLM prompt (its prefill; `TokenBudget` then counts 1 per later iteration),
    latent tokens x CFG branches of a diffusion request (`CostBudget` counts it every iteration).
    `group`: an optional hashable key (a latent shape, a LoRA adapter) a policy may limit per iteration.
    `steps`: the iterations it runs at most (a flow policy's denoising steps, an LLM's max_tokens);
    with a deadline, the loop admits it only if `steps` x its recent iteration time ends in time.
    None (unknown): no such estimate; only the deadline itself is checked.
    """

    payload: Any
    cost: int = 1
    group: Hashable | None = None
    steps: int | None = None


@dataclass
class Delta:
    """What one iteration produced for one sequence: its new tokens or its value, and whether it ended.

    `stop_reason` is None while the sequence runs, else "completed" or "length" (its slot is free),
    or "error" with `error` set: the sequence failed alone (its decode, its guardrail check, its own
    input, out of memory in its own stage) and the model has already freed it; the loop fails only
    its request with `error` (a `RequestRejectedError` subclass is the client's fault, a 4xx) and
    drops it on every rank at the next plan (so `drop` must ignore an id it no longer holds).
    An iteration may return an empty delta (a chunked prefill, a denoising step with nothing to show).
    Token sequences: `token_ids`, their `log_probs`, and `top_logprobs` (when the sequence asked for
    k of them: per token its k most likely tokens {token id: log-prob}; empty otherwise).
    Value sequences: `value` (a denoised action chunk, a video latent), given with the last delta
    or updated by later ones; `Entry.gather` receives it for the sequence instead of a `TokenOutput`.
    `progress` (any value, e.g. {"step": i, "of": n}): what a streamed value request reports after this
    iteration; its stream gets one item per report, then the gathered result as its last item.
    `preempted`: how often the ranks preempted the sequence since its last delta (its cache freed, to
    be recomputed); the loop sums them into `TokenOutput.num_preempted`.
    """

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    value: Any = None
    progress: Any = None
    preempted: int = 0
    error: BaseException | None = None


class SequenceError(Exception):
    """Raised by a per-rank model's `iterate()` to name the sequences that failed in it, {seq_id: error}.

    Those requests fail with their errors; the model must have freed them (the loop drops them on
    every rank at the next plan too), and the rank runs `iterate()` once more for the others. On a
    replica of several ranks every rank must raise it for the same sequences, as for `admit`: ranks
    that name different sequences have diverged, and the replica is failed."""

    def __init__(self, errors: dict[int, BaseException]) -> None:
        named = ", ".join(f"{ident}: {type(exc).__name__}" for ident, exc in sorted(errors.items()))
        super().__init__(f"sequence(s) failed in iterate(): {{{named}}}")
        self.errors = dict(errors)

    def __reduce__(self):
        return (SequenceError, (self.errors,))


@dataclass
class RankIteration:
    """What one rank answers for one iteration (`RankRunner.iterate`): the output rank its `deltas`,
    every rank the sequences that failed alone on it (their `admit` raised, or `SequenceError`).

    `errors` holds the exceptions themselves on the output rank (the requests fail with them);
    `kinds` {seq_id: exception type name} is what ranks compare: only when every rank of the replica
    failed the same sequences with the same types do those requests fail alone. A non-output rank
    with nothing failed answers None, so nothing travels back from it."""

    deltas: dict[int, Delta] | None = None
    errors: dict[int, BaseException] = field(default_factory=dict)
    kinds: dict[int, str] = field(default_factory=dict)
    timing: "RankTiming | None" = None  # the output rank's part of the iteration


@dataclass(frozen=True)
class RankTiming:
    """A rank's part of one iteration, in seconds (phyai_ray.executors.loop_timing): applying the plan,
    the per-rank model's iterate(), and the forward inside it when the model's `Deltas` say (`forward_s`)."""

    plan_s: float
    iterate_s: float
    forward_s: float | None = None


@dataclass(frozen=True)
class KVReport:
    """A rank's KV cache after one iteration, as admission reads it (every rank of a replica holds an
    equal pool and makes the same choices, so the output rank's report stands for all of them).

    free_blocks   blocks a NEW sequence may take in the next iteration: the free ones (cached blocks
                  nobody holds included) less what the rank's own sequences still need for the tokens
                  they have pending (each decode's next token, the rest of a prompt part way, a
                  preempted sequence's whole history); never below 0
    block_size    tokens per block
    busy_tokens   new tokens the rank's own sequences feed in the next iteration, before any new one
    token_budget  new tokens one iteration feeds at most (the chunk budget)

    64 blocks of 16, 40 held, two decodes about to open a block each, a prompt part way needing 3
    more: KVReport(free_blocks=64 - 40 - 2 - 3 = 19, block_size=16, busy_tokens=2 + 40, token_budget=2048).
    """

    free_blocks: int
    block_size: int
    busy_tokens: int = 0
    token_budget: int | None = None


class Deltas(dict):
    """What a per-rank `iterate()` may return instead of a plain dict: {seq_id: Delta}, with the rank's
    `capacity` (a `KVReport`) after the iteration. The loop hands the output rank's latest report to
    its admission policy when the policy has `report(capacity)` (`phyai_ray.plugins.admission.KVBlocks`).

        return Deltas(deltas, capacity=KVReport(free_blocks=12, block_size=16, busy_tokens=3, token_budget=4096))

    `stepped=False` says the iteration advanced no sequence (it only collected work finished beside
    the loop, e.g. a video decoded on a stage): its time is not the pace the loop's finish-by
    estimates read (`SequenceSpec.steps` x the recent iteration time).

        return Deltas(decoded, stepped=False)

    `forward_s`: the seconds of this iteration's forward (the model's math; on a GPU, until its output is
    on the host), so the loop tells the host work around it apart (phyai_ray.executors.loop_timing);
    without it the whole iterate() counts as the forward.
    """

    def __init__(self, deltas: Any = (), capacity: KVReport | None = None, stepped: bool = True,
                 forward_s: float | None = None) -> None:
        super().__init__(deltas)
        self.capacity, self.stepped, self.forward_s = capacity, stepped, forward_s


def capacity_of(reply: Any) -> KVReport | None:
    """The `KVReport` of one iteration's reply (a `RankIteration` or the deltas themselves), if it has one."""
    deltas = reply.deltas if isinstance(reply, RankIteration) else reply
    return getattr(deltas, "capacity", None)


def stepped(reply: Any) -> bool:
    """Whether one iteration's reply (a `RankIteration` or the deltas) advanced a sequence: True unless
    its `Deltas` say `stepped=False`."""
    deltas = reply.deltas if isinstance(reply, RankIteration) else reply
    return getattr(deltas, "stepped", True)


@dataclass(frozen=True)
class IterationPlan:
    """What every rank does before one iteration: the same plan, in the same order, everywhere.

    `recompute` lists sequences whose state is rebuilt from their history (see the module docstring).
    Turns (an admission policy `phyai_ray.plugins.admission.Turns`): `pause` lists running sequences
    that sit out from this iteration on (the rank keeps their state; `model.pause_sequence(seq_id)`), `resume`
    the paused ones that step again from this iteration on (`model.resume_sequence(seq_id)`). A newly admitted
    sequence always steps in its first iteration; a plan without turns leaves both empty."""

    admit: tuple[tuple[int, Any], ...] = ()  # (seq_id, payload)
    drop: tuple[int, ...] = ()
    recompute: tuple[int, ...] = ()
    pause: tuple[int, ...] = ()
    resume: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.admit or self.drop or self.recompute or self.pause or self.resume)


class Candidate(NamedTuple):
    """What an admission policy sees of one sequence (waiting or running); no loop internals.
    Immutable (a named tuple: the loop makes one per running sequence per plan, and a tuple is
    made in a fraction of a frozen dataclass's time).

    cost        its `SequenceSpec.cost` (the plugin's own units)
    group       its `SequenceSpec.group`
    generated   tokens it has produced so far (0 while waiting, and for a value sequence)
    rebuild     a running sequence whose state is rebuilt in the coming iteration (`recompute`):
                an LLM then processes cost + generated tokens for it
    """

    cost: int
    group: Hashable | None = None
    generated: int = 0
    rebuild: bool = False


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Which waiting sequences join the next iteration. One per replica, asked by the loop's thread
    with the loop's lock held (so keep it quick and never block):

        begin(running)      a new plan starts; `running` are the sequences that run in it (rebuilds included)
        admit(candidate)    the waiting head: True, it joins this iteration (count it); False, it and
                            every sequence behind it wait for a later iteration (nothing overtakes it)

    `begin` is called only when some sequence waits and admission is open. A policy should admit
    the head when nothing runs, or a sequence larger than every limit would wait forever.
    A policy may also have `report(capacity)`: after every iteration whose output rank reported its
    KV cache (`Deltas.capacity`, a `KVReport`), the loop hands it the report, before the next plan.
    """

    def begin(self, running: Sequence[Candidate]) -> None: ...

    def admit(self, candidate: Candidate) -> bool: ...


def is_iterative(model: Any) -> bool:
    """Whether a per-rank model implements the iteration protocol (every method of it)."""
    return all(callable(getattr(model, name, None)) for name in ITERATION_METHODS)
