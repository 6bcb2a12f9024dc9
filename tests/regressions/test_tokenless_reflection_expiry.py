"""Hardening, round 2: each test reproduced its problem on a real server before the fix.

1. A call without a token was parsed before it was refused: four concurrent tokenless
   Encode calls of 60 MB each raised the server's peak RSS by 456 MB. The deny path kept
   the method's request parser (and, for a unary request, gRPC read the whole message into
   Python first). Now a refused call never reads its message.
2. Bytes that are not a protobuf message got UNKNOWN from reflection and health (their
   stock handlers parse with a raising parser), and ``grpc.reflection.v1`` was not served.
   Now every service we expose answers INVALID_ARGUMENT, and both reflection versions list
   and describe every service, grpcurl style.
3. An expired request kept the model busy: its chunks still queued ran after its deadline.
   Now they are dropped at the deadline (or the cancellation), and its decoded-pixel
   budget is freed.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from tests.helpers import ServeProcess
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve.clients import tensor_msg

pytestmark = pytest.mark.timeout(300)

V1 = "/vqserve.v1.Tokenizer/"
TOKEN = "s3cret"


# ---- item 1: a refused call costs no parse -------------------------------------------------------
def _tokenless_encode(target: str, request: bytes, results: list, metadata=None) -> None:
    """One Encode of ``request`` (raw bytes) with no token; its status code goes to ``results``."""
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 128 << 20)]) as channel:
        try:
            channel.unary_unary(V1 + "Encode")(request, timeout=120, metadata=metadata)
            results.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            results.append(exc.code())


def test_tokenless_calls_are_refused_without_reading_their_message(tiny_checkpoint, tmp_path):
    """Was: 4 x 60 MB tokenless Encode calls raised the server's peak RSS by ~456 MB (every
    message received into Python, then parsed, before UNAUTHENTICATED)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    # 60 MB of images.data: 20 x 1024 x 1024 x 3, under the 64 MB message limit
    big = pb.EncodeRequest(images=pb.Tensor(shape=[20, 1024, 1024, 3], dtype="uint8",
                                            data=bytes(20 * 1024 * 1024 * 3))).SerializeToString()
    assert 60 << 20 < len(big) < 64 << 20
    with ServeProcess(["--model", tiny_checkpoint, "--auth-token-file", str(token_file),
                       "--max-message-mb", "64", "--no-self-check"]) as srv:
        warm = pb.EncodeRequest(images=tensor_msg(np.zeros((2, 64, 64, 3), np.uint8))).SerializeToString()
        ok: list = []
        for _ in range(3):  # the model's own allocations happen before the baseline
            _tokenless_encode(srv.target, warm, ok, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert ok == [grpc.StatusCode.OK] * 3
        before = srv.status_mb("VmHWM")
        results: list = []
        threads = [threading.Thread(target=_tokenless_encode, args=(srv.target, big, results))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        growth = srv.status_mb("VmHWM") - before
        print(f"\npeak RSS growth for 4 x {len(big) >> 20} MB tokenless calls: {growth:.0f} MB")
        assert results == [grpc.StatusCode.UNAUTHENTICATED] * 4
        assert growth < 100, f"the server's peak RSS grew by {growth:.0f} MB refusing 4 tokenless calls"
        # ... and the server still serves a caller with the token
        _tokenless_encode(srv.target, warm, ok, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert ok[-1] == grpc.StatusCode.OK


# ---- item 2: reflection and health answer bad bytes with INVALID_ARGUMENT; reflection v1 -----------
REFLECTION = {"v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
              "v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"}
SERVED = {  # every service the server exposes, with its methods
    "vqserve.v1.Tokenizer": {"Encode", "Decode", "EncodeStream", "DecodeStream", "GetModelInfo"},
    "inference.GRPCInferenceService": {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
                                       "ModelMetadata", "ModelInfer"},
    "grpc.health.v1.Health": {"Check", "Watch", "List"},
    "grpc.reflection.v1alpha.ServerReflection": {"ServerReflectionInfo"},
    "grpc.reflection.v1.ServerReflection": {"ServerReflectionInfo"},
}
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture(scope="module")
def small_server(tiny_checkpoint):
    """An in-process server with a 1 MB message limit (so an over-limit message is cheap)."""
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    cfg = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1", port=0,
                       metrics_port=-1, max_batch_size=8, max_message_mb=1, grace_s=2, self_check=False)
    with ServerThread(cfg) as srv:
        channel = grpc.insecure_channel(srv.target, options=[("grpc.max_send_message_length", 8 << 20)])
        yield srv, channel
        channel.close()


def reflect(channel, version: str, requests: list[bytes]) -> list:
    """One ServerReflectionInfo stream: the raw ``requests`` in, the parsed answers out.
    v1alpha's message classes serve both versions: the two protos are wire-identical."""
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    call = channel.stream_stream(REFLECTION[version])
    return [rpb.ServerReflectionResponse.FromString(r) for r in call(iter(requests), timeout=30)]


def _request(**fields) -> bytes:
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    return rpb.ServerReflectionRequest(**fields).SerializeToString()


def _pool_of(files: list[bytes]):
    """A descriptor pool holding ``files`` (serialized FileDescriptorProtos), each added after
    the files it imports, as grpcurl builds one from reflection answers."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    protos = {p.name: p for p in map(descriptor_pb2.FileDescriptorProto.FromString, files)}
    pool, added = descriptor_pool.DescriptorPool(), set()
    while len(added) < len(protos):
        ready = [p for name, p in protos.items() if name not in added and set(p.dependency) <= added]
        assert ready, f"reflection left out an import of {sorted(set(protos) - added)}"
        for proto in ready:
            pool.Add(proto)
            added.add(proto.name)
    return pool


@pytest.mark.parametrize("version", ["v1alpha", "v1"])
def test_reflection_lists_and_describes_every_service(small_server, version):
    """Was: grpc.reflection.v1 answered UNIMPLEMENTED (newer grpcurl and Postman try it first).
    Like ``grpcurl list`` then ``grpcurl describe`` for each service, over either version."""
    _, channel = small_server
    listed = reflect(channel, version, [_request(list_services="")])[0]
    assert {s.name for s in listed.list_services_response.service} == set(SERVED)
    names = list(SERVED)
    answers = reflect(channel, version, [_request(file_containing_symbol=n) for n in names])
    assert len(answers) == len(names)
    for name, answer in zip(names, answers, strict=True):
        assert answer.WhichOneof("message_response") == "file_descriptor_response", answer
        assert answer.original_request.file_containing_symbol == name
        service = _pool_of(list(answer.file_descriptor_response.file_descriptor_proto)).FindServiceByName(name)
        assert {m.name for m in service.methods} == SERVED[name]
    # the v1 service describes itself in its own package
    v1 = _pool_of(list(answers[names.index("grpc.reflection.v1.ServerReflection")]
                       .file_descriptor_response.file_descriptor_proto))
    method = v1.FindServiceByName("grpc.reflection.v1.ServerReflection").methods_by_name["ServerReflectionInfo"]
    assert method.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    by_file = reflect(channel, version, [_request(file_by_filename="vqserve/v1/tokenizer.proto"),
                                         _request(file_containing_symbol="no.such.Service")])
    assert by_file[0].WhichOneof("message_response") == "file_descriptor_response"
    assert by_file[1].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.parametrize("version", ["v1alpha", "v1"])
def test_reflection_answers_bad_messages_with_invalid_argument(small_server, version):
    """Was: UNKNOWN "Unexpected DecodeError" (and the stream ended). Now a message that
    does not parse, is cut short, or names something longer than any proto name gets an
    INVALID_ARGUMENT error answer of its own, and the stream goes on, as for a request kind
    the protocol does not know."""
    _, channel = small_server
    valid = _request(file_containing_symbol="vqserve.v1.Tokenizer")
    answers = reflect(channel, version, [
        b"\xff\xff garbage", valid[: len(valid) // 2], _request(list_services=""),
        _request(file_containing_symbol="x" * 100_000), _request(host="h" * 100_000, list_services=""),
        _request(), valid])
    kinds = [a.WhichOneof("message_response") for a in answers]
    assert kinds == ["error_response", "error_response", "list_services_response", "error_response",
                     "error_response", "error_response", "file_descriptor_response"], answers
    for i in (0, 1, 3, 4, 5):
        assert answers[i].error_response.error_code == INVALID, answers[i]
    assert "is not a valid grpc.reflection" in answers[0].error_response.error_message
    assert "longer than" in answers[3].error_response.error_message
    # over --max-message-mb: gRPC refuses it before any handler, as for every RPC
    with pytest.raises(grpc.RpcError) as err:
        reflect(channel, version, [_request(file_containing_symbol="x" * (2 << 20))])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_health_answers_bad_messages_with_invalid_argument_and_lists(small_server):
    """Was: UNKNOWN for bytes that are not a HealthCheckRequest (Check and Watch), and
    UNIMPLEMENTED ("Method not implemented!") for the List the health proto declares."""
    from grpc_health.v1 import health_pb2

    _, channel = small_server
    for method, call in (("Check", channel.unary_unary), ("List", channel.unary_unary),
                         ("Watch", channel.unary_stream)):
        with pytest.raises(grpc.RpcError) as err:
            result = call(f"/grpc.health.v1.Health/{method}")(b"\xff\xff garbage", timeout=10)
            list(result) if method == "Watch" else None
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value.details())
        assert "is not a valid grpc.health.v1." in err.value.details()
    listed = health_pb2.HealthListResponse.FromString(channel.unary_unary("/grpc.health.v1.Health/List")(
        health_pb2.HealthListRequest().SerializeToString(), timeout=10))
    assert {name: s.status for name, s in listed.statuses.items()} == dict.fromkeys(
        ["", "vqserve.v1.Tokenizer", "inference.GRPCInferenceService"], health_pb2.HealthCheckResponse.SERVING)
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/grpc.health.v1.Health/Check")(
            health_pb2.HealthCheckRequest(service="nope").SerializeToString(), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


# ---- item 3: expired work leaves the model, the queue and the decoded-pixel budget -----------------
BIG_SIDE, BIG_ROWS, BIG_REQUESTS = 384, 32, 4  # ~60 ms a model call here: 128 calls queued, ~8 s


def _marked(n: int, side: int, first: int) -> np.ndarray:
    """``n`` flat images whose red value at (0, 0) numbers them from ``first``, so the rows a
    model call holds say which request they came from (``FaultyRuntime.calls``)."""
    images = np.full((n, side, side, 3), 90, np.uint8)
    images[:, 0, 0, 0] = np.arange(first, first + n) % 256
    return images


def _png(image: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


@pytest.fixture
def held_server(tiny_checkpoint, one_thread):
    """A server whose one model slot runs a single image per call, through ``FaultyRuntime``
    (the real tiny runtime; every call recorded, and held while its gate is closed)."""
    from tests.helpers import FaultyRuntime
    from vqserve.export.runtimes.loader import EagerRuntime
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    runtime = FaultyRuntime(EagerRuntime(tiny_checkpoint, device="cpu"))
    cfg = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1", port=0,
                       metrics_port=-1, max_batch_size=BIG_ROWS, max_message_mb=64, grace_s=2,
                       micro_batch=1, model_workers=1, max_queue=BIG_ROWS * 2, self_check=False)
    with ServerThread(cfg, runtime=runtime) as srv:
        channel = grpc.insecure_channel(srv.target, options=[("grpc.max_send_message_length", 64 << 20)])
        yield srv, runtime, channel
        runtime.gate.set()
        channel.close()


def _encode(channel, images: np.ndarray, timeout: float) -> grpc.StatusCode:
    try:
        channel.unary_unary(V1 + "Encode")(pb.EncodeRequest(images=tensor_msg(images)).SerializeToString(),
                                           timeout=timeout)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_expired_requests_stop_taking_the_model(tiny_checkpoint, one_thread):
    """The issue's case, scaled to the tiny model on 2 cores: 4 concurrent requests of 32
    images each hit a short deadline with most of their 128 single-image calls still queued;
    a small request sent right after is answered within 2 s of the expiry (issue: 9.35 s).

    Each model call lasts at least 60 ms (the tiny model's time at this size on the 2-core
    machine the test was written on): on a faster CPU the first request's 32 calls ended
    within its 1-s deadline (a fresh-clone CI run), and the test then saw an OK instead of the
    expiry it is about."""
    from tests.helpers import FaultyRuntime
    from vqserve.export.runtimes.loader import EagerRuntime
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    cfg = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1", port=0,
                       metrics_port=-1, max_batch_size=BIG_ROWS, max_message_mb=64, grace_s=2,
                       micro_batch=1, model_workers=1, self_check=False)
    runtime = FaultyRuntime(EagerRuntime(tiny_checkpoint, device="cpu"), min_call_s=0.06)
    with ServerThread(cfg, runtime=runtime) as srv, grpc.insecure_channel(
            srv.target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        small = _marked(1, 64, 0)
        assert _encode(channel, small, 60) == grpc.StatusCode.OK
        deadline_s = 1.0
        codes: list = []
        threads = [threading.Thread(target=lambda i=i: codes.append(_encode(
            channel, _marked(BIG_ROWS, BIG_SIDE, i * BIG_ROWS), deadline_s))) for i in range(BIG_REQUESTS)]
        sent = time.monotonic()
        for t in threads:
            t.start()
        expiry = sent + deadline_s
        time.sleep(deadline_s + 0.05)
        queued_then = srv.server.state.engine.batcher.queued
        assert _encode(channel, small, 60) == grpc.StatusCode.OK
        after_expiry = time.monotonic() - expiry
        for t in threads:
            t.join(60)
        print(f"\nsmall request answered {after_expiry:.2f} s after the expiry "
              f"({queued_then} rows of expired requests queued then)")
        assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * BIG_REQUESTS
        assert after_expiry < 2.0, f"the small request was answered {after_expiry:.2f} s after the expiry"


def test_expired_requests_free_the_queue_while_the_model_is_busy(held_server):
    """Was: requests that expired (or were cancelled) while the model was in a long call still
    counted against --max-queue until a model slot freed: a new request got
    RESOURCE_EXHAUSTED although the queue held only dead work. Now they leave the queue at
    their deadline, and none of their rows reach the model."""
    srv, runtime, channel = held_server
    runtime.gate.clear()  # the one model slot is held, as by a long 1024x1024 call
    long_call = threading.Thread(target=lambda: _encode(channel, _marked(1, 64, 250), 60))
    long_call.start()
    assert runtime.entered.wait(30)
    codes: list = []
    expiring = [threading.Thread(target=lambda i=i: codes.append(_encode(
        channel, _marked(BIG_ROWS, 64, i * BIG_ROWS), 1.0))) for i in range(2)]
    for t in expiring:
        t.start()
    for t in expiring:
        t.join(30)
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2  # the queue was full (2 x 32 rows)
    batcher = srv.server.state.engine.batcher
    settle = time.monotonic() + 5  # the server's copy of a deadline ends a little after the client's
    while batcher.queued and time.monotonic() < settle:
        time.sleep(0.05)
    assert batcher.queued == 0, f"{batcher.queued} rows of expired requests still count as queued"
    answer: list = []
    after = threading.Thread(target=lambda: answer.append(_encode(channel, _marked(1, 64, 200), 60)))
    after.start()
    time.sleep(0.3)  # queued behind the held call, not refused
    runtime.gate.set()
    after.join(60)
    long_call.join(60)
    assert answer == [grpc.StatusCode.OK]
    assert runtime.seen() <= {250, 200}, "rows of the expired requests reached the model"


def test_expired_work_is_dropped_and_its_decoded_budget_freed_without_a_cancel(held_server):
    """An in-process caller of the engine (no gRPC to cancel it at the deadline): its chunks
    still queued were run after its deadline, and its decoded PNG pixels stayed reserved
    until they had. Now the batcher expires the request at its deadline by itself."""
    import asyncio

    srv, runtime, _ = held_server
    engine = srv.server.state.engine
    blobs = [[_png(image) for image in _marked(16, 128, i * 16)] for i in range(2)]
    runtime.gate.clear()  # the first model call is held past the deadline, the rest queue behind it

    async def scenario():
        deadline = time.monotonic() + 0.5
        tasks = [asyncio.ensure_future(engine.encode_encoded(b, deadline)) for b in blobs]
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        # the model stays held: a request still waiting for it never finishes, an expired one
        # does. Polled rather than a fixed pause, so a loaded machine (a CI run once took more
        # than 0.3 s to end the PNG decoding in flight) cannot fail it by timing
        settle = time.monotonic() + 20
        while not all(t.done() for t in tasks) and time.monotonic() < settle:
            await asyncio.sleep(0.05)
        in_use = engine.decoder.budget.in_use
        done = [t.done() for t in tasks]
        runtime.gate.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        return in_use, done, outcomes

    in_use, done, outcomes = srv.call(scenario(), timeout=60)
    rows_run = len(runtime.seen())
    assert all(type(o).__name__ == "DeadlineExpired" for o in outcomes), outcomes
    assert done == [True, True], "the expired requests were still waiting for the model"
    assert in_use == 0, f"{in_use} bytes of decoded pixels still reserved after the deadline"
    assert rows_run <= 1, f"{rows_run} of 32 rows ran, not only the call in flight at the deadline"
