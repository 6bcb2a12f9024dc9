"""vqserve.serve: the online server (gRPC v1 and Open Inference Protocol), its dynamic batcher,
execution-plan switching, metrics and the client."""
