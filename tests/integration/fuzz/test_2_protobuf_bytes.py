"""Bytes that are not a protobuf message, on every unary RPC of v1 and the Open Inference
Protocol: INVALID_ARGUMENT (issue 13, item 4)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given

from tests.integration.fuzz.common import (
    FUZZ,
    OIP,
    TIMEOUT,
    V1,
    _bytes_rule,
    _garbage,
    _tensor,
    expect,
)
from vqserve.serve._proto import grpc_predict_v2_pb2 as oip
from vqserve.serve._proto import tokenizer_pb2 as pb

pytestmark = TIMEOUT


# ---- invalid protobuf bytes on every RPC ------------------------------------------------------------


_SAMPLE = {
    "Encode": pb.EncodeRequest(images=_tensor(np.zeros((1, 8, 8, 3), np.uint8)), request_id="x"),
    "Decode": pb.DecodeRequest(indices=_tensor(np.zeros((1, 1, 1), np.uint16)), output_format=1),
    "GetModelInfo": pb.GetModelInfoRequest(),
    "ServerLive": oip.ServerLiveRequest(), "ServerReady": oip.ServerReadyRequest(),
    "ModelReady": oip.ModelReadyRequest(name="vqserve-encode", version="1"),
    "ServerMetadata": oip.ServerMetadataRequest(),
    "ModelMetadata": oip.ModelMetadataRequest(name="vqserve-decode"),
    "ModelInfer": oip.ModelInferRequest(model_name="vqserve-encode", id="x"),
}


@pytest.mark.parametrize("method", list(_SAMPLE))
def test_invalid_protobuf_bytes(served, method):
    """Every unary RPC answers bytes that do not parse with INVALID_ARGUMENT (issue 13,
    item 4), and bytes that happen to parse like any other request."""
    path = (V1 if method in ("Encode", "Decode", "GetModelInfo") else OIP) + method
    cls = type(_SAMPLE[method])

    @FUZZ
    @given(_garbage(_SAMPLE[method].SerializeToString()))
    @example(b"\xff\xff garbage")
    def run(data):
        code, details, _ = served.unary(path, data)
        expect(method, code, details, _bytes_rule(cls, data))

    run()
