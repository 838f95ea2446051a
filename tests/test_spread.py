"""Pure tests of replica node preference and device-id composition (placement/spread.py)."""

import pytest

from placement.spread import fits, physical_device, replica_demand, spread_targets


def test_replica_demand_sums_bundles():
    assert replica_demand([{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}]) == {"CPU": 2.0, "GPU": 2.0}


@pytest.mark.parametrize("nodes, demand, count, expected", [
    ([("a", {"CPU": 4}), ("b", {"CPU": 8})], {"CPU": 2}, 3, ["b", "a", "b"]),
    ([("a", {"CPU": 4, "GPU": 2}), ("b", {"CPU": 8})], {"GPU": 2}, 2, ["a", "a"]),
    ([("a", {"CPU": 1})], {"CPU": 2}, 2, [None, None]),
    ([("b", {"CPU": 4}), ("a", {"CPU": 4})], {"CPU": 4}, 2, ["a", "b"]),
])
def test_spread_targets_round_robin_over_nodes_that_fit(nodes, demand, count, expected):
    assert spread_targets(nodes, demand, count) == expected


def test_fits():
    assert fits({"CPU": 2, "GPU": 1}, {"CPU": 2}) and not fits({"CPU": 2}, {"GPU": 1})


@pytest.mark.parametrize("logical, visible, expected", [(0, None, "0"), (3, "", "3"), (1, "4,5,6", "5"),
                                                        (0, " 7 ,8", "7")])
def test_physical_device_composes_with_cuda_visible_devices(logical, visible, expected):
    assert physical_device(logical, visible) == expected


def test_physical_device_out_of_range_names_the_visible_set():
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES='4,5'.*0\.\.1"):
        physical_device(2, "4,5")


def _plans(world, replicas, cpus, strategy="STRICT_PACK"):
    from placement.bundles import plan_replicas
    return plan_replicas(ranks_per_replica=world, replica_count=replicas, use_gpu=False, cpus_per_rank=cpus,
                         strategy=strategy)


def test_check_feasible_accepts_what_fits_and_names_what_does_not():
    from placement.spread import check_feasible

    nodes = [("a", {"CPU": 4.0}), ("b", {"CPU": 4.0})]
    check_feasible(_plans(2, 4, 1), nodes)
    check_feasible(_plans(4, 1, 2, strategy="SPREAD"), nodes)
    with pytest.raises(ValueError, match=r"STRICT_PACK needs \{'CPU': 8.0\} on one node"):
        check_feasible(_plans(4, 1, 2), nodes)
    with pytest.raises(ValueError, match=r"3 replica\(s\) need \{'CPU': 12.0\} in total but the cluster has "
                                         r"\{'CPU': 8.0\}"):
        check_feasible(_plans(2, 3, 2), nodes)
    with pytest.raises(ValueError, match="no node can hold one rank bundle"):
        check_feasible(_plans(1, 1, 5, strategy="PACK"), nodes)
