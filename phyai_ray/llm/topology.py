"""What a decoder asks of a topology, and one refusal that names every unmet rule.

    refuse("hf_causal_lm", parallel, [(heads % tp == 0, f"heads={heads} % attention.tp={tp}"),
                                      *decoder_rules(parallel)])
    # ParallelConfigError: hf_causal_lm cannot run <topology>: pp and cfg must be 1; ...

A `PagedDecoder` runs the whole batch on every rank, one token per decode step: no pipeline
or CFG stages, no context parallelism, no split batch. Each plugin adds its own divisibility rules.
"""

from __future__ import annotations

from typing import Any

from phyai_ray.errors import ParallelConfigError


def decoder_rules(parallel: Any) -> list[tuple[bool, str]]:
    """What every decoder (reference_lm, hf_causal_lm) needs of a topology besides its own divisibility."""
    return [(parallel.outer.pp_size == 1 and parallel.outer.cfg_size == 1, "pp and cfg must be 1"),
            (getattr(parallel.attention, "cp_size", 1) == 1, "attention.cp must be 1 (decode is one token)"),
            (all(getattr(parallel, d).dp_size == 1 for d in ("dense", "attention") if d in parallel.explicit_domains),
             "an explicit dp must be 1 (the batch is not split)")]


def refuse(plugin: str, parallel: Any, rules: list[tuple[bool, str]], where: str = "") -> None:
    bad = [why for ok, why in rules if not ok]
    if bad:
        raise ParallelConfigError(f"{plugin} cannot run {parallel.describe()}{where}: {'; '.join(bad)}")
