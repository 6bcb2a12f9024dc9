"""Issue 13, items 3 and 4, against a real in-process server.

3. Everything that can be checked before the model runs is checked first: an unknown
   ``output_format``, and a response that could not fit the message limit (answered
   RESOURCE_EXHAUSTED, counted as an error; in a stream only that message fails).
4. Bytes that are not a valid protobuf message get INVALID_ARGUMENT and are counted; a
   stream answers the bad message in-band and goes on with the good ones.
"""

from __future__ import annotations

import re
import urllib.request

import grpc
import numpy as np
import pytest

from tests.helpers import CountingRuntime
from vqserve.export.runtimes.loader import EagerRuntime
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc
from vqserve.serve.api import codec
from vqserve.serve.clients import tensor_msg
from vqserve.serve.config import ServerConfig
from vqserve.serve.launcher import ServerThread

pytestmark = pytest.mark.timeout(120)

MAX_MB = 1
LIMIT = MAX_MB * 1024 * 1024
GARBAGE = b"\xff\xff garbage"


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    rt = CountingRuntime(EagerRuntime(tiny_checkpoint, device="cpu"))
    cfg = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1",
                       port=0, metrics_port=0, max_batch_size=64, max_delay_ms=5,
                       max_message_mb=MAX_MB, grace_s=2)
    with ServerThread(cfg, runtime=rt) as srv:
        channel = grpc.insecure_channel(srv.target, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        yield srv, rt, channel
        channel.close()


def scrape(srv) -> str:
    url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


def metric(text: str, name: str, **labels) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(sel) + r"\}" if sel else "") + r" (\S+)$"
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


def indices(b: int, h: int, w: int, fill: int = 7) -> pb.Tensor:
    return tensor_msg(np.full((b, h, w), fill, np.uint16))


def errors(srv, method: str, code: str) -> float:
    return metric(scrape(srv), "vqserve_errors_total", method=method, code=code)


# ---- item 3 -----------------------------------------------------------------------------
def test_unknown_output_format_is_rejected_before_the_model(served):
    srv, rt, channel = served
    stub = pb_grpc.TokenizerStub(channel)
    rt.calls.clear()
    before = errors(srv, "Decode", "INVALID_ARGUMENT")
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(indices=indices(1, 2, 2), output_format=7), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output_format" in err.value.details()
    assert rt.calls == []
    assert errors(srv, "Decode", "INVALID_ARGUMENT") == before + 1


