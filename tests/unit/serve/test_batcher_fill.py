"""Short padded calls on a shared device wait for the device (serve/engine/batcher.py, "Filling
padded calls on a shared device"): the stand-in accelerator ``synthetic:N`` with a gate on
its calls, so what runs while a call is in flight is seen, not timed."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time

import numpy as np

from tests.helpers import CountingRuntime, staggered_clients
from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime
from vqserve.export.runtimes.synthetic import SyntheticRuntime
from vqserve.serve.engine.batcher import Batcher


class GatedDevice(SyntheticRuntime):
    """The stand-in device whose first call waits for ``release``; records each call's rows."""

    def __init__(self):
        super().__init__("synthetic:0")
        self.release = threading.Event()
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def encode(self, images):
        with self.lock:
            self.calls.append(len(images))
            first = len(self.calls) == 1
        if first:
            self.release.wait(30)
        return super().encode(images)


def _image(value: int) -> np.ndarray:
    return np.full((1, 8, 8, 3), value, np.uint8)


async def _until(predicate, timeout: float = 20.0) -> None:
    stop = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < stop, "timed out"
        await asyncio.sleep(0.005)


def _scenario(plan: ExecutionPlan, info_device: str | None = None):
    """A full call of 4 in flight (gated), then three single images, a pause, and a fourth:
    which calls started while the first was still running?"""
    inner = GatedDevice()
    runtime = PlannedRuntime(inner, plan)
    if info_device:  # the same stand-in presented as another kind of device
        runtime.info = dataclasses.replace(runtime.info, device=info_device)

    async def main():
        b = Batcher(runtime, max_batch_size=16, max_delay_s=0.0)
        b.start()
        first = b.enqueue("encode", np.concatenate([_image(i) for i in range(4)]))
        await _until(lambda: len(inner.calls) == 1)
        singles = [b.enqueue("encode", _image(10 + i)) for i in range(3)]
        await asyncio.sleep(0.2)
        during_short = list(inner.calls)
        singles.append(b.enqueue("encode", _image(13)))
        await asyncio.sleep(0.2)
        during_full = list(inner.calls)
        inner.release.set()
        outs = await asyncio.gather(first, *singles)
        await b.close()
        return during_short, during_full, outs, list(inner.calls)

    return asyncio.run(main())


def test_short_padded_calls_wait_while_the_shared_device_is_busy():
    during_short, during_full, outs, calls = _scenario(ExecutionPlan(4, 2))
    assert during_short == [4], "three images padded to a call of 4 must not start beside a running call"
    assert during_full == [4, 4], "a full call starts on the free slot at once"
    assert calls == [4, 4]
    inner = SyntheticRuntime("synthetic:0")
    for i, out in enumerate(outs[1:]):
        np.testing.assert_array_equal(out, inner.encode(_image(10 + i)))


def test_on_a_cpu_each_slot_is_a_core_and_short_calls_start_at_once():
    during_short, _, _, calls = _scenario(ExecutionPlan(4, 2), info_device="cpu")
    assert during_short == [4, 4], "on a CPU the second slot is a core of its own: no waiting"
    assert calls == [4, 4, 4], "three padded, then the fourth padded alone"


def test_bucketed_short_calls_cost_their_bucket_and_start_at_once():
    during_short, _, _, calls = _scenario(ExecutionPlan(4, 2, bucketed=("encode",)))
    assert during_short == [4, 4], "a bucketed short call costs its own rows: no reason to wait"


def test_closed_loop_clients_fill_padded_calls():
    """16 closed-loop clients at micro-batch 8, two slots: without the fill rule they split
    into groups whose calls are padded; with it, calls are full (what matters on a GPU)."""
    runtime = PlannedRuntime(SyntheticRuntime("synthetic:20000"), ExecutionPlan(8, 2))  # 0.16 ms per call of 8 images of 8x8
    sizes = collections.Counter()

    async def main():
        b = Batcher(runtime, max_batch_size=16, max_delay_s=0.0, observer=lambda s: sizes.update([s.size]))
        b.start()

        async def client(k: int) -> None:
            for _ in range(6):
                await b.submit("encode", _image(k))
                await asyncio.sleep(0.001 * (k % 3))

        await asyncio.gather(*(client(k) for k in range(16)))
        await b.close()

    asyncio.run(main())
    full = sizes[8] * 8
    assert full >= 0.75 * sum(n * c for n, c in sizes.items()), f"call sizes {dict(sizes)}"


def test_a_lone_request_on_an_idle_device_is_answered():
    runtime = PlannedRuntime(SyntheticRuntime("synthetic:0"), ExecutionPlan(8, 2))

    async def main():
        b = Batcher(runtime, max_batch_size=16, max_delay_s=0.0)
        b.start()
        outs = [await asyncio.wait_for(b.submit("encode", _image(k)), 20) for k in range(3)]
        await b.close()
        return outs

    assert len(asyncio.run(main())) == 3


