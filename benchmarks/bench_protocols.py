"""Round trips of the protocols existing clients speak, against phyai-ray's own JSON and bare echoes.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_protocols.py [--requests 40]`

One group (TP=1, its rank inline in the Serve replica) of an echo plugin answers every variant
with its input; two sizes, `small` (1 x 8 float32) and `large` (1 x 3 x 224 x 224 float32, 588 KiB):

    phyai json      POST /v1/step, the tensor in phyai-ray's base64 JSON encoding (requests)
    oip http json   tritonclient.http, JSON tensors
    oip http binary tritonclient.http, the binary tensor extension
    oip grpc        tritonclient.grpc through Serve's gRPC proxy        (clients' venv)
    openpi ws       openpi_client.WebsocketClientPolicy.infer            (clients' venv)
    bare serve echo a bare Serve FastAPI deployment returning the raw body (the HTTP floor)
    bare ws echo    a bare `websockets` echo server, same msgpack payload (the WebSocket floor)
    bare serve ws   a bare Serve FastAPI WebSocket echo, same payload (the floor through Serve's proxy)

Sequential requests from one client: p50/p99 and throughput (requests / elapsed seconds), then
the ratios the targets name: binary OIP speed vs phyai json for the large tensor (>= 3x), openpi
p50 vs the bare websockets echo (<= 1.3x).
"""

import argparse
import base64
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import ray
import requests
import tritonclient.http as th
from fastapi import FastAPI, Request, Response, WebSocket, WebSocketDisconnect
from ray import serve

from phyai_ray import DeploymentConfig, DeviceConfig, EngineArgs, EngineConfig, Entry

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"small": (1, 8), "large": (1, 3, 224, 224)}
KEY = "bench-key"


class Echo:
    def __init__(self, plugin_args: dict, ctx: Any) -> None:
        pass

    def step(self, request: Any) -> Any:
        return request["x"]


class EchoEntry(Entry):
    name = "bench_echo"

    def create(self, plugin_args: dict, ctx: Any) -> Echo:
        return Echo(plugin_args, ctx)


bare_api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(bare_api)
class BareEcho:
    @bare_api.post("/echo")
    async def echo(self, request: Request) -> Response:
        return Response(await request.body(), media_type="application/octet-stream")

    @bare_api.websocket("/ws")
    async def ws_echo(self, websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            while True:
                await websocket.send_bytes(await websocket.receive_bytes())
        except WebSocketDisconnect:
            pass


def timed(call: Callable[[], Any], count: int) -> list[float]:
    for _ in range(5):
        call()
    times, start = [], time.perf_counter()
    for _ in range(count):
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1e3)
    total = time.perf_counter() - start
    times.sort()
    return [statistics.median(times), times[int(0.99 * (len(times) - 1))], total]


def http_variants(port: int, x: np.ndarray, count: int) -> dict[str, list[float]]:
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}
    session = requests.Session()
    body = {"x": {"__tensor__": {"dtype": "float32", "shape": list(x.shape),
                                 "data": base64.b64encode(x.tobytes()).decode()}}}

    def phyai_json() -> None:
        reply = session.post(f"{base}/v1/step", json=body, headers=auth, timeout=60)
        reply.raise_for_status()
        np.frombuffer(base64.b64decode(reply.json()["result"]["__tensor__"]["data"]), dtype=np.float32)

    client = th.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)

    def oip(binary: bool) -> Callable[[], None]:
        tensor = th.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        wanted = [th.InferRequestedOutput("output", binary_data=binary)]
        return lambda: client.infer("bench_echo", [tensor], outputs=wanted, headers=dict(auth)).as_numpy("output")

    raw = x.tobytes()
    return {"phyai json": timed(phyai_json, count), "oip http json": timed(oip(False), count),
            "oip http binary": timed(oip(True), count),
            "bare serve echo": timed(lambda: session.post(f"{base}/bare/echo", data=raw, timeout=60).content, count)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    opts = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from phyai_ray.serve import create_app
    from phyai_ray.serve.runtime.server import grpc_options
    from tests.client_venv import client_python
    from tests.helpers import free_port

    python = client_python()
    port, grpc_port = free_port(), free_port()
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc_options(grpc_port))
    results: dict[str, dict[str, list[float]]] = {}
    try:
        args = EngineArgs(plugin=EchoEntry, config=EngineConfig(device=DeviceConfig(target="cpu")))
        serve.run(create_app(args, DeploymentConfig(replica_count=1), api_key=KEY,
                             max_body_bytes=64 << 20), name="bench", route_prefix="/")
        serve.run(BareEcho.bind(), name="bare", route_prefix="/bare")
        for size, shape in SIZES.items():
            x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            for name, row in http_variants(port, x, opts.requests).items():
                results.setdefault(name, {})[size] = row
        done = subprocess.run([python, str(ROOT / "benchmarks/protocol_clients.py"), f"127.0.0.1:{grpc_port}",
                               f"ws://127.0.0.1:{port}/v1/openpi", KEY, str(opts.requests),
                               f"ws://127.0.0.1:{port}/bare/ws"],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"protocol_clients.py failed:\n{done.stderr[-6000:]}")
        results.update(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        serve.shutdown()
        ray.shutdown()
    report(results, opts.requests)


def report(results: dict[str, dict[str, list[float]]], count: int) -> None:
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, ray {ray.__version__}; "
          f"{count} sequential requests per row")
    for name, sizes in results.items():
        cells = "  ".join(f"{size}: p50 {p50:7.2f} ms p99 {p99:7.2f} ms {count / total:6.1f} req/s"
                          for size, (p50, p99, total) in sizes.items())
        print(f"{name:16s} {cells}")
    large = {name: sizes["large"][0] for name, sizes in results.items()}
    speed = {name: large["phyai json"] / p50 for name, p50 in large.items()}
    print(f"\nlarge tensor, speed vs phyai json (p50): oip http binary {speed['oip http binary']:.2f}x, "
          f"oip grpc {speed['oip grpc']:.2f}x, oip http json {speed['oip http json']:.2f}x   (target: binary >= 3x)")
    for size in SIZES:
        ratio = results["openpi ws"][size][0] / results["bare ws echo"][size][0]
        serve_ratio = results["openpi ws"][size][0] / results["bare serve ws"][size][0]
        print(f"openpi ws p50 / bare ws echo p50, {size}: {ratio:.2f}x   (target: <= 1.3x); "
              f"/ bare serve ws echo p50: {serve_ratio:.2f}x")
    for size in SIZES:
        bare = results["bare serve echo"][size][0]
        shown = ", ".join(f"{n} {results[n][size][0] / bare:.2f}x" for n in
                          ("phyai json", "oip http json", "oip http binary", "oip grpc"))
        print(f"p50 vs bare serve echo, {size}: {shown}")


if __name__ == "__main__":
    main()
