"""Every error a serving process answers a request with, and the one table of their codes.

Why one home: the engine and the batchers raise these, the gRPC adapters (``serve/api/``)
answer each with its gRPC status, and the split wire (``serve/split/wire.py``) carries
them from the executor to a front-end by a status byte and raises the same exception there,
so a client sees the same code and message in either layout. Kept below all of them, this
module lets none of those folders import another only for an exception class (which made
import circles between them). It imports no torch, and nothing of vqserve: front-end
processes and clients stand on it.
"""

from __future__ import annotations

import asyncio

import grpc


class BadInput(ValueError):
    """A request field broke a rule. ``str(exc)`` is the message the client sees."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


class QueueFull(Exception):
    """The batcher's queue has no room; the client should back off (RESOURCE_EXHAUSTED)."""


class DeadlineExpired(Exception):
    """The request's deadline passed before its batch could run (DEADLINE_EXCEEDED)."""


class BatcherClosed(Exception):
    """The batcher is draining or closed and takes no new work (UNAVAILABLE)."""


class DeviceOutOfMemory(Exception):
    """The device ran out of memory on the call that held this request (RESOURCE_EXHAUSTED)."""


class ReplyTooLarge(Exception):
    """The answer could not fit the gRPC message limit (RESOURCE_EXHAUSTED).

    Raised before the model runs wherever the size follows from the request's shapes, so
    the work is not done only for gRPC to drop the answer (and count it as OK)."""


class NotReady(Exception):
    """The model is still loading (UNAVAILABLE)."""


class NotFound(Exception):
    """An unknown model or tensor name (NOT_FOUND)."""


# The one table: each error, the gRPC status it is answered with, and the status byte it
# crosses the split wire with (None: raised in front of the model only, never sent by the
# executor). The first row that matches counts, so BadInput stands before ValueError. The
# wire's own bytes: OK 0, CANCELLED 6, FAILED 7 (serve/split/wire.py).
CODES: tuple[tuple[type[BaseException], grpc.StatusCode, int | None], ...] = (
    (BadInput, grpc.StatusCode.INVALID_ARGUMENT, 1),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT, 8),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED, 2),
    (ReplyTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED, 5),
    (DeviceOutOfMemory, grpc.StatusCode.RESOURCE_EXHAUSTED, 9),
    (DeadlineExpired, grpc.StatusCode.DEADLINE_EXCEEDED, 3),
    (BatcherClosed, grpc.StatusCode.UNAVAILABLE, 4),
    (NotReady, grpc.StatusCode.UNAVAILABLE, None),
    (NotFound, grpc.StatusCode.NOT_FOUND, None),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a request that failed with ``exc`` is answered with:
    the table's, CANCELLED for a cancellation, and INTERNAL for anything else (its text is
    never sent: the adapters log it with its traceback)."""
    for kind, code, _ in CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "cancelled"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


def wire_status(exc: BaseException) -> int | None:
    """The status byte ``exc`` crosses the split wire with, or None where it does not."""
    for kind, _, status in CODES:
        if status is not None and isinstance(exc, kind):
            return status
    return None


def wire_error(status: int) -> type[BaseException] | None:
    """The exception class a wire status byte stands for, or None."""
    for kind, _, crossing in CODES:
        if crossing == status:
            return kind
    return None
