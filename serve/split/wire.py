"""The front-end <-> executor messages: fixed binary headers over a Unix socket.

Pixels and answers never travel on the socket; they lie in the front-end's shared arena
(:mod:`vqserve.core.shm`), so a message is a few dozen bytes whatever the batch: which block,
what shape, by when. Every request gets exactly one reply (an answer, an error, or
"cancelled"), and only then does the front-end free its block: the executor never reads or
writes a block that has been given back.

Errors cross as a status and a one-line message and are raised again in the front-end as
the exception the single-process server would have raised, so clients see the same gRPC
codes and messages either way.
"""

from __future__ import annotations

import asyncio
import json
import struct

import numpy as np

from vqserve.serve.error_codes import BadInput, wire_error, wire_status

# request: id, kind, dtype, ndim, deadline (monotonic; 0 = none), block offset, answer offset,
# answer capacity (bytes), shape
REQUEST = struct.Struct("<QBBBxd3Q4Q")
# reply: id, status, dtype, ndim, answer shape, message length (bytes that follow)
REPLY = struct.Struct("<QBBBx4QI")

ENCODE, DECODE, CANCEL, READY, PING = 1, 2, 3, 4, 5  # READY: a front-end now serves; PING: are you there?
KINDS = {"encode": ENCODE, "decode": DECODE}
METHODS = {v: k for k, v in KINDS.items()}

# a reply's status: these three, or an error's own byte from the one table (serve/error_codes.py:
# bad input 1, queue full 2, deadline 3, closed 4, too large 5, ValueError 8, out of memory 9)
OK, CANCELLED, FAILED = 0, 6, 7
INFO = 255  # executor -> front-end, unsolicited: the served model's identity (JSON follows)
PONG = 254  # executor -> front-end, the answer to PING: why its model is stalled, or nothing (serve/liveness.py)

DTYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")
DTYPE_CODE = {np.dtype(n): i for i, n in enumerate(DTYPES)}


def dtype_code(dtype) -> int:
    try:
        return DTYPE_CODE[np.dtype(dtype)]
    except KeyError:
        raise BadInput("dtype", f"{np.dtype(dtype).name} cannot cross to the executor") from None


def pack_request(req_id: int, kind: int, dtype, shape: tuple[int, ...], deadline: float | None,
                 offset: int, answer_offset: int, answer_capacity: int) -> bytes:
    dims = (*shape, 0, 0, 0, 0)[:4]
    return REQUEST.pack(req_id, kind, dtype_code(dtype) if kind != CANCEL else 0, len(shape),
                        deadline or 0.0, offset, answer_offset, answer_capacity, *dims)


def unpack_request(data: bytes) -> dict:
    req_id, kind, code, ndim, deadline, offset, answer_offset, capacity, *dims = REQUEST.unpack(data)
    return {"id": req_id, "kind": kind, "dtype": DTYPES[code] if code < len(DTYPES) else None,
            "shape": tuple(dims[:ndim]), "deadline": deadline or None, "offset": offset,
            "answer_offset": answer_offset, "capacity": capacity}


def pack_reply(req_id: int, status: int, array: np.ndarray | None = None, message: str = "") -> bytes:
    body = message.encode()
    if array is None:
        return REPLY.pack(req_id, status, 0, 0, 0, 0, 0, 0, len(body)) + body
    dims = (*array.shape, 0, 0, 0, 0)[:4]
    return REPLY.pack(req_id, status, dtype_code(array.dtype), array.ndim, *dims, len(body)) + body


def unpack_reply(header: bytes) -> tuple[int, int, str, tuple[int, ...], int]:
    """(id, status, dtype name, shape, length of the message that follows)."""
    req_id, status, code, ndim, *rest = REPLY.unpack(header)
    dims, length = rest[:4], rest[4]
    return req_id, status, DTYPES[code], tuple(dims[:ndim]), length


def info_message(payload: dict) -> bytes:
    """The served identity, pushed to every front-end at connect and after a plan switch."""
    return pack_reply(0, INFO, message=json.dumps(payload))


def status_of(exc: BaseException) -> tuple[int, str]:
    """The wire status of an exception raised on the executor's side."""
    status = wire_status(exc)
    if status is not None:
        return status, json.dumps([exc.field, exc.rule]) if isinstance(exc, BadInput) else str(exc)
    return FAILED, f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"


def error_of(status: int, message: str) -> BaseException:
    """The exception a front-end raises for a non-OK reply (same gRPC code as in-process)."""
    kind = wire_error(status)
    if kind is BadInput:
        field, rule = json.loads(message)
        return BadInput(field, rule)
    if kind is not None:
        return kind(message)
    return RuntimeError(f"the executor failed: {message}")


class Outbox:
    """Messages to one peer, written together once per event-loop turn: a model call answers
    many requests at once, and a front-end takes many requests in one turn, so one write
    (one system call) carries them all instead of one each."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.closed = False
        self._queued: list[bytes] = []

    def send(self, message: bytes) -> None:
        if not self._queued:
            asyncio.get_running_loop().call_soon(self.flush)
        self._queued.append(message)

    def flush(self) -> None:
        queued, self._queued = self._queued, []
        if queued and not self.closed and not self.writer.is_closing():
            self.writer.write(b"".join(queued))


def split_replies(buffer: bytearray) -> list[tuple[int, int, str, tuple[int, ...], str]]:
    """The whole replies at the head of ``buffer`` (removed from it), each as
    ``(id, status, dtype, shape, message)``; a partial one stays for the next read."""
    out, at, size = [], 0, REPLY.size
    while len(buffer) - at >= size:
        req_id, status, dtype, shape, length = unpack_reply(bytes(buffer[at:at + size]))
        if len(buffer) - at - size < length:
            break
        message = bytes(buffer[at + size:at + size + length]).decode() if length else ""
        out.append((req_id, status, dtype, shape, message))
        at += size + length
    del buffer[:at]
    return out
