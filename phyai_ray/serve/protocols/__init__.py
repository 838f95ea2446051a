"""What the application speaks: each protocol's routes over one `GroupRunner` (`phyai_ray.serve.runtime`).

    http.py          create_api: the FastAPI app of a group; POST /v1/step and the probes
    codec.py         the JSON encoding of tensors (`{"__tensor__": {dtype, shape, data}}`)
    schema.py        pydantic models of the bodies (EncodedTensor, StepResponse, ErrorBody)
    step_stream.py   POST /v1/step/stream: NDJSON chunks of one request
    error_map.py     classify: one failure table every protocol renders in its own shape
    guard.py         EdgeGuard: the key, body size and content type, before any route
    timing.py        a request's deadline in, its timing and freshness out
    openai/          /v1/completions, /v1/chat/completions, /v1/models for token plugins
    oip/             the Open Inference Protocol v2 over HTTP and gRPC
    openpi.py        openpi's robot-policy WebSocket

A protocol reads a plugin only through its `Entry` and the contracts in `phyai_ray.plugins`
(the OpenAI routes: `phyai_ray.plugins.tokens`); it imports no plugin.
"""
