"""One benchmark client's calls, one protocol each: vqserve's v1 (through its own async
client), OIP v2 ``ModelInfer`` and TorchServe's gRPC ``Predictions`` (``.npy`` bodies), all
as a coroutine that sends one item and returns the answer as numpy, so every load
generator times the three the same way.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np

from vqserve.export.torchserve.archives import ARCHIVE_NAMES
from vqserve.export.torchserve.server import INFERENCE_SERVICE, predictions_messages
from vqserve.serve.api import codec

PROTOCOLS = ("v1", "oip", "torchserve")
CALL_TIMEOUT_S = 300.0

Call = Callable[[np.ndarray], Awaitable[np.ndarray]]


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@contextlib.asynccontextmanager
async def connect(protocol: str, target: str, method: str) -> AsyncIterator[Call]:
    """One client's connection: a coroutine that sends one item (an image for encode,
    an index grid for decode) as one request and returns the answer as numpy."""
    import grpc

    if protocol == "v1":
        from vqserve.serve.clients import AsyncTokenizerClient

        async with AsyncTokenizerClient(target, timeout=CALL_TIMEOUT_S) as client:
            if method == "encode":
                yield lambda x: _first(client.encode_batch(x[None]))
            else:
                yield lambda x: _first(client.decode_batch(x[None]))
        return
    options = [("grpc.max_send_message_length", 64 << 20),
               ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        if protocol == "oip":
            yield _oip_call(channel, method)
        elif protocol == "torchserve":
            yield _torchserve_call(channel, method)
        else:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")


async def _first(result: Awaitable[np.ndarray]) -> np.ndarray:
    return (await result)[0]


def oip_request(method: str, x: np.ndarray):
    """A ModelInfer request of ``x`` (a whole batch) to ``vqserve-encode`` or ``-decode``."""
    from vqserve.serve._proto import grpc_predict_v2_pb2 as pb

    model, name = ("vqserve-encode", "images") if method == "encode" else ("vqserve-decode", "indices")
    x = np.ascontiguousarray(x)
    return pb.ModelInferRequest(model_name=model, inputs=[pb.ModelInferRequest.InferInputTensor(
        name=name, datatype=codec.NUMPY_TO_OIP[x.dtype.name], shape=list(x.shape))],
        raw_input_contents=[x.tobytes()])


def oip_array(reply) -> np.ndarray:
    """The first output of a ModelInfer response as an array."""
    out = reply.outputs[0]
    dtype = np.dtype(codec.OIP_TO_NUMPY[out.datatype]).newbyteorder("<")
    return np.frombuffer(reply.raw_output_contents[0], dtype).reshape(tuple(out.shape))


def _oip_call(channel, method: str) -> Call:
    from vqserve.serve._proto import grpc_predict_v2_pb2_grpc as pb_grpc

    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    async def call(x: np.ndarray) -> np.ndarray:
        reply = await stub.ModelInfer(oip_request(method, x[None]), timeout=CALL_TIMEOUT_S)
        return oip_array(reply)[0]

    return call


_TS_MESSAGES: tuple | None = None


def _torchserve_call(channel, method: str) -> Call:
    global _TS_MESSAGES
    if _TS_MESSAGES is None:
        _TS_MESSAGES = predictions_messages()
    request_cls, response_cls = _TS_MESSAGES
    predict = channel.unary_unary(f"/{INFERENCE_SERVICE}/Predictions",
                                  request_serializer=request_cls.SerializeToString,
                                  response_deserializer=response_cls.FromString)
    extra = {} if method == "encode" else {"output": b"npy"}

    async def call(x: np.ndarray) -> np.ndarray:
        request = request_cls(model_name=ARCHIVE_NAMES[method], input={"data": _npy(x), **extra})
        reply = await predict(request, timeout=CALL_TIMEOUT_S)
        if reply.prediction[:1] == b"{":  # TorchServe's gRPC answers errors with OK + JSON
            raise RuntimeError(f"TorchServe refused the request: {reply.prediction[:300]!r}")
        return np.load(io.BytesIO(reply.prediction), allow_pickle=False)

    return call
