"""Server reflection, v1 and v1alpha, fuzzed: names served and not, names longer than any
proto name, garbage, truncated and bit-flipped messages."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from hypothesis import given
from hypothesis import strategies as st

from tests.integration.fuzz.common import (
    FUZZ,
    INVALID,
    NOT_FOUND,
    OK,
    REFLECTION,
    SERVICES,
    TIMEOUT,
    _bytes_rule,
    _code,
    _garbage,
    expect,
    rarely,
)
from vqserve.serve._proto import grpc_predict_v2_pb2 as oip
from vqserve.serve._proto import tokenizer_pb2 as pb

pytestmark = TIMEOUT


# ---- server reflection, v1 and v1alpha ------------------------------------------------------------
MAX_REFLECTION_NAME = 4096  # docs: a name (or host) of more characters is refused with INVALID_ARGUMENT
REFLECTED_FILES = [m.DESCRIPTOR.name for m in (pb, oip, health_pb2, rpb)] + ["grpc/reflection/v1/reflection.proto"]
REFLECTED_SYMBOLS = [s for s in SERVICES] + ["vqserve.v1.EncodeRequest", "inference.ModelInferRequest",
                                             "grpc.health.v1.HealthCheckResponse",
                                             "grpc.reflection.v1.ServerReflectionResponse"]
REFLECTED_MESSAGES = REFLECTED_SYMBOLS[len(SERVICES):]


def _reflection_rule(message) -> set:
    """The documented answer to one parsed ServerReflectionRequest."""
    names = (message.host, message.file_by_filename, message.file_containing_symbol,
             message.file_containing_extension.containing_type, message.all_extension_numbers_of_type,
             message.list_services)
    if any(len(name) > MAX_REFLECTION_NAME for name in names):
        return {INVALID}
    kind = message.WhichOneof("message_request")
    if kind is None:
        return {INVALID}  # asks nothing
    if kind == "list_services":
        return {OK}
    if kind == "file_by_filename":
        return {OK} if message.file_by_filename in REFLECTED_FILES else {NOT_FOUND}
    if kind == "file_containing_symbol":  # fields, methods, enums of the files are symbols too
        return {OK} if message.file_containing_symbol in REFLECTED_SYMBOLS else {OK, NOT_FOUND}
    if kind == "file_containing_extension":
        return {NOT_FOUND}  # the served files declare no extensions
    return {OK} if message.all_extension_numbers_of_type in REFLECTED_MESSAGES else {OK, NOT_FOUND}


@st.composite
def reflection_messages(draw) -> tuple[bytes, set]:
    """One ServerReflectionRequest, as bytes (v1alpha's classes: the v1 proto is wire-identical),
    and the codes its answer may carry: every kind of request, names served and not, names
    longer than any proto name, and garbage, truncated or bit-flipped messages."""
    name = draw(st.sampled_from(["x" * 5000, "y" * 70_000])) if rarely(draw) else \
        draw(st.sampled_from(REFLECTED_SYMBOLS + REFLECTED_FILES + ["", "nope", "vqserve.v1.Nope"])
             | st.text(max_size=24))
    kind = draw(st.sampled_from(["list", "file", "file", "symbol", "symbol", "extension", "numbers",
                                 "empty", "garbage", "garbage"]))
    host = "h" * 5000 if rarely(draw) else draw(st.sampled_from(["", "localhost"]))
    fields = {"list": {"list_services": ""}, "file": {"file_by_filename": name},
              "symbol": {"file_containing_symbol": name},
              "extension": {"file_containing_extension": {"containing_type": name,
                                                          "extension_number": draw(st.integers(0, 2**29))}},
              "numbers": {"all_extension_numbers_of_type": name}, "empty": {}}
    if kind == "garbage":
        valid = rpb.ServerReflectionRequest(file_containing_symbol="vqserve.v1.Tokenizer").SerializeToString()
        data = draw(_garbage(valid))
    else:
        data = rpb.ServerReflectionRequest(host=host, **fields[kind]).SerializeToString()
    return data, _bytes_rule(rpb.ServerReflectionRequest, data, _reflection_rule)


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection(served, version):
    """A stream of requests to one reflection version: the call ends OK with one answer per
    message, in order, each with the code the rules give (an ``error_response`` carries it;
    any other answer is OK) and echoing the request it answers, if that parsed."""
    rpc = f"Reflection {version}"

    @FUZZ
    @given(st.lists(reflection_messages(), min_size=1, max_size=5))
    def run(messages):
        wire = [data for data, _ in messages]
        code, details, replies = served.stream(REFLECTION[version], wire)
        expect(f"{rpc}(call)", code, details, {OK})
        assert len(replies) == len(wire)
        for reply, (data, allowed) in zip(replies, messages, strict=True):
            answer = rpb.ServerReflectionResponse.FromString(reply)
            is_error = answer.WhichOneof("message_response") == "error_response"
            got = _code(answer.error_response.error_code) if is_error else OK
            expect(rpc, got, answer.error_response.error_message, allowed)
            if got != INVALID:
                assert answer.original_request == rpb.ServerReflectionRequest.FromString(data)

    run()
