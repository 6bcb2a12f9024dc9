"""Serving building blocks without the network: wire codec, dynamic batcher, metrics."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vqserve.serve.api import codec
from vqserve.serve.engine.batcher import Batcher, DeadlineExpired, QueueFull
from vqserve.serve.metrics import CodebookUsage, Metrics


# ---- codec ------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["uint8", "uint16", "uint32", "int32", "int64", "float32"]),
       st.lists(st.integers(0, 5), min_size=1, max_size=4))
def test_raw_tensor_round_trip(dtype, shape):
    rng = np.random.default_rng(0)
    arr = (rng.random(shape) * 100).astype(dtype)
    s, d, data = codec.array_to_bytes(arr)
    back = codec.array_from_bytes(s, d, data, "x")
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_raw_bytes_are_little_endian():
    s, d, data = codec.array_to_bytes(np.array([1, 258], dtype=">u2"))
    assert (d, data) == ("uint16", b"\x01\x00\x02\x01")


@pytest.mark.parametrize("shape,dtype,data,match", [
    ([2, 2], "uint8", b"abc", r"x\.data: must hold .* = 4 bytes .* got 3"),
    ([2], "complex64", b"", r"x\.dtype: must be one of"),
    ([], "uint8", b"", r"x\.shape: must not be empty"),
    ([-1, 2], "uint8", b"", r"x\.shape: dimensions must be non-negative"),
    ([1] * 9, "uint8", b"a", r"x\.shape: rank must be at most 8"),
    # an empty array whose other dimensions no array can address: 0 bytes match prod(shape),
    # and numpy's own "array is too big" reached clients as the message
    ([0, 2**61, 2**61], "int64", b"", r"x\.shape: dimensions \[0, 2305843009213693952, 2305843009213693952\] "
                                      r"address more than 2\*\*63 bytes"),
    ([0, 2**40, 2**40, 3], "uint8", b"", r"x\.shape: dimensions .* address more than 2\*\*63 bytes"),
])
def test_raw_tensor_rejects_with_field_and_rule(shape, dtype, data, match):
    with pytest.raises(codec.BadInput, match=match):
        codec.array_from_bytes(shape, dtype, data, "x")


def test_png_and_jpeg_decode(photos):
    from PIL import Image

    pngs = codec.encode_png(photos)
    np.testing.assert_array_equal(codec.decode_images(pngs, "f", 1 << 20), photos)
    buf = io.BytesIO()
    Image.fromarray(photos[0]).save(buf, format="JPEG", quality=95)
    out = codec.decode_images([buf.getvalue()], "f", 1 << 20)
    assert out.shape == (1, 64, 64, 3) and np.abs(out.astype(int) - photos[:1]).mean() < 8


def test_image_rules(photos):
    with pytest.raises(codec.BadInput, match=r"f\[0\]: is not a decodable PNG or JPEG"):
        codec.decode_images([b"not an image"], "f", 1 << 20)
    with pytest.raises(codec.BadInput, match=r"f: is an empty batch"):
        codec.decode_images([], "f", 1 << 20)
    with pytest.raises(codec.BadInput, match=r"more than the limit 100"):
        codec.decode_images(codec.encode_png(photos[:1]), "f", 100)
    small = codec.encode_png(photos[:1, :32, :32])
    with pytest.raises(codec.BadInput, match=r"f\[1\]: has size 32x32.*one request holds one size"):
        codec.decode_images(codec.encode_png(photos[:1]) + small, "f", 1 << 20)
    truncated = codec.encode_png(photos[:1])[0][:200]
    with pytest.raises(codec.BadInput, match=r"f\[0\]"):
        codec.decode_images([truncated], "f", 1 << 20)


# ---- batcher ----------------------------------------------------------------------------
class RecordingRuntime:
    """A Runtime that doubles its input, records each batch, can be slow, and fails on 255."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.batches: list[int] = []
        self.lock = threading.Lock()

    def encode(self, x):
        time.sleep(self.delay)
        with self.lock:
            self.batches.append(len(x))
        if (x == 255).any():
            raise RuntimeError("poisoned input")
        return x.astype(np.int64) * 2

    decode = encode


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_share_batches_and_split_back():
    rt = RecordingRuntime(delay=0.01)

    async def main():
        b = Batcher(rt, max_batch_size=8, max_delay_s=0.05)
        b.start()
        xs = [np.full((1, 2), i, dtype=np.uint8) for i in range(16)]
        outs = await asyncio.gather(*(b.submit("encode", x) for x in xs))
        await b.close()
        return xs, outs

    xs, outs = run(main())
    for x, o in zip(xs, outs, strict=True):
        np.testing.assert_array_equal(o, x.astype(np.int64) * 2)
    assert max(rt.batches) == 8 and sum(rt.batches) == 16


def test_queues_are_per_shape():
    rt = RecordingRuntime()

    async def main():
        b = Batcher(rt, max_batch_size=8, max_delay_s=0.02)
        b.start()
        outs = await asyncio.gather(b.submit("encode", np.zeros((1, 2), np.uint8)),
                                    b.submit("encode", np.zeros((1, 3), np.uint8)))
        await b.close()
        return outs

    a, c = run(main())
    assert a.shape == (1, 2) and c.shape == (1, 3) and rt.batches == [1, 1]