def test_decode_reply_over_the_limit_is_refused_before_the_model(served):
    srv, rt, channel = served
    stub = pb_grpc.TokenizerStub(channel)
    rt.calls.clear()
    text = scrape(srv)
    before_err = metric(text, "vqserve_errors_total", method="Decode", code="RESOURCE_EXHAUSTED")
    before_ok = metric(text, "vqserve_requests_total", method="Decode", code="OK")
    with pytest.raises(grpc.RpcError) as err:  # 2 x 512x512x3 = 1.5 MiB of RAW pixels > 1 MiB
        stub.Decode(pb.DecodeRequest(indices=indices(2, 64, 64)), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert "--max-message-mb" in err.value.details() and str(LIMIT) in err.value.details()
    assert rt.calls == []
    text = scrape(srv)
    assert metric(text, "vqserve_errors_total", method="Decode", code="RESOURCE_EXHAUSTED") == before_err + 1
    assert metric(text, "vqserve_requests_total", method="Decode", code="OK") == before_ok
    ok = stub.Decode(pb.DecodeRequest(indices=indices(1, 64, 64)), timeout=30)  # 768 KiB fits
    assert list(ok.images.shape) == [1, 512, 512, 3]


def test_encode_reply_over_the_limit_is_refused_before_the_model(served):
    srv, rt, channel = served
    stub = pb_grpc.TokenizerStub(channel)
    png = codec.encode_png(np.zeros((1, 1024, 1024, 3), np.uint8))[0]  # a few KB
    rt.calls.clear()
    before = errors(srv, "Encode", "RESOURCE_EXHAUSTED")
    # 40 x 128x128 uint16 indices = 1.25 MiB > 1 MiB, from a request of ~40 small PNGs
    request = pb.EncodeRequest(encoded=pb.EncodedImages(images=[png] * 40))
    with pytest.raises(grpc.RpcError) as err:
        stub.Encode(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert "--max-message-mb" in err.value.details()
    assert rt.calls == []
    assert errors(srv, "Encode", "RESOURCE_EXHAUSTED") == before + 1


def test_oversize_reply_in_a_stream_fails_only_its_own_message(served):
    srv, rt, channel = served
    stub = pb_grpc.TokenizerStub(channel)
    rt.calls.clear()
    requests = [pb.DecodeRequest(indices=indices(1, 2, 2), request_id="a"),
                pb.DecodeRequest(indices=indices(2, 64, 64), request_id="big"),
                pb.DecodeRequest(indices=indices(1, 2, 2), request_id="c")]
    responses = list(stub.DecodeStream(iter(requests), timeout=30))
    assert [r.request_id for r in responses] == ["a", "big", "c"]
    assert responses[1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "--max-message-mb" in responses[1].error.message
    for r in (responses[0], responses[2]):
        assert not r.error.code and list(r.images.shape) == [1, 16, 16, 3]
    assert rt.calls and all(shape[1:3] == (2, 2) for _, shape in rt.calls), rt.calls  # not "big"


# ---- item 4 -----------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["Encode", "Decode", "GetModelInfo"])
def test_invalid_protobuf_bytes_are_invalid_argument_and_counted(served, method):
    srv, _, channel = served
    before = errors(srv, method, "INVALID_ARGUMENT")
    call = channel.unary_unary(f"/vqserve.v1.Tokenizer/{method}", request_serializer=None,
                               response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        call(GARBAGE, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "not a valid" in err.value.details()
    assert errors(srv, method, "INVALID_ARGUMENT") == before + 1


def test_stream_survives_one_invalid_protobuf_message(served):
    srv, _, channel = served
    before = errors(srv, "DecodeStream", "INVALID_ARGUMENT")
    good = [pb.DecodeRequest(indices=indices(1, 2, 2), request_id=i).SerializeToString()
            for i in ("a", "c")]
    call = channel.stream_stream("/vqserve.v1.Tokenizer/DecodeStream", request_serializer=None,
                                 response_deserializer=pb.DecodeResponse.FromString)
    responses = list(call(iter([good[0], GARBAGE, good[1]]), timeout=30))
    assert len(responses) == 3
    assert responses[0].request_id == "a" and not responses[0].error.code
    assert responses[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "not a valid" in responses[1].error.message
    assert responses[2].request_id == "c" and list(responses[2].images.shape) == [1, 16, 16, 3]
    assert errors(srv, "DecodeStream", "INVALID_ARGUMENT") == before + 1


def test_png_answer_is_not_refused_by_the_raw_size_estimate(served):
    """A PNG answer's size is known only once encoded; a compressible one over the raw
    estimate still goes through (and an over-limit one is refused by the final check)."""
    srv, _, channel = served
    stub = pb_grpc.TokenizerStub(channel)
    ok = stub.Decode(pb.DecodeRequest(indices=indices(2, 64, 64), output_format=pb.IMAGE_FORMAT_PNG),
                     timeout=60)
    assert len(ok.encoded.images) == 2 and ok.ByteSize() < LIMIT


def test_oip_invalid_protobuf_bytes_are_invalid_argument_and_counted(served):
    """Issue 13 item 4 on the Open Inference Protocol: was UNKNOWN with the parser's text."""
    srv, _, channel = served
    before = errors(srv, "ModelInfer", "INVALID_ARGUMENT")
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                               response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        call(GARBAGE, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "not a valid inference.ModelInferRequest" in err.value.details()
    assert errors(srv, "ModelInfer", "INVALID_ARGUMENT") == before + 1
