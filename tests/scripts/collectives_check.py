"""Run every `P` collective on 2 gloo ranks and write each rank's outputs as JSON.

    torchrun --standalone --nproc_per_node=2 -m tests.scripts.collectives_check OUT_DIR

Each rank r starts from `rank_input(r)`; tests/test_collectives.py recomputes every expected
output in one process from the same inputs and compares. Topology: dense TP=2 (so `dense_tp`,
`world` and the inferred `attention_dp` all hold ranks [0, 1]).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from phyai_ray import DenseParallelConfig, P, ParallelConfig
from phyai_ray.rank.runner import destroy_distributed, init_distributed
from placement.topology import Topology
from tests.scripts.launch import finish_rank

# all_to_all with uneven splits: rank r sends SPLITS_IN[r][j] rows to rank j.
SPLITS_IN = ((1, 3), (2, 2))


def rank_input(rank: int, rows: int = 4, cols: int = 3) -> torch.Tensor:
    """Distinct small integers per rank, so sums are exact."""
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * (rank + 1) + 10 * rank


def splits_out(rank: int) -> list[int]:
    return [SPLITS_IN[src][rank] for src in range(len(SPLITS_IN))]


def run_ops(rank: int) -> dict:
    x = rank_input(rank)
    out = {"rank": rank, "size": P.size("dense_tp"), "tp_rank": P.rank("dense_tp")}
    out["all_reduce_sum"] = P.all_reduce(x.clone(), "dense_tp").tolist()
    out["all_reduce_max"] = P.all_reduce(x.clone(), "world", op="max").tolist()
    out["all_reduce_avg"] = P.all_reduce(x.clone(), "attention_dp", op="avg").tolist()
    out["all_gather_0"] = P.all_gather(x, "dense_tp").tolist()
    out["all_gather_1"] = P.all_gather(x, "dense_tp", dim=1).tolist()
    out["reduce_scatter"] = P.reduce_scatter(x.clone(), "dense_tp").tolist()
    out["broadcast"] = P.broadcast(x.clone(), "world", src=1).tolist()
    out["send_recv"] = _send_recv(rank, x)
    out["all_to_all"] = P.all_to_all(x, "dense_tp").tolist()
    out["all_to_all_uneven"] = P.all_to_all(x, "dense_tp", output_split_sizes=splits_out(rank),
                                            input_split_sizes=SPLITS_IN[rank]).tolist()
    out["barrier"] = _barrier(rank)
    out["agreed"] = [P.agreed(10 + 5 * rank), P.agreed(10 + 5 * rank, "max", "dense_tp")]
    return out


def _send_recv(rank: int, x: torch.Tensor) -> list | None:
    if rank == 0:
        P.send(x, dst=1, group="dense_tp")
        return None
    return P.recv(torch.zeros_like(x), src=0, group="dense_tp").tolist()


def _barrier(rank: int) -> dict:
    if rank == 1:
        time.sleep(0.5)
    enter = time.time()
    P.barrier("world")
    return {"enter": enter, "exit": time.time()}


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    topology = Topology.from_parallel(ParallelConfig(dense=DenseParallelConfig(tp_size=2)))
    groups = init_distributed(topology, rank, "cpu", "env://", timeout_s=60)
    groups.install()
    try:
        result = run_ops(rank)
    finally:
        destroy_distributed()
    with open(os.path.join(out_dir, f"collectives_rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
    finish_rank()