def test_full_queue_refuses_at_once():
    rt = RecordingRuntime(delay=0.2)

    async def main():
        b = Batcher(rt, max_batch_size=1, max_delay_s=0.0, max_queue=2)
        b.start()
        first = asyncio.ensure_future(b.submit("encode", np.zeros((1, 1), np.uint8)))
        await asyncio.sleep(0.05)  # first is running; the queue is empty again
        queued = [asyncio.ensure_future(b.submit("encode", np.zeros((1, 1), np.uint8))) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="queue full"):
            await b.submit("encode", np.zeros((1, 1), np.uint8))
        assert not first.done(), "refused at once, not after waiting for room"
        await asyncio.gather(first, *queued)
        await b.close()

    run(main())


def test_expired_and_cancelled_requests_never_run():
    rt = RecordingRuntime(delay=0.2)

    async def main():
        b = Batcher(rt, max_batch_size=4, max_delay_s=0.0)
        b.start()
        busy = asyncio.ensure_future(b.submit("encode", np.zeros((1, 1), np.uint8)))
        await asyncio.sleep(0.05)
        expiring = asyncio.ensure_future(
            b.submit("encode", np.ones((3, 1), np.uint8), deadline=time.monotonic() + 0.05))
        cancelled = asyncio.ensure_future(b.submit("encode", np.ones((2, 1), np.uint8)))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        ok = asyncio.ensure_future(b.submit("encode", np.full((1, 1), 7, np.uint8)))
        await busy
        with pytest.raises(DeadlineExpired):
            await expiring
        out = await ok
        await b.close()
        return out

    out = run(main())
    assert out.tolist() == [[14]]
    assert rt.batches == [1, 1], "the expired (3) and cancelled (2) items must not have run"


def test_a_failing_request_fails_alone():
    rt = RecordingRuntime()

    async def main():
        b = Batcher(rt, max_batch_size=8, max_delay_s=0.05)
        b.start()
        results = await asyncio.gather(
            b.submit("encode", np.full((1, 1), 1, np.uint8)),
            b.submit("encode", np.full((1, 1), 255, np.uint8)),
            b.submit("encode", np.full((1, 1), 3, np.uint8)),
            return_exceptions=True)
        after = await b.submit("encode", np.full((1, 1), 4, np.uint8))
        await b.close()
        return results, after

    (a, bad, c), after = run(main())
    assert a.tolist() == [[2]] and c.tolist() == [[6]] and after.tolist() == [[8]]
    assert isinstance(bad, RuntimeError)


def test_close_runs_everything_already_queued():
    rt = RecordingRuntime(delay=0.05)

    async def main():
        b = Batcher(rt, max_batch_size=2, max_delay_s=10.0)
        b.start()
        futs = [asyncio.ensure_future(b.submit("encode", np.full((1, 1), i, np.uint8))) for i in range(5)]
        await asyncio.sleep(0)
        await b.close()
        return await asyncio.gather(*futs)

    outs = run(main())
    assert [o.item() for o in outs] == [0, 2, 4, 6, 8]


# ---- metrics ----------------------------------------------------------------------------
def test_codebook_usage_window_and_entropy():
    u = CodebookUsage(16, window=64)
    u.add(np.arange(16))
    s = u.stats()
    assert s["usage"] == 1.0 and abs(s["entropy_bits"] - 4.0) < 1e-9 and s["tokens"] == 16
    for _ in range(4):
        u.add(np.zeros(16, dtype=np.int64))  # collapse onto code 0 pushes the old tokens out
    s = u.stats()
    assert s["usage"] == 1 / 16 and s["entropy_bits"] == 0.0 and s["tokens"] == 64


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 40), chunks=st.lists(st.lists(st.integers(-3, 20), max_size=50), max_size=12))
def test_codebook_window_counts_exactly_the_last_window_tokens(window, chunks):
    """The ring buffer's counts equal a bincount of the last ``window`` valid tokens."""
    u = CodebookUsage(16, window=window)
    seen: list[int] = []
    for chunk in chunks:
        arr = np.asarray(chunk, dtype=np.int64)
        u.add(arr)
        seen += [int(v) for v in arr[-window:] if 0 <= v < 16] if arr.size > window else \
                [int(v) for v in arr if 0 <= v < 16]
    last = seen[-window:] if seen else []
    u.flush()  # codes are counted in bulk (per 65,536 tokens or per scrape)
    assert u._counts.tolist() == np.bincount(np.asarray(last, dtype=np.int64), minlength=16).tolist()
    assert u.stats()["tokens"] == len(last)


def test_metrics_exposition_names():
    m = Metrics(codebook_size=10)
    m.record_codes("encode", np.arange(5))
    text = m.exposition().decode()
    for name in ("vqserve_request_latency_seconds", "vqserve_queue_wait_seconds", "vqserve_inference_seconds",
                 "vqserve_batch_size", "vqserve_requests_in_flight", "vqserve_items_total",
                 "vqserve_errors_total", "vqserve_codebook_usage_ratio", "vqserve_codebook_entropy_bits"):
        assert name in text, name
    assert 'vqserve_codebook_usage_ratio{method="encode"} 0.5' in text