def test_a_padded_call_waits_for_every_client_the_last_call_answered():
    """Eight closed-loop clients at micro-batch 8 whose next requests come back 6 ms apart
    (further apart than the 4 ms pause that used to start a call): each call waits for all
    eight, so none is padded. Before, the first to come back went alone (the device bound
    on the GPU: 64 one-image clients at micro-batch 64 of ``synthetic:4000`` served 0.46-0.57
    of the device, 0.82 with full calls)."""
    inner = CountingRuntime(SyntheticRuntime("synthetic:600000"))  # 0.3 s per call of 8 64x64s
    asyncio.run(_staggered_clients(PlannedRuntime(inner, ExecutionPlan(8, 2))))
    assert inner.sizes == [8, 8, 8], f"call sizes {inner.sizes}"


async def _staggered_clients(runtime, lone_first: bool = False) -> None:
    """Eight closed-loop clients of one 64x64 image each through a batcher of ``runtime``,
    three requests each (:func:`tests.helpers.staggered_clients`); ``lone_first``: one
    request alone on the idle device before them."""
    images = np.zeros((8, 64, 64, 3), np.uint8) + np.arange(8, dtype=np.uint8)[:, None, None, None]
    b = Batcher(runtime, max_batch_size=16, max_delay_s=0.0)
    b.start()
    if lone_first:
        await b.submit("encode", images[:1])
    await staggered_clients(b.submit, images)
    await b.close()


def test_clients_that_leave_cost_one_wait_and_the_next_call_waits_for_those_left():
    """Eight clients, then one: the call after seven left waits for them one call time (the
    device's idle bound), runs the one that came back, and the next calls wait for one."""
    runtime = PlannedRuntime(SyntheticRuntime("synthetic:20000"), ExecutionPlan(8, 2))  # 0.16 ms per call of 8
    sizes: list[int] = []

    async def main():
        b = Batcher(runtime, max_batch_size=16, max_delay_s=0.0, observer=lambda s: sizes.append(s.size))
        b.start()

        async def client(k: int) -> None:
            for _ in range(5 if k == 0 else 2):
                await asyncio.wait_for(b.submit("encode", _image(k)), 20)

        await asyncio.gather(*(client(k) for k in range(8)))
        await b.close()

    asyncio.run(main())
    assert sizes == [8, 8, 1, 1, 1], f"call sizes {sizes}"


class SlowFirstCall(SyntheticRuntime):
    """The stand-in device whose first call takes ``slow_s`` (a warm-up, a capture)."""

    def __init__(self, slow_s: float):
        super().__init__("synthetic:0")
        self.slow_s, self.calls = slow_s, 0

    def encode(self, images):
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.slow_s)
        return super().encode(images)


def test_one_slow_call_does_not_make_later_waits_for_clients_long():
    """The wait for clients that do not come back is bounded by the last call's time where
    it is shorter than the average: after a 2 s first call and a fast second one, the one
    client left is answered at once, not after most of 2 s."""
    slow_s = 2.0
    runtime = PlannedRuntime(SlowFirstCall(slow_s), ExecutionPlan(8, 2))
    took: list[float] = []

    async def main():
        b = Batcher(runtime, max_batch_size=16, max_delay_s=0.0)
        b.start()

        async def client(k: int) -> None:
            for _ in range(3 if k == 0 else 2):
                t0 = time.monotonic()
                await asyncio.wait_for(b.submit("encode", _image(k)), 20)
                if k == 0:
                    took.append(time.monotonic() - t0)

        await asyncio.gather(*(client(k) for k in range(8)))
        await b.close()

    asyncio.run(main())
    assert took[0] >= slow_s and took[2] < slow_s / 2, f"answers took {took} s"


def test_the_tail_of_a_request_split_over_calls_does_not_wait_for_clients():
    """12 images at micro-batch 8: the first call answers nobody (its request goes on), so
    the call of the last 4 has no client to wait for and follows at once, not after the
    device idled for a call (0.5 s here)."""
    inner = CountingRuntime(SyntheticRuntime("synthetic:1000000"))  # 1 s per 256x256 image: 0.5 s per call of 8 64x64s
    runtime = PlannedRuntime(inner, ExecutionPlan(8, 2))
    images = np.zeros((12, 64, 64, 3), np.uint8) + np.arange(12, dtype=np.uint8)[:, None, None, None]

    async def main():
        b = Batcher(runtime, max_batch_size=16, max_delay_s=0.0)
        b.start()
        out = await asyncio.wait_for(b.submit("encode", images), 20)
        await b.close()
        return out

    np.testing.assert_array_equal(asyncio.run(main()), SyntheticRuntime("synthetic:0").encode(images))
    (_, first_end), (second_start, _) = inner.spans
    assert second_start - first_end < 0.25, f"the device idled {second_start - first_end:.3f} s between the calls"


def test_a_lone_image_waits_too_when_the_clients_of_the_last_call_are_on_their_way():
    """A plan that runs a lone image unpadded: alone on an idle device it goes at once, but the
    first of eight answered clients to come back waits for the other seven instead of taking
    the device for a call of its own (which split every later call: 8, 1, 7, 1, 7)."""
    inner = CountingRuntime(SyntheticRuntime("synthetic:600000"))  # 0.3 s per call of 8 64x64s
    asyncio.run(_staggered_clients(PlannedRuntime(inner, ExecutionPlan(8, 2, lone_unpadded=("encode",))),
                                   lone_first=True))
    assert inner.sizes == [1, 8, 8, 8], f"call sizes {inner.sizes}"
