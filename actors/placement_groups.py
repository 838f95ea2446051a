"""The one module that creates and removes Ray placement groups."""

from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from phyai_ray.errors import StartupError
from placement.bundles import ReplicaPlan
from placement.spread import replica_demand, spread_targets

logger = logging.getLogger(__name__)


def alive_nodes() -> list[tuple[str, dict[str, float]]]:
    """(node id, total resources) of every alive node."""
    return [(n["NodeID"], dict(n["Resources"])) for n in ray.nodes() if n.get("Alive")]


def node_targets(plans: list[ReplicaPlan], spread: bool) -> list[str | None]:
    """Preferred node per replica; only STRICT_PACK replicas can take a node preference."""
    if not spread or not plans or plans[0].strategy != "STRICT_PACK":
        return [None] * len(plans)
    return spread_targets(alive_nodes(), replica_demand(plans[0].bundles), len(plans))


def create_replica_group(plan: ReplicaPlan, *, target_node: str | None, timeout_s: float,
                         name: str) -> PlacementGroup:
    """Reserve one replica's bundles; a clear error (and nothing left) if not ready in time."""
    pg = placement_group(list(plan.bundles), strategy=plan.strategy, name=name, _soft_target_node_id=target_node)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_group(pg)
        need = replica_demand(plan.bundles)
        raise StartupError(
            f"replica {plan.index}: placement group of {plan.world_size} bundle(s) {plan.bundles[0]} with "
            f"strategy {plan.strategy} (total {need}) was not placed within {timeout_s:.0f}s; the cluster has "
            f"{ray.available_resources()} available. Run `ray status`, add resources, or lower the "
            "replica count / parallel sizes", replica=plan.index)
    return pg


def remove_group(pg: PlacementGroup | None) -> None:
    """Remove a placement group, ignoring one that is already gone."""
    if pg is None:
        return
    try:
        remove_placement_group(pg)
    except Exception as exc:  # already removed, or Ray shut down
        logger.debug("removing placement group %s: %s", pg.id.hex(), exc)


def bundle_nodes(pg: PlacementGroup, timeout_s: float = 5.0) -> list[str]:
    """Node id of each bundle, read from the GCS placement-group table."""
    deadline = time.monotonic() + timeout_s
    while True:
        table = ray.util.placement_group_table(pg)
        nodes = table.get("bundles_to_node_id", {})
        if len(nodes) == len(table.get("bundles", {})) or time.monotonic() > deadline:
            return [nodes.get(i, "") for i in range(len(table.get("bundles", {})))]
        time.sleep(0.05)
