"""vqserve.v1.Tokenizer: the native gRPC API, a thin adapter over :class:`Engine`."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import numpy as np

from vqserve import __version__
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc
from vqserve.serve.api import codec
from vqserve.serve.api.errors import abort_for, deadline_of, reject_unparsed, safe_deserializer
from vqserve.serve.api.rawrequest import parse_encode_request
from vqserve.serve.error_codes import NotReady, status_for

STREAM_WINDOW = 32  # requests a stream may have in flight before the server stops reading


def tensor_msg(array: np.ndarray) -> pb.Tensor:
    shape, dtype, data = codec.array_to_bytes(array)
    return pb.Tensor(shape=shape, dtype=dtype, data=data)


def tensor_array(msg: pb.Tensor, field: str) -> np.ndarray:
    return codec.array_from_bytes(msg.shape, msg.dtype, msg.data, field)


class TokenizerService(pb_grpc.TokenizerServicer):
    """``state`` is the server's :class:`ServerState` (engine is None while loading)."""

    def __init__(self, state):
        self.state = state

    @property
    def engine(self):
        engine = self.state.engine
        if engine is None:
            raise NotReady("the model is still loading; retry shortly")
        return engine

    # ---- request -> array -> response ---------------------------------------------------
    async def _encode(self, request: pb.EncodeRequest, context) -> pb.EncodeResponse:
        reject_unparsed(request)
        engine = self.engine
        kind = request.WhichOneof("pixels")
        overhead = len(request.request_id)
        if kind == "images":
            indices = await engine.encode(tensor_array(request.images, "images"), deadline_of(context),
                                          "images", reply_overhead=overhead)
        elif kind == "encoded":
            indices = await engine.encode_encoded(request.encoded.images, deadline_of(context),
                                                  "encoded.images", reply_overhead=overhead)
        else:
            raise codec.BadInput("pixels", "set either `images` (raw uint8 NHWC) or `encoded` (PNG/JPEG)")
        return pb.EncodeResponse(indices=tensor_msg(indices), request_id=request.request_id)

    async def _decode(self, request: pb.DecodeRequest, context) -> pb.DecodeResponse:
        """Every rule that can be checked from the request alone (fields, output format,
        the size of a raw answer) is checked before the model runs."""
        reject_unparsed(request)
        engine = self.engine
        if not request.HasField("indices"):
            raise codec.BadInput("indices", "is required")
        indices = tensor_array(request.indices, "indices")
        fmt = request.output_format
        if fmt not in (pb.IMAGE_FORMAT_RAW, pb.IMAGE_FORMAT_PNG):
            raise codec.BadInput("output_format", f"unknown value {fmt}; use IMAGE_FORMAT_RAW (0) "
                                                  "or IMAGE_FORMAT_PNG (1)")
        raw = fmt == pb.IMAGE_FORMAT_RAW
        images = await engine.decode(indices, deadline_of(context),
                                     reply_overhead=len(request.request_id) if raw else None)
        if raw:
            return pb.DecodeResponse(images=tensor_msg(images), request_id=request.request_id)
        pngs = await codec.png_reply(images)
        return pb.DecodeResponse(encoded=pb.EncodedImages(images=pngs), request_id=request.request_id)

    async def _answer(self, fn, request, context):
        """Run ``fn`` and refuse an answer gRPC could not send (a PNG answer's size is known
        only now): gRPC would fail the call after the fact and, in a stream, end the stream."""
        response = await fn(request, context)
        self.engine.check_reply(response.ByteSize(), lambda: f"a {type(response).__name__}")
        return response

    # ---- unary ------------------------------------------------------------------------
    async def Encode(self, request, context):
        return await self._unary("Encode", self._encode, request, context)

    async def Decode(self, request, context):
        return await self._unary("Decode", self._decode, request, context)

    async def _unary(self, method, fn, request, context):
        try:
            with self.state.tracker.track(method, context):
                return await self._answer(fn, request, context)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort_for(context, exc)

    # ---- streams ------------------------------------------------------------------------
    async def EncodeStream(self, request_iterator, context):
        async for response in self._stream("EncodeStream", self._encode, pb.EncodeResponse,
                                           request_iterator, context):
            yield response

    async def DecodeStream(self, request_iterator, context):
        async for response in self._stream("DecodeStream", self._decode, pb.DecodeResponse,
                                           request_iterator, context):
            yield response

    async def _stream(self, method, fn, response_cls, request_iterator, context):
        """Read ahead up to STREAM_WINDOW requests (so they can share batches); answer in
        order; a bad request gets a response with ``error`` set and the stream goes on."""
        pending: asyncio.Queue = asyncio.Queue(STREAM_WINDOW)

        async def one(request):
            try:
                with self.state.tracker.track(method, context):
                    return await self._answer(fn, request, context)
            except Exception as exc:  # noqa: BLE001 - reported in-band, per message
                code, message = status_for(exc)
                return response_cls(request_id=request.request_id,
                                    error=pb.Error(code=code.value[0], message=message))

        async def reader():
            try:
                async for request in request_iterator:
                    await pending.put(asyncio.ensure_future(one(request)))
            finally:
                await pending.put(None)

        read_task = asyncio.ensure_future(reader())
        try:
            while True:
                task = await pending.get()
                if task is None:
                    break
                yield await task
            await read_task  # surfaces a broken request stream
        finally:
            read_task.cancel()
            while not pending.empty():
                task = pending.get_nowait()
                if task is not None:
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await read_task

    # ---- info ---------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        try:
            with self.state.tracker.track("GetModelInfo", context):
                reject_unparsed(request)
                engine = self.engine
                info = engine.info
                return pb.ModelInfo(
                    quantizer=info.quantizer, codebook_size=info.codebook_size,
                    levels=list(info.levels), dither=info.dither, factor=info.factor,
                    codes_per_position=info.codes_per_position, index_dtype=info.index_dtype,
                    accepted_sizes=engine.size_rule, max_pixels=info.max_pixels,
                    max_batch_size=engine.max_batch_size, dtype=info.dtype, backend=info.backend,
                    device=info.device, model_hash=info.model_hash, server_version=__version__,
                    exact=bool(info.exact), source_hash=info.source_hash or info.model_hash,
                    encode_only=not info.decodes,
                    execution_plan=info.extra.get("plan_line", ""),
                    determinism=_determinism_msg(getattr(engine, "determinism", None)),
                    token_layout=_layout_msg(info.token_layout),
                )
        except Exception as exc:  # noqa: BLE001
            await abort_for(context, exc)


