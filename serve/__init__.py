"""vqserve.serve: gRPC service, dynamic batcher, metrics, client and offline batch tokenization."""
