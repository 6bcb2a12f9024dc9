"""Raw pixels of a v1 ``EncodeRequest`` read in place, without protobuf's two copies.

Parsing an ``EncodeRequest`` with protobuf copies its pixel bytes once into the message,
and reading ``images.data`` copies them again into a new ``bytes``: two copies of every
image (1.5 MB for eight 256x256 images) before the one copy a server needs (into the
model's batch or the shared arena). On the 2-core machine, with 8-image requests through
two front-ends, those two copies were about a fifth of a front-end's CPU.

:func:`parse_encode_request` reads the wire format of the one common shape of the message
(``images`` set once, with ``shape``, ``dtype`` and ``data``; ``request_id`` at most once)
and returns a :class:`RawEncodeRequest` whose ``images.data`` is a view of the received
bytes. Anything else (PNG/JPEG requests, a field repeated, unknown fields, invalid UTF-8,
a malformed message) returns None and protobuf parses the message as before, so every
request that protobuf accepts or refuses is answered exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

_UINT64 = 1 << 64
_INT64_MAX = (1 << 63) - 1
_VARINT, _LENGTH = 0, 2


class _NotPlain(Exception):
    """The message is not in the plain form: protobuf parses it instead."""


@dataclass(frozen=True)
class RawTensor:
    """``vqserve.v1.Tensor`` with ``data`` a read-only view of the request's bytes."""

    shape: list
    dtype: str
    data: memoryview


@dataclass(frozen=True)
class RawEncodeRequest:
    """The parts of an ``EncodeRequest`` the server reads (``images`` is set)."""

    images: RawTensor
    request_id: str = ""

    def WhichOneof(self, group: str) -> str | None:  # noqa: N802 - protobuf's name
        return "images" if group == "pixels" else None


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _NotPlain
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes, pos: int, end: int):
    """(field number, wire type, value or (start, stop) of a length-delimited field)."""
    while pos < end:
        key, pos = _varint(data, pos, end)
        number, kind = key >> 3, key & 7
        if kind == _VARINT:
            value, pos = _varint(data, pos, end)
            yield number, kind, value
        elif kind == _LENGTH:
            length, pos = _varint(data, pos, end)
            stop = pos + length
            if stop > end:
                raise _NotPlain
            yield number, kind, (pos, stop)
            pos = stop
        else:
            raise _NotPlain


def _int64(value: int) -> int:
    value %= _UINT64
    return value - _UINT64 if value > _INT64_MAX else value


def _tensor(data: bytes, start: int, stop: int) -> RawTensor:
    shape: list[int] = []
    dtype = blob = None
    for number, kind, value in _fields(data, start, stop):
        if number == 1 and kind == _VARINT:          # shape, unpacked
            shape.append(_int64(value))
        elif number == 1 and kind == _LENGTH:        # shape, packed (segments concatenate)
            pos, end = value
            while pos < end:
                item, pos = _varint(data, pos, end)
                shape.append(_int64(item))
        elif number == 2 and kind == _LENGTH and dtype is None:
            dtype = bytes(data[value[0]:value[1]]).decode("utf-8")
        elif number == 3 and kind == _LENGTH and blob is None:
            blob = value
        else:
            raise _NotPlain
    view = memoryview(data)[blob[0]:blob[1]] if blob else memoryview(b"")
    return RawTensor(shape, dtype or "", view.toreadonly())


def parse_encode_request(data: bytes) -> RawEncodeRequest | None:
    """The request read in place, or None when protobuf must parse it (see the module)."""
    try:
        images = request_id = None
        for number, kind, value in _fields(data, 0, len(data)):
            if number == 1 and kind == _LENGTH and images is None:
                images = value
            elif number == 3 and kind == _LENGTH and request_id is None:
                request_id = bytes(data[value[0]:value[1]]).decode("utf-8")
            else:
                raise _NotPlain
        if images is None:
            return None
        return RawEncodeRequest(_tensor(data, *images), request_id or "")
    except (_NotPlain, UnicodeDecodeError):
        return None
