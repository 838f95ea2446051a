"""Serve `tiny_row_tp` with TP=2 through `Engine(..., DeploymentConfig.external())` under torchrun.

    torchrun --standalone --nproc_per_node=2 -m tests.scripts.external_engine OUT_DIR

Every rank: (1) builds an engine whose config needs 4 ranks and records the error, (2) builds the
TP=2 engine, steps a bad request (the plugin's own error, on both ranks, before any collective),
then the same good requests in the same order, and a collective_rpc; writes rank<R>.json.
"""

from __future__ import annotations

import json
import os
import sys

from phyai_ray import DeploymentConfig, Engine, EngineArgs
from tests.scripts.launch import finish_rank

REQUESTS = [{"x": [[float(i + j) - 3 for j in range(8)] for i in range(3)]},
            {"x": [[1.0, -2.0, 3.0, 0.5, 0.0, 7.0, -1.0, 2.0]]}]


def args(tp: int) -> EngineArgs:
    return EngineArgs(plugin="tests.plugins.tiny:TinyRowTPEntry", plugin_args={"in_features": 8, "out_features": 4},
                      config={"device": {"target": "cpu"}, "parallel": {"dense": {"tp_size": tp}}})


def wrong_world() -> str | None:
    try:
        Engine(args(4), DeploymentConfig.external())
    except Exception as exc:  # recorded and checked by the test
        return f"{type(exc).__name__}: {exc}"
    return None


def serve() -> dict:
    out: dict = {}
    with Engine(args(2), DeploymentConfig.external()) as engine:
        out["mode"] = engine.mode
        try:
            engine.step({"x": "not numbers"})
        except Exception as exc:
            out["bad_request"] = type(exc).__name__
        out["healthy_after_bad"] = engine.healthy
        results = [engine.step(r, timeout=60) for r in REQUESTS]
        out["results"] = [None if r is None else r.tolist() for r in results]
        out["shard"] = engine.collective_rpc("shard", replica=0, all_ranks=True)
    return out


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    record = {"rank": rank, "world_size": int(os.environ["WORLD_SIZE"]), "wrong_world": wrong_world(), **serve()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
    finish_rank()
