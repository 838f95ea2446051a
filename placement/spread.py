"""Which node each replica should prefer, so replicas spread over nodes where they can.

Pure: takes a snapshot of nodes (id and total resources) and the resources one replica needs.
Replica i goes to the i-th node (round robin) among the nodes that can hold a whole replica,
largest first; with no such node there is no preference and Ray decides.

>>> spread_targets([("a", {"CPU": 4}), ("b", {"CPU": 8})], {"CPU": 2}, 3)
['b', 'a', 'b']
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def replica_demand(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Sum of a replica's bundles."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return total


def fits(capacity: Mapping[str, float], demand: Mapping[str, float]) -> bool:
    return all(capacity.get(k, 0.0) >= v for k, v in demand.items())


def spread_targets(nodes: Sequence[tuple[str, Mapping[str, float]]], demand: Mapping[str, float],
                   replica_count: int) -> list[str | None]:
    """A preferred node id per replica (None where no node can hold a replica)."""
    able = [(node_id, res) for node_id, res in nodes if fits(res, demand)]
    able.sort(key=lambda n: (-n[1].get("GPU", 0.0), -n[1].get("CPU", 0.0), n[0]))
    if not able:
        return [None] * replica_count
    return [able[i % len(able)][0] for i in range(replica_count)]


def physical_device(logical: int, visible: str | None) -> str:
    """The device id a rank must see, given the launcher's CUDA_VISIBLE_DEVICES.

    >>> physical_device(1, "4,5,6")
    '5'
    >>> physical_device(1, None)
    '1'
    """
    if not visible:
        return str(logical)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if not 0 <= logical < len(ids):
        raise ValueError(f"device {logical} is not visible: CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)} "
                         f"device(s); use indices 0..{len(ids) - 1}")
    return ids[logical]


def check_feasible(plans: Sequence[Any], nodes: Sequence[tuple[str, Mapping[str, float]]]) -> None:
    """Raise ValueError when the cluster's TOTAL resources can never hold every replica of `plans`.

    STRICT_PACK needs one node that fits a whole replica; every strategy needs each bundle to fit
    some node, and the sum over all replicas to fit the sum over all nodes.
    """
    totals = replica_demand([res for _, res in nodes])
    need = replica_demand([b for plan in plans for b in plan.bundles])
    hint = "run `ray status` to see the cluster, or lower replica_count, parallel sizes or cpus_per_rank"
    for plan in plans[:1]:
        if plan.strategy == "STRICT_PACK" and not any(fits(res, replica_demand(plan.bundles)) for _, res in nodes):
            raise ValueError(f"no node can hold one whole replica ({plan.world_size} bundles of {plan.bundles[0]}, "
                             f"STRICT_PACK needs {replica_demand(plan.bundles)} on one node); {hint}")
        if not any(fits(res, plan.bundles[0]) for _, res in nodes):
            raise ValueError(f"no node can hold one rank bundle {plan.bundles[0]}; {hint}")
    if not fits(totals, need):
        raise ValueError(f"{len(plans)} replica(s) need {need} in total but the cluster has {totals}; {hint}")
