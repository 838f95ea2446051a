"""The client half of benchmarks/bench_protocols.py; runs in the clients' venv (tests/client_venv.py).

    python protocol_clients.py GRPC_URL WS_URL KEY REQUESTS SERVE_WS_ECHO_URL

Times `tritonclient.grpc` ModelInfer and `openpi_client.WebsocketClientPolicy.infer` round trips
against the served echo plugin, and the same openpi payload against a bare `websockets` echo
server started here (pack, send, receive, unpack: what the openpi client does per step). Prints
one JSON line: name -> {size: [p50_ms, p99_ms, seconds]}.
"""

import json
import statistics
import sys
import threading
import time

import numpy as np
import tritonclient.grpc as tg
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.sync.client import connect
from websockets.sync.server import serve

SIZES = {"small": (1, 8), "large": (1, 3, 224, 224)}


def timed(call, count: int) -> list:
    for _ in range(5):
        call()
    times = []
    start = time.perf_counter()
    for _ in range(count):
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1e3)
    total = time.perf_counter() - start
    times.sort()
    return [statistics.median(times), times[int(0.99 * (len(times) - 1))], total]


def bare_ws_echo() -> tuple:
    def echo(ws) -> None:
        for message in ws:
            ws.send(message)

    server = serve(echo, "127.0.0.1", 0, compression=None, max_size=None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"ws://127.0.0.1:{server.socket.getsockname()[1]}"


def main() -> None:
    grpc_url, ws_url, key, count, serve_echo_url = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    out: dict = {"oip grpc": {}, "openpi ws": {}, "bare ws echo": {}, "bare serve ws": {}}
    client = tg.InferenceServerClient(grpc_url)
    policy = WebsocketClientPolicy(host=ws_url, api_key=key)
    server, bare_url = bare_ws_echo()
    bare = connect(bare_url, compression=None, max_size=None, legacy=True)
    through_serve = connect(serve_echo_url, compression=None, max_size=None, legacy=True)
    packer = msgpack_numpy.Packer()
    try:
        for size, shape in SIZES.items():
            x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            tensor = tg.InferInput("x", list(shape), "FP32")
            tensor.set_data_from_numpy(x)
            auth = {"authorization": f"Bearer {key}", "application": "bench"}  # two apps: name ours
            out["oip grpc"][size] = timed(lambda: client.infer("bench_echo", [tensor], headers=auth), count)

            def bare_step(ws=bare) -> None:
                ws.send(packer.pack({"x": x}))
                msgpack_numpy.unpackb(ws.recv())

            out["openpi ws"][size] = timed(lambda: policy.infer({"x": x}), count)
            out["bare ws echo"][size] = timed(bare_step, count)
            out["bare serve ws"][size] = timed(lambda: bare_step(through_serve), count)
    finally:
        bare.close()
        through_serve.close()
        server.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
