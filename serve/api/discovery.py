"""What a client can learn from the server without a token: gRPC health and reflection.

* health (``grpc.health.v1``): ``Watch`` streams end on drain, ``List`` answers, and
  requests that do not parse get INVALID_ARGUMENT instead of UNKNOWN;
* reflection, ``grpc.reflection.v1`` and ``v1alpha`` over one descriptor pool, with the
  same never-raising parsers and a bound on the names it looks up.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from vqserve.serve._proto import grpc_predict_v2_pb2, tokenizer_pb2
from vqserve.serve.api.errors import BadMessage, safe_deserializer

STEP_METADATA = "vqserve-step"  # trailing metadata of Check/List while not SERVING: what the server does


class DrainingHealthServicer(health.aio.HealthServicer):
    """grpc's health servicer, except that ``Watch`` streams end after they sent NOT_SERVING
    when the server drains. The stock ``Watch`` never returns, so one open watch (a load
    balancer, a mesh sidecar) held every shutdown for the full grace period.

    ``step()``: what the server is doing while it is not yet serving (``ServerState.step``:
    loading, the start-up check with how far it got and the time left), or None. The health
    proto has no message field, so ``Check`` and ``List`` answer it as the trailing metadata
    :data:`STEP_METADATA` (``vqserve health`` prints it)."""

    def __init__(self, step=None) -> None:
        super().__init__()
        self._step = step or (lambda: None)
        self._status: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._changed = asyncio.Event()
        self._ending = False

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def set(self, service: str, status) -> None:
        if not self._ending:  # the parent ignores changes after enter_graceful_shutdown too
            self._status[service] = status
        await super().set(service, status)
        self._wake()

    async def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every service (sent to each watcher), then end every watch."""
        await super().enter_graceful_shutdown()
        self._status = dict.fromkeys(self._status, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._ending = True
        self._wake()

    async def Watch(self, request, context) -> None:
        last = None
        while True:
            changed = self._changed
            status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._ending:
                return
            await changed.wait()

    def _tell_step(self, context) -> None:
        step = self._step()
        if step:  # metadata values are printable ASCII
            text = " ".join(str(step).split()).encode("ascii", "replace").decode()[:1000]
            context.set_trailing_metadata(((STEP_METADATA, text),))

    async def Check(self, request, context) -> health_pb2.HealthCheckResponse:
        self._tell_step(context)
        return await super().Check(request, context)

    async def List(self, request, context) -> health_pb2.HealthListResponse:
        """Every service's status. The health proto declares ``List``, and the stock servicer
        answered it UNIMPLEMENTED ("Method not implemented!")."""
        self._tell_step(context)
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._status.items()})


def add_health(servicer: DrainingHealthServicer, server: grpc.aio.Server) -> None:
    """Register ``grpc.health.v1.Health`` like ``health_pb2_grpc.add_HealthServicer_to_server``,
    but with request parsers that never raise: bytes that are not the method's message got
    UNKNOWN with the parser's text; now INVALID_ARGUMENT (see :func:`_refusing_unparsed`)."""
    methods = {"Check": (grpc.unary_unary_rpc_method_handler, health_pb2.HealthCheckRequest,
                         health_pb2.HealthCheckResponse),
               "List": (grpc.unary_unary_rpc_method_handler, health_pb2.HealthListRequest,
                        health_pb2.HealthListResponse),
               "Watch": (grpc.unary_stream_rpc_method_handler, health_pb2.HealthCheckRequest,
                         health_pb2.HealthCheckResponse)}
    handlers = {
        name: factory(_refusing_unparsed(getattr(servicer, name)), request_deserializer=safe_deserializer(request),
                      response_serializer=response.SerializeToString)
        for name, (factory, request, response) in methods.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(health.SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(health.SERVICE_NAME, handlers)


def _refusing_unparsed(behaviour):
    """``behaviour`` (a unary-request method: it returns its answer, or writes a stream of
    them with ``context.write``) behind a check that its request parsed: a
    :class:`BadMessage` gets INVALID_ARGUMENT before ``behaviour`` sees it."""

    async def checked(request, context):
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))
        return await behaviour(request, context)

    return checked


# ---- reflection -------------------------------------------------------------------------------
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_SERVICES = (REFLECTION_V1, reflection.SERVICE_NAME)  # v1 first: what newer clients ask for
# No proto file or symbol name comes near this; a longer one is refused before any lookup, and
# the answer, which echoes the request, stays far inside the message limit.
MAX_REFLECTION_NAME = 4096


def _v1_reflection_file() -> descriptor_pb2.FileDescriptorProto:
    """``grpc/reflection/v1/reflection.proto``, made from grpcio-reflection's v1alpha file,
    which has no v1: upstream's v1 proto has the same messages, fields and numbers under the
    package ``grpc.reflection.v1`` (wire-identical), so only names and options change."""
    proto = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    old, new = "." + proto.package + ".", ".grpc.reflection.v1."
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    proto.options.Clear()
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    proto.options.java_multiple_files = True
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"

    def rename(holder, attribute: str) -> None:  # set only where set: scalars carry no type_name
        value = getattr(holder, attribute)
        if value.startswith(old):
            setattr(holder, attribute, new + value[len(old):])

    messages = list(proto.message_type)
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            rename(field, "type_name")
    for service in proto.service:
        for method in service.method:
            rename(method, "input_type")
            rename(method, "output_type")
    return proto