def _layout_msg(layout: dict) -> pb.TokenLayout | None:
    """A non-grid token layout as its message (None, so unset, for a grid)."""
    if not layout:
        return None
    return pb.TokenLayout(kind=layout["kind"], length=layout.get("length", 0), size=layout.get("size", []), schedules=[
        pb.ScaleSchedule(heights=[h for h, _ in s], widths=[w for _, w in s]) for s in layout.get("schedules", [])],
        temporal_factor=layout.get("temporal_factor", 0), chunk_frames=layout.get("chunk_frames", 0),
        pad=layout.get("pad", ""), frame_rule=layout.get("frame_rule", ""))


def _determinism_msg(certificate) -> pb.Determinism:
    if certificate is None:
        return pb.Determinism(summary="not checked (the server started with --no-self-check)")
    return pb.Determinism(batch_invariant=certificate.batch_invariant,
                          decode_batch_invariant=certificate.decode_batch_invariant,
                          summary=certificate.summary())


# name -> (handler factory, request type, response type), as in the generated stub module
_METHODS = {
    "Encode": (grpc.unary_unary_rpc_method_handler, pb.EncodeRequest, pb.EncodeResponse),
    "Decode": (grpc.unary_unary_rpc_method_handler, pb.DecodeRequest, pb.DecodeResponse),
    "EncodeStream": (grpc.stream_stream_rpc_method_handler, pb.EncodeRequest, pb.EncodeResponse),
    "DecodeStream": (grpc.stream_stream_rpc_method_handler, pb.DecodeRequest, pb.DecodeResponse),
    "GetModelInfo": (grpc.unary_unary_rpc_method_handler, pb.GetModelInfoRequest, pb.ModelInfo),
}


def request_parser(request_cls):
    """The request deserializer: never raises (``safe_deserializer``), and an Encode request
    of raw pixels is read in place (``serve/api/rawrequest.py``: no protobuf copies of them)."""
    slow = safe_deserializer(request_cls)
    if request_cls is not pb.EncodeRequest:
        return slow

    def parse(data: bytes):
        return parse_encode_request(data) or slow(data)

    return parse


def add_to_server(service: TokenizerService, server: grpc.aio.Server) -> None:
    """Register like ``pb_grpc.add_TokenizerServicer_to_server``, but with request parsers
    that never raise: unparseable bytes reach the handler as a ``BadMessage`` and get
    INVALID_ARGUMENT (counted; in a stream, for that message alone) instead of UNKNOWN."""
    handlers = {
        name: factory(getattr(service, name), request_deserializer=request_parser(request),
                      response_serializer=response.SerializeToString)
        for name, (factory, request, response) in _METHODS.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tokenizer"].full_name
