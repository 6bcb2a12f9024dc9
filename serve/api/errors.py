"""Answer failures with gRPC status codes, and record each request in the metrics.

How both protocol adapters apply the one table of ``serve/error_codes.py`` (bad input,
unparseable protobuf bytes included -> INVALID_ARGUMENT, full queue, device out of memory or
an answer too big for the message limit -> RESOURCE_EXHAUSTED, passed deadline ->
DEADLINE_EXCEEDED, loading or draining -> UNAVAILABLE, anything else -> INTERNAL, logged with
its traceback, never sent): aborting a call, counting its outcome, and answering a message
that did not parse.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

# the errors and their table live in serve/error_codes.py; the adapters' names stay here too
from vqserve.serve.error_codes import BadInput, status_for
from vqserve.serve.error_codes import NotFound as NotFound
from vqserve.serve.error_codes import NotReady as NotReady
from vqserve.serve.error_codes import ReplyTooLarge as ReplyTooLarge

log = logging.getLogger("vqserve.serve")


class BadMessage:
    """Stands in for a request whose bytes are not a valid protobuf message.

    gRPC turns an exception in a request deserializer into UNKNOWN, outside every handler:
    it is not counted, and in a stream it ends the whole call. Returning this instead lets
    the handler answer INVALID_ARGUMENT (in a stream: for that message alone) and count it.
    """

    request_id = ""  # streams echo the request id; a message that did not parse has none

    def __init__(self, type_name: str):
        self.type_name = type_name

    def error(self) -> BadInput:
        return BadInput("request", f"is not a valid {self.type_name} protobuf message "
                                   "(the bytes do not parse); send a serialized "
                                   f"{self.type_name}")


def safe_deserializer(message_cls) -> Callable[[bytes], object]:
    """``message_cls.FromString`` that returns a :class:`BadMessage` instead of raising."""
    type_name = message_cls.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception:  # noqa: BLE001 - DecodeError, or the parser's recursion limit
            return BadMessage(type_name)

    return parse


def reject_unparsed(request) -> None:
    """Raise INVALID_ARGUMENT for a request that did not parse (see :class:`BadMessage`)."""
    if isinstance(request, BadMessage):
        raise request.error()


class Tracker:
    """Times one request and counts its outcome: ``with tracker.track("Encode"): ...``."""

    def __init__(self, metrics):
        self.metrics = metrics

    def track(self, method: str, context=None):
        return _Tracked(self.metrics, method, context)


# A cancellation this close to the deadline is the deadline (clocks and timers differ by ms).
DEADLINE_SLACK_S = 0.05


class _Tracked:
    def __init__(self, metrics, method: str, context=None):
        self.metrics, self.method, self.context = metrics, method, context
        self.code = grpc.StatusCode.OK

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.metrics.in_flight.inc()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.metrics.in_flight.dec()
        if exc is not None:
            self.code, message = status_for(exc)
            if self.code == grpc.StatusCode.CANCELLED and self.context is not None:
                remaining = self.context.time_remaining()
                # grpc cancels RPCs whose deadline passed; the client's timer can fire a few
                # ms before the server's copy of the deadline does, so allow a little slack
                if remaining is not None and remaining <= DEADLINE_SLACK_S:
                    self.code = grpc.StatusCode.DEADLINE_EXCEEDED
            if self.code == grpc.StatusCode.INTERNAL:
                log.error("internal error in %s", self.method, exc_info=(exc_type, exc, tb))
        name = self.code.name
        self.metrics.requests.labels(self.method, name).inc()
        if self.code != grpc.StatusCode.OK:
            self.metrics.errors.labels(self.method, name).inc()
        self.metrics.request_latency.labels(self.method).observe(time.perf_counter() - self.t0)
        return False


def deadline_of(context) -> float | None:
    """The RPC deadline as a ``time.monotonic()`` value, or None."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def abort_for(context, exc: BaseException):
    code, message = status_for(exc)
    await context.abort(code, message)