def _reflection_pool():
    """One pool holding every served service's file (the OIP stubs live in a private pool),
    both reflection versions included."""
    from google.protobuf import descriptor_pool

    pool = descriptor_pool.DescriptorPool()
    for module in (tokenizer_pb2, grpc_predict_v2_pb2, health_pb2, reflection_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    pool.Add(_v1_reflection_file())
    return pool


class ReflectionService:
    """Server reflection over ``pool``, for one version of the protocol (``request_cls`` and
    ``response_cls`` are that version's messages).

    It replaces grpcio-reflection's servicer, which serves only v1alpha and parses with a
    raising parser: fuzzed bytes got UNKNOWN ("Unexpected DecodeError") and ended the
    stream. Here every message gets one answer, in order, and the stream goes on; a message
    that does not parse, asks nothing, or names something longer than
    :data:`MAX_REFLECTION_NAME` gets an ``error_response`` with INVALID_ARGUMENT (as the
    protocol answers a request kind it does not know, and as EncodeStream answers a bad
    message); an unknown name gets NOT_FOUND."""

    def __init__(self, pool, services: tuple[str, ...], request_cls, response_cls):
        self.pool = pool
        self.services = tuple(sorted(services))
        self.request_cls, self.response_cls = request_cls, response_cls

    async def ServerReflectionInfo(self, request_iterator, context):
        async for request in request_iterator:
            yield self.answer(request)

    def answer(self, request):
        """The one response to ``request`` (a parsed message or a :class:`BadMessage`)."""
        if isinstance(request, BadMessage):
            return self._error(None, grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))
        if too_long := self._too_long(request):
            return self._error(None, grpc.StatusCode.INVALID_ARGUMENT,
                               f"{too_long}: is longer than {MAX_REFLECTION_NAME} characters, more than any "
                               "proto name; the request is not echoed")
        kind = request.WhichOneof("message_request")
        try:
            if kind == "list_services":
                return self.response_cls(original_request=request, list_services_response={
                    "service": [{"name": name} for name in self.services]})
            if kind == "file_by_filename":
                return self._files(request, self.pool.FindFileByName(request.file_by_filename))
            if kind == "file_containing_symbol":
                return self._files(request, self.pool.FindFileContainingSymbol(request.file_containing_symbol))
            if kind == "file_containing_extension":
                ask = request.file_containing_extension
                message = self.pool.FindMessageTypeByName(ask.containing_type)
                extension = self.pool.FindExtensionByNumber(message, ask.extension_number)
                return self._files(request, self.pool.FindFileContainingSymbol(extension.full_name))
            if kind == "all_extension_numbers_of_type":
                message = self.pool.FindMessageTypeByName(request.all_extension_numbers_of_type)
                numbers = sorted(e.number for e in self.pool.FindAllExtensions(message))
                return self.response_cls(original_request=request, all_extension_numbers_response={
                    "base_type_name": message.full_name, "extension_number": numbers})
        except (KeyError, TypeError, ValueError):  # the pool's "no such name" (KeyError)
            return self._error(request, grpc.StatusCode.NOT_FOUND, f"{kind}: nothing of that name is served")
        return self._error(request, grpc.StatusCode.INVALID_ARGUMENT,
                           "message_request: set one of list_services, file_by_filename, "
                           "file_containing_symbol, file_containing_extension, all_extension_numbers_of_type")

    @staticmethod
    def _too_long(request) -> str | None:
        for name, value in (("host", request.host), ("file_by_filename", request.file_by_filename),
                            ("file_containing_symbol", request.file_containing_symbol),
                            ("file_containing_extension.containing_type",
                             request.file_containing_extension.containing_type),
                            ("all_extension_numbers_of_type", request.all_extension_numbers_of_type),
                            ("list_services", request.list_services)):
            if len(value) > MAX_REFLECTION_NAME:
                return name
        return None

    def _files(self, request, descriptor):
        """``descriptor``'s file first, then every file it imports, directly or not (what a
        client needs to build the types, as grpcio-reflection answers)."""
        files, todo = {}, [descriptor]
        while todo:
            file = todo.pop(0)
            if file.name not in files:
                files[file.name] = file
                todo.extend(file.dependencies)
        protos = []
        for file in files.values():
            proto = descriptor_pb2.FileDescriptorProto()
            file.CopyToProto(proto)
            protos.append(proto.SerializeToString())
        return self.response_cls(original_request=request,
                                 file_descriptor_response={"file_descriptor_proto": protos})

    def _error(self, request, code: grpc.StatusCode, message: str):
        response = self.response_cls(error_response={"error_code": code.value[0], "error_message": message})
        if request is not None:
            response.original_request.CopyFrom(request)
        return response


def add_reflection(server: grpc.aio.Server, services: tuple[str, ...]) -> None:
    """Serve ``grpc.reflection.v1`` and ``v1alpha`` over one pool, listing ``services`` (both
    reflection services are added to them), with request parsers that never raise."""
    from google.protobuf import message_factory

    pool = _reflection_pool()
    services = (*services, *REFLECTION_SERVICES)
    for name in REFLECTION_SERVICES:
        package = name.rpartition(".")[0]
        request_cls, response_cls = (message_factory.GetMessageClass(pool.FindMessageTypeByName(
            f"{package}.{message}")) for message in ("ServerReflectionRequest", "ServerReflectionResponse"))
        servicer = ReflectionService(pool, services, request_cls, response_cls)
        handlers = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo, request_deserializer=safe_deserializer(request_cls),
            response_serializer=response_cls.SerializeToString)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)
