"""A Ray job that deploys the HTTP app on a running cluster, calls it once, and (by default) removes it.

    ray start --head --num-cpus 4
    ray job submit --working-dir . -- python examples/serve_deploy.py --port 8000 --keep
    curl -s localhost:8000/readyz
    curl -s -X POST localhost:8000/v1/step -H 'Content-Type: application/json' \
         -d '{"tokens": [[3, 1, 4, 1]], "guidance_scale": 4.0}'

The app is the reference plugin with `--tp` ranks per replica group and `--replicas` groups. With
`--keep` the app outlives the job (Serve's controller owns it); `serve shutdown` removes it.
"""

from __future__ import annotations

import argparse
from typing import Sequence

import ray
import requests
from ray import serve

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, EngineArgs,
                       EngineConfig, ParallelConfig)
from phyai_ray.serve import create_app
from phyai_ray.serve.protocols import codec

APP_NAME = "phyai"


def engine_args(tp: int) -> EngineArgs:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
    return EngineArgs(plugin="reference_dit", plugin_args={"seed": 1},
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree per replica (default 2)")
    parser.add_argument("--replicas", type=int, default=1, help="replica groups (default 1)")
    parser.add_argument("--port", type=int, default=8000, help="Serve HTTP port, if this job starts Serve")
    parser.add_argument("--keep", action="store_true", help="leave the app running after the job ends")
    opts = parser.parse_args(argv)
    ray.init(address="auto")
    serve.start(http_options={"host": "127.0.0.1", "port": opts.port})
    deployment = DeploymentConfig.cluster(address="auto", replica_count=opts.replicas)
    serve.run(create_app(engine_args(opts.tp), deployment), name=APP_NAME, route_prefix="/")
    try:
        return call(f"http://127.0.0.1:{opts.port}")
    finally:
        if not opts.keep:  # also when the call failed: a failed job leaves no app behind
            serve.delete(APP_NAME)


def call(url: str) -> dict:
    """POST one request, read the replica states, print both."""
    reply = requests.post(f"{url}/v1/step", json={"tokens": [[3, 1, 4, 1]], "guidance_scale": 4.0}, timeout=120)
    reply.raise_for_status()
    logits = codec.decode(reply.json()["result"])
    replicas = requests.get(f"{url}/v1/replicas", timeout=10).json()
    print(f"serve_deploy: POST {url}/v1/step -> logits {list(logits.shape)}; replicas healthy: "
          f"{[r['healthy'] for r in replicas['replicas']]}")
    return {"shape": list(logits.shape), "replicas": replicas}


if __name__ == "__main__":
    main()
