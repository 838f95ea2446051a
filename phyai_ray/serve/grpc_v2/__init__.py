"""Generated Open Inference Protocol v2 gRPC modules (make grpc-stubs); see grpc_predict_v2.proto."""
