"""Issue 13, items 1 and 2: memory and availability, against a real in-process server.

1. An Encode of N copies of a 3 KB 1024x1024 PNG was decoded in full (on the event-loop
   thread) before the batch-size rule refused it: 400 copies took 2.4 GB and blocked health
   checks for 5 s. Now the count and every header are checked before any pixel is decoded,
   decoding runs in its own threads, and decoded pixels count against a byte budget.
2. Batches were formed by count only: 32 images at 1024x1024 in one model call need ~8.5 GB.
   Now a pixel budget per model call (``--max-batch-pixels``) caps every call, and a request
   larger than the budget runs in chunks.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.helpers import CountingRuntime
from vqserve.cli import main as cli_main
from vqserve.commands.serve import config_from_args
from vqserve.core import images as imagelib
from vqserve.export.runtimes.loader import EagerRuntime
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc
from vqserve.serve.api import decoding
from vqserve.serve.api.decoding import ByteBudget
from vqserve.serve.config import ServerConfig
from vqserve.serve.engine.batcher import Batcher
from vqserve.serve.launcher import ServerThread

pytestmark = pytest.mark.timeout(180)

BIG = 1024


def png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=9)
    return buf.getvalue()


@pytest.fixture(scope="module")
def flat_png() -> bytes:
    """A 1024x1024 single-colour PNG: ~3 KB on the wire, 3 MB decoded."""
    return png(np.full((BIG, BIG, 3), 77, np.uint8))


class DecodeSpy:
    """Counts real image decodes (the function still runs): proves what was never decoded."""

    def __init__(self, monkeypatch):
        self.count = 0
        self.on_event_loop = 0  # decodes that ran on a thread with a running asyncio loop
        real = decoding._decode_one

        def counted(*args):
            self.count += 1
            try:
                asyncio.get_running_loop()
                self.on_event_loop += 1
            except RuntimeError:
                pass
            return real(*args)

        monkeypatch.setattr(decoding, "_decode_one", counted)


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    rt = CountingRuntime(EagerRuntime(tiny_checkpoint, device="cpu"))
    cfg = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1",
                       port=0, metrics_port=-1, max_batch_size=32, max_delay_ms=20,
                       max_message_mb=64, grace_s=2, max_batch_pixels=3 * 64 * 64, micro_batch=4)
    with ServerThread(cfg, runtime=rt) as srv:
        channel = grpc.insecure_channel(srv.target, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        yield srv, rt, channel
        channel.close()


def encode_pngs(channel, blobs: list[bytes], timeout: float = 60):
    stub = pb_grpc.TokenizerStub(channel)
    return stub.Encode(pb.EncodeRequest(encoded=pb.EncodedImages(images=blobs)), timeout=timeout)


def health_latencies(target: str, stop: threading.Event) -> list[float]:
    """Ping health back to back until ``stop``; the longest gap is what a load balancer sees."""
    out: list[float] = []
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while not stop.is_set():
            t = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            out.append(time.perf_counter() - t)
    return out


# ---- item 1: count and headers before any decoding --------------------------------------------
def test_400_tiny_big_pngs_are_refused_from_the_count_without_decoding(served, flat_png, monkeypatch):
    srv, _, channel = served
    spy = DecodeSpy(monkeypatch)
    blobs = [flat_png] * 400  # ~1.2 MB on the wire, 1.2 GB if decoded
    assert sum(map(len, blobs)) < 2 << 20
    with pytest.raises(grpc.RpcError) as err:
        encode_pngs(channel, blobs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "400 images, more than max-batch-size 32" in err.value.details()
    assert spy.count == 0  # nothing decoded: refused from the count (not timed: load 5 must pass)
    assert srv.server.state.engine.decoder.budget.in_use == 0


def test_one_odd_header_refuses_the_request_before_any_pixel_is_decoded(served, flat_png, monkeypatch):
    _, _, channel = served
    spy = DecodeSpy(monkeypatch)
    odd = png(np.zeros((64, 64, 3), np.uint8))
    with pytest.raises(grpc.RpcError) as err:
        encode_pngs(channel, [flat_png] * 20 + [odd])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "encoded.images[20]: has size 64x64, but encoded.images[0] has 1024x1024" in err.value.details()
    assert spy.count == 0


def claiming(side: int) -> bytes:
    """An 8x8 PNG whose IHDR (and its CRC) is rewritten to claim ``side`` x ``side`` pixels."""
    import struct
    import zlib

    small = png(np.zeros((8, 8, 3), np.uint8))
    ihdr = bytearray(small[12:29])
    ihdr[4:12] = struct.pack(">II", side, side)
    return small[:12] + bytes(ihdr) + struct.pack(">I", zlib.crc32(bytes(ihdr))) + small[33:]


@pytest.mark.parametrize(("side", "says"), [(2000, "2000x2000 = 4000000 pixels, more than the limit 1048576"),
                                             (30000, "decompression bomb")])
def test_a_decompression_bomb_header_is_refused_from_the_header(served, monkeypatch, side, says):
    """A 70-byte PNG claiming 4 MP (over the server's limit) or 900 MP (over Pillow's)."""
    _, _, channel = served
    spy = DecodeSpy(monkeypatch)
    with pytest.raises(grpc.RpcError) as err:
        encode_pngs(channel, [claiming(side)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in err.value.details(), err.value.details()
    assert spy.count == 0


def test_health_answers_promptly_while_a_full_request_decodes(served, flat_png, monkeypatch):
    """Big images decode off the event loop (on a thread with no running loop), so health
    checks keep being answered meanwhile. Shown by where the decodes ran, not by a latency
    limit: tests must pass on a machine at load 5."""
    srv, _, channel = served
    spy = DecodeSpy(monkeypatch)
    rng = np.random.default_rng(0)
    noisy = png(rng.integers(0, 256, (BIG, BIG, 3), dtype=np.uint8))  # slow to decode
    stop = threading.Event()
    result: dict = {}
    pinger = threading.Thread(target=lambda: result.update(lat=health_latencies(srv.target, stop)))
    pinger.start()
    try:
        time.sleep(0.2)
        stub = pb_grpc.TokenizerStub(channel)
        reply = stub.Encode(pb.EncodeRequest(encoded=pb.EncodedImages(images=[noisy] * 8)), timeout=120)
    finally:
        stop.set()
        pinger.join()
    assert list(reply.indices.shape) == [8, BIG // 8, BIG // 8]
    assert spy.count == 8 and spy.on_event_loop == 0
    assert len(result["lat"]) > 5  # answered while the request was in the server


def test_the_decoded_bytes_budget_makes_a_request_wait_and_its_deadline_applies(tiny_checkpoint):
    """Budget for one request of 2 images of 256^2: a second concurrent one waits its turn."""
    rt = CountingRuntime(EagerRuntime(tiny_checkpoint, device="cpu"))
    img = png(np.random.default_rng(1).integers(0, 256, (256, 256, 3), dtype=np.uint8))
    one_request = 2 * 256 * 256 * 3 * 2
    cfg = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1",
                       port=0, metrics_port=-1, max_batch_size=2, max_delay_ms=0, grace_s=2)
    with ServerThread(cfg, runtime=rt) as srv:
        engine = srv.server.state.engine
        engine.decoder.budget = ByteBudget(one_request)
        peak = []

        async def watch():
            while True:
                peak.append(engine.decoder.budget.in_use)
                await asyncio.sleep(0.001)

        watcher = asyncio.run_coroutine_threadsafe(watch(), srv.loop)
        with grpc.insecure_channel(srv.target) as ch:
            futures = [pb_grpc.TokenizerStub(ch).Encode.future(
                pb.EncodeRequest(encoded=pb.EncodedImages(images=[img, img])), timeout=60) for _ in range(4)]
            replies = [f.result() for f in futures]
            assert all(list(r.indices.shape) == [2, 32, 32] for r in replies)
            # the budget is held: a request with an already-passed deadline gives up waiting
            held = asyncio.run_coroutine_threadsafe(engine.decoder.budget.acquire(one_request), srv.loop)
            held.result(5)
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.TokenizerStub(ch).Encode(
                    pb.EncodeRequest(encoded=pb.EncodedImages(images=[img, img])), timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

            async def give_back():
                engine.decoder.budget.release(one_request)

            srv.call(give_back())
        watcher.cancel()
        assert max(peak) <= one_request
        assert engine.decoder.budget.in_use == 0


def test_probe_reads_the_displayed_size_without_decoding():
    rotated = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: displayed H and W swap
    Image.fromarray(np.zeros((16, 48, 3), np.uint8)).save(rotated, format="JPEG", exif=exif)
    header = imagelib.probe(rotated.getvalue(), ("PNG", "JPEG"))
    assert (header.height, header.width, header.format) == (48, 16, "JPEG")
    assert imagelib.load_rgb(rotated.getvalue()).shape[:2] == (48, 16)
    with pytest.raises(imagelib.ImageError, match="more than the limit 100"):
        imagelib.probe(rotated.getvalue(), max_pixels=100)


@settings(max_examples=40, deadline=None)
@given(limit=st.integers(10, 100), asks=st.lists(st.tuples(st.integers(1, 10), st.booleans()),
                                                 min_size=1, max_size=12))
def test_byte_budget_never_exceeds_its_limit_and_forgets_cancelled_waiters(limit, asks):
    async def scenario():
        budget = ByteBudget(limit)
        high = 0

        async def user(n: int, cancel: bool):
            nonlocal high
            task = asyncio.ensure_future(budget.acquire(n))
            if cancel:
                await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    return
                budget.release(n)  # granted before the cancel landed
                return
            await task
            high = max(high, budget.in_use)
            await asyncio.sleep(0.001)
            budget.release(n)

        await asyncio.wait_for(asyncio.gather(*(user(n, c) for n, c in asks)), 5)
        assert high <= limit
        assert budget.in_use == 0 and not budget._waiters

    asyncio.run(scenario())


# ---- item 2: a pixel budget per model call ----------------------------------------------------
def test_every_model_call_stays_inside_the_pixel_budget(served, photos):
    """Budget 3 tiles of 64x64: 16 concurrent one-image requests and one 8-image request."""
    _, rt, channel = served
    stub = pb_grpc.TokenizerStub(channel)
    from vqserve.serve.clients import tensor_msg

    rt.calls.clear()
    batch = np.resize(photos, (8, 64, 64, 3))
    futures = [stub.Encode.future(pb.EncodeRequest(images=tensor_msg(batch[i % 8][None])), timeout=60)
               for i in range(16)]
    big = stub.Encode(pb.EncodeRequest(images=tensor_msg(batch)), timeout=60)
    singles = [f.result() for f in futures]
    expected = rt.inner.encode(batch)
    got = np.frombuffer(big.indices.data, np.uint16).reshape(list(big.indices.shape))
    assert np.array_equal(got, expected)
    for i, r in enumerate(singles):
        assert np.array_equal(np.frombuffer(r.indices.data, np.uint16).reshape(1, 8, 8), expected[i % 8][None])
    # --micro-batch 4 shrinks to 3 under the budget: every call holds exactly 3 (padded)
    sizes = [shape[0] for method, shape in rt.calls if method == "encode"]
    assert set(sizes) == {3} and 24 <= sum(sizes) <= 24 + 2 * len(sizes), sizes
    # decode counts output pixels: a 8x8 grid is 64x64 pixels, so again 3 per call
    rt.calls.clear()
    stub.Decode(pb.DecodeRequest(indices=tensor_msg(expected)), timeout=60)
    assert [shape[0] for _, shape in rt.calls] == [3, 3, 3]


class Echo:
    """A runtime that returns its input: results must come back to the right request."""

    def __init__(self):
        self.calls: list[int] = []

    def encode(self, x):
        self.calls.append(x.shape[0])
        return x.copy()


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.integers(1, 6), min_size=1, max_size=10), budget_items=st.integers(1, 8))
def test_batcher_pixel_budget_property(rows, budget_items):
    async def scenario():
        echo = Echo()
        b = Batcher(echo, max_batch_size=6, max_delay_s=0.002, methods=("encode",),
                    max_batch_pixels=budget_items * 4 * 4)
        b.start()
        arrays = [np.full((n, 4, 4, 3), i, np.uint8) for i, n in enumerate(rows)]
        outs = await asyncio.gather(*(b.submit("encode", a) for a in arrays))
        await b.close()
        for a, o in zip(arrays, outs, strict=True):
            assert np.array_equal(a, o)
        assert max(echo.calls) <= budget_items
        assert sum(echo.calls) == sum(rows)

    asyncio.run(scenario())


def test_max_batch_pixels_flag_env_and_range(monkeypatch, capsys):
    from vqserve.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--max-batch-pixels", "2048x2048"])
    assert config_from_args(args).max_batch_pixels == 2048 * 2048
    monkeypatch.setenv("VQSERVE_MAX_BATCH_PIXELS", "5000000")
    assert config_from_args(parser.parse_args(["serve"])).max_batch_pixels == 5_000_000
    monkeypatch.delenv("VQSERVE_MAX_BATCH_PIXELS")
    assert config_from_args(parser.parse_args(["serve"])).max_batch_pixels is None  # auto
    with pytest.raises(SystemExit) as exit_:
        cli_main(["serve", "--max-batch-pixels", "-5"])
    assert exit_.value.code == 2
    assert "--max-batch-pixels: expected a positive pixel count" in capsys.readouterr().err
    monkeypatch.setenv("VQSERVE_MAX_BATCH_PIXELS", "lots")
    assert cli_main(["serve"]) == 2
    assert "VQSERVE_MAX_BATCH_PIXELS" in capsys.readouterr().err


def test_default_batch_pixels_fits_a_cpu():
    from vqserve.serve.engine.local import CPU_BATCH_PIXELS, default_batch_pixels

    assert default_batch_pixels("cpu", 1024 * 1024) <= CPU_BATCH_PIXELS
    assert default_batch_pixels("cpu", 8000 * 8000) == 8000 * 8000  # never below one image
