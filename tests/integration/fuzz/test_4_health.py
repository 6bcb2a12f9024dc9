"""grpc.health.v1.Health fuzzed: Check, Watch and List with the names served and not, and
bytes that do not parse."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2
from hypothesis import given
from hypothesis import strategies as st

from tests.integration.fuzz.common import (
    FUZZ,
    HEALTH,
    NOT_FOUND,
    OK,
    TIMEOUT,
    _bytes_rule,
    _garbage,
    expect,
)

pytestmark = TIMEOUT


# ---- health --------------------------------------------------------------------------------------
HEALTH_SERVICES = ["", "vqserve.v1.Tokenizer", "inference.GRPCInferenceService"]  # docs: health reports these


def _health_requests() -> st.SearchStrategy[tuple[bytes, set]]:
    """A HealthCheckRequest (a reported service, another name, any text) or bytes that may
    not be one, with the codes Check allows: a reported service OK, another NOT_FOUND, bytes
    that do not parse INVALID_ARGUMENT."""
    def rule(message) -> set:
        return {OK} if message.service in HEALTH_SERVICES else {NOT_FOUND}

    def named(name: str) -> tuple[bytes, set]:
        data = health_pb2.HealthCheckRequest(service=name).SerializeToString()
        return data, _bytes_rule(health_pb2.HealthCheckRequest, data, rule)

    valid = health_pb2.HealthCheckRequest(service="vqserve.v1.Tokenizer").SerializeToString()
    return st.one_of(
        st.sampled_from(HEALTH_SERVICES * 2 + ["nope", "grpc.health.v1.Health", " ", "vqserve.v1"]).map(named),
        st.text(max_size=16).map(named),
        _garbage(valid).map(lambda data: (data, _bytes_rule(health_pb2.HealthCheckRequest, data, rule))))


@FUZZ
@given(_health_requests())
def test_health_check(served, request_and_allowed):
    data, allowed = request_and_allowed
    code, details, reply = served.unary(HEALTH + "Check", data)
    expect("Check", code, details, allowed)
    if code == OK:
        assert health_pb2.HealthCheckResponse.FromString(reply).status == health_pb2.HealthCheckResponse.SERVING


@FUZZ
@given(_health_requests())
def test_health_watch(served, request_and_allowed):
    """The first answer of a Watch (the stream is then cancelled): a service health does
    not report is SERVICE_UNKNOWN there, not NOT_FOUND (the health protocol)."""
    data, allowed = request_and_allowed
    allowed = {OK if c == NOT_FOUND else c for c in allowed}
    call = served.channel.unary_stream(HEALTH + "Watch")(data, timeout=60)
    try:
        first = health_pb2.HealthCheckResponse.FromString(next(call))
        code, details = OK, ""
    except grpc.RpcError as exc:
        first, code, details = None, exc.code(), exc.details() or ""
    finally:
        call.cancel()
    expect("Watch", code, details, allowed)
    if first is not None:
        service = health_pb2.HealthCheckRequest.FromString(data).service
        assert first.status == (health_pb2.HealthCheckResponse.SERVING if service in HEALTH_SERVICES
                                else health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)


@FUZZ
@given(st.binary(max_size=40) | st.just(b""))
def test_health_list(served, data):
    code, details, reply = served.unary(HEALTH + "List", data)
    expect("List", code, details, _bytes_rule(health_pb2.HealthListRequest, data, lambda m: {OK}))
    if code == OK:
        statuses = health_pb2.HealthListResponse.FromString(reply).statuses
        assert {name: statuses[name].status for name in HEALTH_SERVICES} == dict.fromkeys(
            HEALTH_SERVICES, health_pb2.HealthCheckResponse.SERVING)
