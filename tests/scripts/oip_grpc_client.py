"""Runs in the clients' venv (tests/client_venv.py): `tritonclient.grpc` against a running server.

    python oip_grpc_client.py HOST:PORT KEY MODEL TOKENS_JSON

Prints one JSON line: probes, metadata, the logits of binary/typed requests, and each error's
gRPC status code, for the test to judge.
"""

import json
import sys

import numpy as np
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException


def infer(client, model, tokens, headers, **kwargs):
    x = tg.InferInput("tokens", list(tokens.shape), "INT64")
    x.set_data_from_numpy(tokens)
    result = client.infer(model, [x], parameters={"guidance_scale": 4.0}, headers=headers, **kwargs)
    return result.as_numpy("logits"), result.get_response().id


def status_of(call):
    try:
        call()
    except InferenceServerException as exc:
        return exc.status()
    return "OK"


def main() -> None:
    url, key, model, tokens = sys.argv[1], sys.argv[2], sys.argv[3], np.array(json.loads(sys.argv[4]), dtype=np.int64)
    client = tg.InferenceServerClient(url)
    auth = {"authorization": f"Bearer {key}"}
    meta = client.get_model_metadata(model, headers=auth, as_json=True)
    logits, rid = infer(client, model, tokens, auth, request_id="grpc-1")
    bad_dtype = tg.InferInput("tokens", list(tokens.shape), "FP32")
    bad_dtype.set_data_from_numpy(tokens.astype(np.float32))
    out = {
        "live": client.is_server_live(), "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(model, headers=auth),
        "server": client.get_server_metadata(headers=auth, as_json=True), "metadata": meta,
        "logits": logits.tolist(), "dtype": str(logits.dtype), "id": rid,
        "wrong_key": status_of(lambda: infer(client, model, tokens, {"authorization": "Bearer nope"})),
        "unknown_model": status_of(lambda: infer(client, "nope", tokens, auth)),
        "bad_datatype": status_of(lambda: client.infer(model, [bad_dtype], headers=auth)),
    }
    out["after_errors"] = infer(client, model, tokens, auth)[0].tolist() == out["logits"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
