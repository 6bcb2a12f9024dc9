"""Open Inference Protocol v2 (``inference.GRPCInferenceService``) over the same Engine.

Two models: ``vqserve-encode`` (input ``images`` UINT8 [B,H,W,3] -> output ``indices``)
and ``vqserve-decode`` (input ``indices``, any integer type -> output ``images`` UINT8).
Tensors are read from ``raw_input_contents`` (what tritonclient sends) or from typed
``contents``; outputs go back as ``raw_output_contents``.

Decode replies as PNG files: the request parameter ``output_format`` = ``"png"`` (a
``string_param``; ``"raw"`` is the default) answers ``images`` as a BYTES tensor of shape
``[B]``, one PNG per image, serialised as the protocol's BYTES convention (each element a
4-byte little-endian length, then its bytes: what tritonclient's ``as_numpy`` reads). The
PNGs are made where the request is answered - a front-end process on a GPU node, never the
device executor - off the event loop.
"""

from __future__ import annotations

import struct

import numpy as np

from vqserve import __version__
from vqserve.serve._proto import grpc_predict_v2_pb2 as pb
from vqserve.serve._proto import grpc_predict_v2_pb2_grpc as pb_grpc
from vqserve.serve.api import codec
from vqserve.serve.api.errors import abort_for, deadline_of, reject_unparsed, safe_deserializer
from vqserve.serve.error_codes import BadInput, NotFound, NotReady

ENCODE_MODEL = "vqserve-encode"
DECODE_MODEL = "vqserve-decode"
MODELS = (ENCODE_MODEL, DECODE_MODEL)
VERSIONS = ("", "1")

# typed-contents field that carries each datatype
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
    "UINT32": "uint_contents", "UINT64": "uint64_contents", "INT8": "int_contents",
    "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
}


def _check_model(name: str, version: str) -> None:
    if name not in MODELS:
        raise NotFound(f"model_name: unknown model {name!r}; this server has {list(MODELS)}")
    if version not in VERSIONS:
        raise NotFound(f"model_version: {name} has only version 1, got {version!r}")


def input_array(request: pb.ModelInferRequest, index: int) -> np.ndarray:
    """The ``index``-th input as a numpy array (raw bytes or typed contents)."""
    tensor = request.inputs[index]
    field = f"inputs[{index}]({tensor.name})"
    name = codec.OIP_TO_NUMPY.get(tensor.datatype)
    if name is None:
        raise BadInput(f"{field}.datatype",
                       f"must be one of {sorted(codec.OIP_TO_NUMPY)}, got {tensor.datatype!r}")
    dtype = np.dtype(name).newbyteorder("<")
    if request.raw_input_contents:
        _refuse_mixed(request)
        if len(request.raw_input_contents) != len(request.inputs):
            raise BadInput("raw_input_contents", f"must have one entry per input ({len(request.inputs)}), "
                                                 f"got {len(request.raw_input_contents)}")
        return codec.array_from_bytes(tensor.shape, dtype, request.raw_input_contents[index], field)
    return _typed_array(tensor, dtype, field)


def _refuse_mixed(request: pb.ModelInferRequest) -> None:
    """The protocol forbids typed ``contents`` next to ``raw_input_contents``; accepting both
    would silently ignore the typed values (an out-of-range index there went unchecked)."""
    for i, tensor in enumerate(request.inputs):
        if tensor.HasField("contents") and tensor.contents.ListFields():
            raise BadInput(f"inputs[{i}]({tensor.name}).contents",
                           "a request uses either raw_input_contents or typed contents, not both "
                           "(Open Inference Protocol); drop one")


