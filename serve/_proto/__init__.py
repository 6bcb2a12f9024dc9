"""Generated protobuf / gRPC stubs. Do not edit: run ``python scripts/gen_protos.py``.

- ``tokenizer_pb2`` / ``tokenizer_pb2_grpc``: vqserve.v1.Tokenizer (protos/vqserve/v1/tokenizer.proto)
- ``grpc_predict_v2_pb2`` / ``grpc_predict_v2_pb2_grpc``: the Open Inference Protocol v2
  (protos/inference/grpc_predict_v2.proto), in a private descriptor pool
"""
