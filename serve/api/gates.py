"""Who may call, and how many streams may stay open: the server's two interceptors.

* :class:`BearerTokenAuth`: every RPC but health checks needs the bearer token, and a call
  without it is refused before its request is read (a refused call costs no memory);
* :class:`StreamGate`: a cap on open streaming calls per service, and an end to them on
  drain, so an idle stream never holds a shutdown for the whole grace period.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging

import grpc

from vqserve.serve.logs import event as _event
from vqserve.serve.metrics import Metrics

HEALTH_PREFIX = "/grpc.health.v1.Health/"


# ---- auth -----------------------------------------------------------------------------------
class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Require ``authorization: Bearer <token>`` on every RPC except health checks.

    The token is in the call's metadata, which arrives before its message: a refused call
    is answered without its message ever being read (see :func:`_deny`)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)  # a lookup only: None -> UNIMPLEMENTED, as with a token
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        got = metadata.get("authorization", "")
        if isinstance(got, str):
            got = got.encode()
        if hmac.compare_digest(got, self._expected):
            return handler
        return _deny(handler, details.method)


UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'"


def _deny(handler, method: str):
    """A handler answering UNAUTHENTICATED without reading the request.

    Always request-streaming, with no parser: gRPC reads a unary request into Python before
    the handler runs (and the method's parser would then copy it again), so four tokenless
    60 MB Encode calls raised the peak RSS by ~450-600 MB. A streaming handler that never
    iterates its requests reads nothing; on the wire a unary call and a one-message stream
    are the same, so the client sees a plain UNAUTHENTICATED either way."""

    async def refuse(request_iterator, context):
        _event("unauthenticated", level=logging.WARNING, method=method)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    if handler.response_streaming:
        async def refuse_streaming(request_iterator, context):
            await refuse(request_iterator, context)
            yield  # pragma: no cover - an async generator that aborts before its first answer

        return grpc.stream_stream_rpc_method_handler(refuse_streaming)
    return grpc.stream_unary_rpc_method_handler(refuse)


def _same_kind(handler, behaviour):
    """A method handler of ``handler``'s kind (unary/stream each way) and (de)serializers,
    running ``behaviour`` instead: how the interceptors replace or wrap a method."""
    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(behaviour, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(behaviour, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(behaviour, **kw)
    return grpc.stream_stream_rpc_method_handler(behaviour, **kw)


# ---- streams: a cap per service, and an end on drain -------------------------------------------
class _DrainableRequests:
    """The request side of a client-streaming call, which :meth:`end` closes early.

    ``grpc.aio``'s ``server.stop(grace)`` waits for every open call, and an idle stream
    never finishes on its own: one open EncodeStream held a SIGTERM drain for the whole
    grace period. Ending the request side lets the handler answer what it already read and
    return; a read in progress is cancelled (its message, if any, was never accepted)."""

    def __init__(self, requests):
        self._it = requests.__aiter__()
        self._read: asyncio.Future | None = None
        self.ended = False  # end() was called
        self.cut = False    # ... and it stopped a read: the client's stream was not read to its end

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.ended:
            self.cut = True
            raise StopAsyncIteration
        self._read = asyncio.ensure_future(self._it.__anext__())
        try:
            return await self._read
        except asyncio.CancelledError:
            if self.ended and not asyncio.current_task().cancelling():  # end(), not the client
                self.cut = True
                raise StopAsyncIteration from None
            raise
        finally:
            self._read = None

    def end(self) -> None:
        self.ended = True
        if self._read is not None:
            self._read.cancel()


class StreamGate(grpc.aio.ServerInterceptor):
    """At most ``limit`` open streaming calls per service, and an end to them on drain.

    Each open stream costs memory and a read-ahead window, and 2,000 idle ones were accepted
    with no limit: one over the cap is refused at once with RESOURCE_EXHAUSTED (counted in
    ``vqserve_requests_total``), never queued. Services count apart, so unauthenticated
    health watches cannot crowd out token-holding EncodeStream clients. On :meth:`drain`,
    client streams stop reading and end with UNAVAILABLE once every request they had read
    is answered, so an idle stream no longer holds a shutdown for the whole grace period.
    """

    DRAINING = "server is draining; reconnect (to another replica) and resend requests with no answer"

    def __init__(self, limit: int, metrics: Metrics, services: tuple[str, ...] = ()):
        """``services``: those whose ``vqserve_streams_open`` series exist from the start (0)."""
        self.limit = limit
        self.metrics = metrics
        self.open: dict[str, int] = {}
        for service in services:
            metrics.streams_open.labels(service).set(0)
        self.draining = False
        self._requests: set[_DrainableRequests] = set()

    def drain(self) -> None:
        self.draining = True
        for requests in list(self._requests):
            requests.end()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        service, _, method = details.method.lstrip("/").partition("/")
        return _gated(handler, self, service, method)

    def admit(self, service: str, method: str) -> str | None:
        """Count a new stream in; the refusal message when ``service`` is at its cap."""
        if self.open.get(service, 0) >= self.limit:
            self.metrics.requests.labels(method, "RESOURCE_EXHAUSTED").inc()
            self.metrics.errors.labels(method, "RESOURCE_EXHAUSTED").inc()
            return (f"too many open streams: {service} allows {self.limit} at once (--max-streams); "
                    "close a stream or retry later")
        self.open[service] = self.open.get(service, 0) + 1
        self.metrics.streams_open.labels(service).set(self.open[service])
        return None

    def release(self, service: str) -> None:
        self.open[service] -= 1
        self.metrics.streams_open.labels(service).set(self.open[service])


def _gated(handler, gate: StreamGate, service: str, method: str):
    """``handler`` with its behaviour wrapped in :class:`StreamGate`'s admission and drain."""
    inner = handler.stream_stream or handler.stream_unary or handler.unary_stream
    client_streaming = handler.request_streaming

    def enter(request):
        if client_streaming:
            request = _DrainableRequests(request)
            if gate.draining:
                request.ended = True
            gate._requests.add(request)
        return request

    def leave(request, context) -> None:
        if client_streaming:
            gate._requests.discard(request)
            if request.cut:  # a client that had closed its side got every answer: plain OK
                context.set_code(grpc.StatusCode.UNAVAILABLE)
                context.set_details(StreamGate.DRAINING)
        gate.release(service)

    if inspect.isasyncgenfunction(inner):
        async def behaviour(request, context):
            if refused := gate.admit(service, method):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            request = enter(request)
            try:
                async for response in inner(request, context):
                    yield response
            finally:
                leave(request, context)
    else:
        async def behaviour(request, context):
            if refused := gate.admit(service, method):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            request = enter(request)
            try:
                return await inner(request, context)
            finally:
                leave(request, context)

    return _same_kind(handler, behaviour)