def _typed_array(tensor, dtype: np.dtype, field: str) -> np.ndarray:
    """Typed ``contents`` as ``dtype``; integers go through a 64-bit type of the same
    signedness, so UINT64 values >= 2**63 reach the range check as sent, not as an overflow."""
    shape = codec.check_shape(tensor.shape, field)
    values = getattr(tensor.contents, _CONTENTS_FIELD.get(tensor.datatype, ""), None) \
        if tensor.datatype in _CONTENTS_FIELD else None
    if values is None:
        raise BadInput(f"{field}.contents", f"typed contents are not supported for {tensor.datatype}; "
                                            "send raw_input_contents")
    count = int(np.prod(shape))
    if len(values) != count:
        raise BadInput(f"{field}.contents", f"must hold prod(shape) = {count} values for shape "
                                            f"{list(shape)}, got {len(values)}")
    wide = {"i": np.int64, "u": np.uint64}.get(dtype.kind, dtype)
    raw = np.asarray(values, dtype=wide)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if raw.size and (int(raw.min()) < info.min or int(raw.max()) > info.max):
            raise BadInput(f"{field}.contents", f"values must fit {tensor.datatype}")
    return raw.astype(dtype).reshape(shape)


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state):
        self.state = state

    @property
    def engine(self):
        if self.state.engine is None:
            raise NotReady("the model is still loading; retry shortly")
        return self.state.engine

    async def _answer(self, method: str, request, context, answer):
        """Every RPC: count it, refuse bytes that were not its message (INVALID_ARGUMENT),
        turn any failure into its status code."""
        try:
            with self.state.tracker.track(method, context):
                reject_unparsed(request)
                return await answer(request, context)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort_for(context, exc)

    async def ServerLive(self, request, context):
        async def live(request, context):
            return pb.ServerLiveResponse(live=True)
        return await self._answer("ServerLive", request, context, live)

    async def ServerReady(self, request, context):
        async def ready(request, context):
            return pb.ServerReadyResponse(ready=self.state.ready)
        return await self._answer("ServerReady", request, context, ready)

    async def ModelReady(self, request, context):
        async def ready(request, context):
            _check_model(request.name, request.version)
            return pb.ModelReadyResponse(ready=self.state.ready)
        return await self._answer("ModelReady", request, context, ready)

    async def ServerMetadata(self, request, context):
        async def metadata(request, context):
            return pb.ServerMetadataResponse(name="vqserve", version=__version__, extensions=[])
        return await self._answer("ServerMetadata", request, context, metadata)

    async def ModelMetadata(self, request, context):
        return await self._answer("ModelMetadata", request, context, self._model_metadata)

    async def _model_metadata(self, request, context) -> pb.ModelMetadataResponse:
        _check_model(request.name, request.version)
        info = self.engine.info
        index_type = codec.NUMPY_TO_OIP[np.dtype(info.index_dtype).name]
        q = info.codes_per_position
        index_shape = [-1, -1, -1] + ([q] if q > 1 else [])
        pixels = [-1, -1, -1, 3]
        if info.layout.kind == "video":  # clips [B,T,H,W,3] -> [B,t,h,w], the layout in every answer
            index_shape, pixels = [-1, -1, -1, -1], [-1, -1, -1, -1, 3]
        elif not info.layout.is_grid:  # a pyramid: [B, L], its scales in every answer's parameters
            index_shape = [-1, -1]
        image = pb.ModelMetadataResponse.TensorMetadata(name="images", datatype="UINT8", shape=pixels)
        index = pb.ModelMetadataResponse.TensorMetadata(name="indices", datatype=index_type, shape=index_shape)
        inputs, outputs = ([image], [index]) if request.name == ENCODE_MODEL else ([index], [image])
        return pb.ModelMetadataResponse(name=request.name, versions=["1"], platform=f"vqserve_{info.backend}",
                                        inputs=inputs, outputs=outputs)

    async def ModelInfer(self, request, context):
        return await self._answer("ModelInfer", request, context, self._infer)

    async def _infer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        _check_model(request.model_name, request.model_version)
        engine = self.engine
        in_name, out_name = ("images", "indices") if request.model_name == ENCODE_MODEL else ("indices", "images")
        if len(request.inputs) != 1 or request.inputs[0].name != in_name:
            got = [t.name for t in request.inputs]
            raise BadInput("inputs", f"{request.model_name} takes exactly one input named {in_name!r}, got {got}")
        for i, wanted in enumerate(request.outputs):
            if wanted.name != out_name:
                raise BadInput(f"outputs[{i}].name", f"{request.model_name} has one output {out_name!r}, "
                                                     f"got {wanted.name!r}")
        png = output_format(request) == "png"
        array = input_array(request, 0)
        field = f"inputs[0]({in_name})"
        if request.model_name == ENCODE_MODEL:
            out = await engine.encode(array, deadline_of(context), field)
        else:
            out = await engine.decode(array, deadline_of(context), field, reply_overhead=None if png else 0)
        response = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        for key in ("model_hash", "source_hash", "dtype", "backend"):  # which tokens these are
            response.parameters[key].string_param = engine.identity[key]
        response.parameters["exact"].bool_param = engine.identity["exact"]
        if engine.token_layout_json:  # a pyramid's scales, so a consumer can split it
            response.parameters["token_layout"].string_param = engine.token_layout_json
        if png:
            pngs = await codec.png_reply(out)
            response.outputs.add(name=out_name, datatype="BYTES", shape=[len(pngs)])
            response.raw_output_contents.append(bytes_tensor(pngs))
            response.parameters["output_format"].string_param = "png"
            engine.check_reply(response.ByteSize(), lambda: "a ModelInferResponse of PNGs")
            return response
        shape, dtype, data = codec.array_to_bytes(out)
        response.outputs.add(name=out_name, datatype=codec.NUMPY_TO_OIP[dtype], shape=shape)
        response.raw_output_contents.append(data)
        return response


OUTPUT_FORMATS = ("raw", "png")


def output_format(request: pb.ModelInferRequest) -> str:
    """The request's ``output_format`` parameter: ``raw`` (default) or ``png``, the latter
    for ``vqserve-decode`` only; anything else is one line, before the model runs."""
    if "output_format" not in request.parameters:
        return "raw"
    param = request.parameters["output_format"]
    kind = param.WhichOneof("parameter_choice")
    value = param.string_param.lower() if kind == "string_param" else None
    if value not in OUTPUT_FORMATS:
        got = f"{kind} {getattr(param, kind)!r}" if kind else "no value"
        raise BadInput("parameters[output_format]", f"must be the string_param \"raw\" or \"png\", got {got}")
    if value == "png" and request.model_name != DECODE_MODEL:
        raise BadInput("parameters[output_format]", f"\"png\" is for {DECODE_MODEL} (images out), "
                                                    f"not {request.model_name}")
    return value


def bytes_tensor(items: list[bytes]) -> bytes:
    """A BYTES tensor's raw contents: each element as a 4-byte little-endian length, then its
    bytes (the Open Inference Protocol's convention, tritonclient's ``serialize_byte_tensor``)."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def add_to_server(service: InferenceService, server) -> None:
    """Register every method of the service as the generated helper does, but with request
    parsers that never raise: bytes that are not the method's message get INVALID_ARGUMENT
    (counted) instead of UNKNOWN with the parser's text."""
    import grpc

    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(service, method.name), request_deserializer=safe_deserializer(request_cls),
            response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
