"""Raw pixels of an EncodeRequest read in place (serve/api/rawrequest.py): the same request as
protobuf's, or protobuf parses it (never a different reading)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve.api.rawrequest import parse_encode_request
from vqserve.serve.api.v1 import request_parser, tensor_array


def _same(fast, message: bytes) -> None:
    slow = pb.EncodeRequest.FromString(message)
    assert slow.WhichOneof("pixels") == "images"
    assert fast.request_id == slow.request_id
    assert list(fast.images.shape) == list(slow.images.shape)
    assert fast.images.dtype == slow.images.dtype
    assert bytes(fast.images.data) == slow.images.data


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=5),
       dtype=st.text(max_size=8), data=st.binary(max_size=300), request_id=st.text(max_size=20))
def test_plain_requests_read_in_place_equal_protobuf(shape, dtype, data, request_id):
    message = pb.EncodeRequest(images=pb.Tensor(shape=shape, dtype=dtype, data=data),
                               request_id=request_id).SerializeToString()
    fast = parse_encode_request(message)
    assert fast is not None
    _same(fast, message)
    assert isinstance(fast.images.data, memoryview) and fast.images.data.readonly


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_read_as_protobuf_reads_them_or_left_to_it(message):
    fast = parse_encode_request(message)
    if fast is None:
        return
    _same(fast, message)  # protobuf parses it too, to the same request


def test_unusual_forms_are_left_to_protobuf():
    tensor = pb.Tensor(shape=[1, 8, 8, 3], dtype="uint8", data=bytes(192))
    plain = pb.EncodeRequest(images=tensor).SerializeToString()
    assert parse_encode_request(plain) is not None
    twice = plain + plain  # a message field twice: protobuf merges them
    assert parse_encode_request(twice) is None
    jpeg = pb.EncodeRequest(encoded=pb.EncodedImages(images=[b"x"])).SerializeToString()
    assert parse_encode_request(jpeg) is None
    bad_utf8 = pb.EncodeRequest(images=tensor).SerializeToString() + b"\x1a\x01\xff"  # request_id
    assert parse_encode_request(bad_utf8) is None
    assert parse_encode_request(b"") is None  # no pixels: protobuf's default message
    assert parse_encode_request(plain[:-5]) is None  # cut short
    # shape written unpacked (one varint per dimension), as older encoders may
    unpacked = b"\x0a" + bytes([len(b := b"\x08\x01\x08\x02\x12\x05uint8\x1a\x02ab")]) + b
    fast = parse_encode_request(unpacked)
    assert fast is not None and fast.images.shape == [1, 2] and bytes(fast.images.data) == b"ab"
    _same(fast, unpacked)
    # a 10-byte varint is truncated to 64 bits by protobuf, an 11-byte one is corrupt
    for varint, readable in ((b"\xff" * 9 + b"\x7f", True), (b"\xff" * 10 + b"\x01", False)):
        tensor_bytes = b"\x08" + varint
        message = b"\x0a" + bytes([len(tensor_bytes)]) + tensor_bytes
        fast = parse_encode_request(message)
        assert (fast is not None) == readable
        if readable:
            _same(fast, message)


def test_the_server_parser_gives_pixels_without_copying_and_falls_back():
    parse = request_parser(pb.EncodeRequest)
    pixels = np.arange(2 * 8 * 8 * 3, dtype=np.uint8).reshape(2, 8, 8, 3)
    message = pb.EncodeRequest(images=pb.Tensor(shape=[2, 8, 8, 3], dtype="uint8", data=pixels.tobytes()),
                               request_id="r1").SerializeToString()
    request = parse(message)
    array = tensor_array(request.images, "images")
    assert np.array_equal(array, pixels) and request.request_id == "r1"
    assert np.shares_memory(array, np.frombuffer(message, np.uint8))  # a view of the received bytes
    assert parse(b"\xff\xff").__class__.__name__ == "BadMessage"  # refused as before
    jpeg = pb.EncodeRequest(encoded=pb.EncodedImages(images=[b"x"])).SerializeToString()
    assert parse(jpeg).WhichOneof("pixels") == "encoded"
