"""The Open Inference Protocol v2 (KServe / Triton): routes.py over HTTP, servicer.py over gRPC, both over
model.py (the protocol's model: names, signatures, parameters) and tensors.py (its tensor encodings).

The gRPC messages are generated into `phyai_ray/serve/grpc_v2/` (kept there: Serve config files name
its `add_GRPCInferenceServiceServicer_to_server` by that path).
"""
