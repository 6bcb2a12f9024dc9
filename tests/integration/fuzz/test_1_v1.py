"""vqserve.v1.Tokenizer fuzzed: raw and PNG/JPEG Encode, amplification, Decode, both
streams, GetModelInfo."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.integration.fuzz.common import (
    CODEBOOK,
    EXAMPLES,
    EXHAUSTED,
    FACTOR,
    FUZZ,
    INVALID,
    LIMIT,
    MAX_BATCH,
    OK,
    RSS_BUDGET_MB,
    TIMEOUT,
    V1,
    _bytes_rule,
    _code,
    expect,
)
from tests.integration.fuzz.strategies import (
    _size_rule,
    blobs,
    expected_decode,
    expected_encode,
    expected_encoded,
    flat_png,
    image_tensors,
    index_tensors,
)
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve.api import codec

pytestmark = TIMEOUT


# ---- v1 ------------------------------------------------------------------------------------------
@FUZZ
@given(image_tensors(), st.text(max_size=8))
def test_v1_encode_raw(served, runtime, tensor_and_pixels, request_id):
    tensor, pixels = tensor_and_pixels
    request = pb.EncodeRequest(images=tensor, request_id=request_id).SerializeToString()
    code, details, reply = served.unary(V1 + "Encode", request)
    expect("Encode", code, details, _size_rule(request, expected_encode(pixels)))
    if code == OK:
        got = pb.EncodeResponse.FromString(reply)
        assert got.request_id == request_id
        np.testing.assert_array_equal(codec.array_from_bytes(got.indices.shape, got.indices.dtype,
                                                             got.indices.data, "r"),
                                      runtime.encode(np.array(pixels)))


@FUZZ
@given(st.lists(blobs(), min_size=0, max_size=MAX_BATCH + 2))
def test_v1_encode_png_and_jpeg(served, runtime, entries):
    from vqserve.core.images import load_rgb

    request = pb.EncodeRequest(encoded=pb.EncodedImages(images=[b for b, _, _ in entries]))
    data = request.SerializeToString()
    code, details, reply = served.unary(V1 + "Encode", data)
    expect("Encode", code, details, _size_rule(data, expected_encoded(entries)))
    if code == OK and all(v == "ok" for _, v, _ in entries):
        got = pb.EncodeResponse.FromString(reply).indices
        pixels = np.stack([load_rgb(b, formats=("PNG", "JPEG")) for b, _, _ in entries])
        np.testing.assert_array_equal(codec.array_from_bytes(got.shape, got.dtype, got.data, "r"),
                                      runtime.encode(pixels))


@settings(FUZZ, max_examples=max(3, EXAMPLES // 4))
@given(st.integers(MAX_BATCH + 1, 400), st.sampled_from([1024, 256, 2048, 8]))
@example(400, 1024)
def test_v1_encode_amplification(served, copies, size):
    """Hundreds of tiny PNGs that each claim (and really hold) a big image: refused from
    the count or the headers, without decoding them all (issue 13, item 1). The server's
    peak memory is read after every call, so a failure shrinks to the smallest request
    that blows the budget."""
    blob = flat_png(size)
    data = pb.EncodeRequest(encoded=pb.EncodedImages(images=[blob] * copies)).SerializeToString()
    code, details, _ = served.unary(V1 + "Encode", data)
    # the count rule is INVALID_ARGUMENT; a decoded-bytes or pixel budget that trips first
    # is RESOURCE_EXHAUSTED: both refuse the request
    expect("Encode", code, details, _size_rule(data, {INVALID, EXHAUSTED}))
    growth = served.peak_growth()
    assert growth <= RSS_BUDGET_MB, (f"{copies} x {size}x{size} PNG ({len(data)} bytes): a "
                                     f"server process's peak RSS grew by {growth:.0f} MB")


@FUZZ
@given(index_tensors(), st.sampled_from([0, 0, 0, 1, 1, 2, -1, 7, 2**31 - 1]), st.text(max_size=8))
def test_v1_decode(served, runtime, parsed, output_format, request_id):
    tensor, array, in_range = parsed
    if output_format == 1 and array is not None and array.ndim == 3 and array.shape[1] * array.shape[2] > 64:
        output_format = 0  # a big PNG answer would run the model at 1024x1024: keep it cheap
    request = pb.DecodeRequest(indices=tensor, output_format=output_format,
                               request_id=request_id).SerializeToString()
    allowed = expected_decode(array, in_range, raw_reply=output_format == 0,
                              extra=len(request_id.encode()))
    if output_format not in (0, 1):
        allowed = (allowed - {OK}) | {INVALID}
    code, details, reply = served.unary(V1 + "Decode", request)
    expect("Decode", code, details, _size_rule(request, allowed))
    if code == OK:
        got = pb.DecodeResponse.FromString(reply)
        want = runtime.decode(array.astype(np.uint16))
        if output_format == 0:
            images = codec.array_from_bytes(got.images.shape, got.images.dtype, got.images.data, "r")
        else:
            images = codec.decode_images(list(got.encoded.images), "r", 1 << 40)
        assert images.shape == want.shape
        assert np.abs(images.astype(np.int16) - want).max(initial=0) <= 1


@FUZZ
@given(st.lists(st.one_of(image_tensors().map(lambda t: ("tensor", t)),
                          st.binary(max_size=40).map(lambda b: ("bytes", b))),
                min_size=1, max_size=5))
def test_v1_encode_stream(served, messages):
    """One response per message, in order; a bad message (bad bytes included) fails alone."""
    wire, allowed = [], []
    for i, (kind, payload) in enumerate(messages):
        if kind == "tensor":
            tensor, pixels = payload
            wire.append(pb.EncodeRequest(images=tensor, request_id=str(i)).SerializeToString())
            allowed.append(expected_encode(pixels))
        else:
            wire.append(payload)
            allowed.append(_bytes_rule(pb.EncodeRequest, payload))
    keep = [i for i, w in enumerate(wire) if len(w) <= LIMIT]  # one too big would end the call
    wire, allowed = [wire[i] for i in keep], [allowed[i] for i in keep]
    _check_stream(served, "EncodeStream", pb.EncodeResponse, wire, allowed)


@FUZZ
@given(st.lists(st.one_of(index_tensors().map(lambda t: ("tensor", t)),
                          st.binary(max_size=40).map(lambda b: ("bytes", b))),
                min_size=1, max_size=5))
def test_v1_decode_stream(served, messages):
    wire, allowed = [], []
    for i, (kind, payload) in enumerate(messages):
        if kind == "tensor":
            tensor, array, in_range = payload
            if array is not None and array.ndim == 3 and array.shape[1] * array.shape[2] > 64:
                continue  # keep streams small: the big-answer rule is fuzzed in test_v1_decode
            wire.append(pb.DecodeRequest(indices=tensor, request_id=str(i)).SerializeToString())
            allowed.append(expected_decode(array, in_range, raw_reply=True))
        else:
            wire.append(payload)
            allowed.append(_bytes_rule(pb.DecodeRequest, payload))
    # a 1-D tensor of 2,097,140 uint16 indices is 26 bytes over the 4 MiB limit once framed:
    # gRPC ends the whole call with RESOURCE_EXHAUSTED, as for EncodeStream above
    keep = [i for i, w in enumerate(wire) if len(w) <= LIMIT]
    wire, allowed = [wire[i] for i in keep], [allowed[i] for i in keep]
    _check_stream(served, "DecodeStream", pb.DecodeResponse, wire, allowed)


def _check_stream(served, method: str, response_cls, wire: list[bytes], allowed: list[set]) -> None:
    """Send ``wire`` down one stream: the call ends OK, one response per message, in order,
    each with a status in its ``allowed`` set."""
    if not wire:
        return
    code, details, replies = served.stream(V1 + method, wire)
    expect(f"{method}(call)", code, details, {OK})
    assert len(replies) == len(wire)
    for reply, ok_codes in zip(replies, allowed, strict=True):
        got = response_cls.FromString(reply)
        expect(method, _code(got.error.code), got.error.message, ok_codes)


@FUZZ
@given(st.binary(max_size=64))
def test_v1_get_model_info(served, data):
    code, details, reply = served.unary(V1 + "GetModelInfo", data)
    expect("GetModelInfo", code, details, _bytes_rule(pb.GetModelInfoRequest, data, lambda m: {OK}))
    if code == OK:
        info = pb.ModelInfo.FromString(reply)
        assert (info.codebook_size, info.factor, info.max_batch_size) == (CODEBOOK, FACTOR, MAX_BATCH)
