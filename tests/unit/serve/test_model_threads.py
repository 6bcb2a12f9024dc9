"""The batcher's model threads (serve/engine/model_threads.py): answers, errors, order of shutdown,
and no thread left behind."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import numpy as np
import pytest

from vqserve.serve.engine.batcher import Batcher
from vqserve.serve.engine.model_threads import ModelThreads


def _threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def _run_with(count: int, name: str, body) -> None:
    """``await body(threads)`` on a new event loop, ``threads`` closed however it ends."""
    async def main():
        threads = ModelThreads(count, name=name)
        try:
            await body(threads)
        finally:
            threads.close()
    asyncio.run(main())


def test_calls_run_in_the_named_threads_and_answer_on_the_loop():
    async def body(threads):
        names = await asyncio.gather(*[threads.run(lambda: threading.current_thread().name) for _ in range(8)])
        assert set(names) <= {"mt-answer_0", "mt-answer_1"}
        assert threading.current_thread() is threading.main_thread()  # awaited on the loop's thread
        assert await threads.run(lambda: 41 + 1) == 42
    _run_with(2, "mt-answer", body)
    assert not _threads_named("mt-answer")


def test_an_error_reaches_its_caller_and_the_thread_goes_on():
    async def body(threads):
        with pytest.raises(ZeroDivisionError):
            await threads.run(lambda: 1 / 0)
        assert await threads.run(lambda: "still here") == "still here"
    _run_with(1, "mt-error", body)


def test_two_threads_run_two_calls_at_once():
    """Two slots overlap two calls (each waits for the other to start)."""
    both = threading.Barrier(2, timeout=30)

    async def body(threads):
        assert await asyncio.gather(threads.run(both.wait), threads.run(both.wait)) in ([0, 1], [1, 0])
    _run_with(2, "mt-overlap", body)


def test_close_lets_queued_calls_finish_then_stops_the_threads():
    ran = []

    async def main():
        threads = ModelThreads(1, name="mt-close")
        futures = [threads.run(lambda i=i: (time.sleep(0.01), ran.append(i))) for i in range(5)]
        await asyncio.sleep(0)
        threads.close()  # waits for the five calls already queued
        assert ran == [0, 1, 2, 3, 4]
        await asyncio.gather(*futures)
        with pytest.raises(RuntimeError, match="closed"):
            threads.run(lambda: None)
    asyncio.run(main())
    assert not _threads_named("mt-close")


def test_a_cancelled_caller_does_not_break_the_answer():
    async def body(threads):
        gate = threading.Event()
        first = threads.run(gate.wait)
        first.cancel()
        gate.set()
        assert await threads.run(lambda: "next") == "next"  # the cancelled answer was dropped quietly
    _run_with(1, "mt-cancel", body)


def test_threads_start_with_the_first_call_and_stop_when_dropped():
    async def use_once():
        threads = ModelThreads(2, name="mt-dropped")
        assert not _threads_named("mt-dropped")  # none before a call
        await threads.run(lambda: None)
        assert len(_threads_named("mt-dropped")) == 2
    asyncio.run(use_once())  # never closed: the object goes with the loop's frame
    gc.collect()
    deadline = time.monotonic() + 30
    while _threads_named("mt-dropped") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _threads_named("mt-dropped")


class _Doubling:
    def encode(self, x):
        return x * 2

    def decode(self, x):
        return x


def test_a_closed_batcher_leaves_no_model_thread():
    async def main():
        batcher = Batcher(_Doubling(), max_delay_s=0)
        batcher.start()
        out = await asyncio.gather(*[batcher.submit("encode", np.full((1, 2), i)) for i in range(6)])
        assert [int(o[0, 0]) for o in out] == [0, 2, 4, 6, 8, 10]
        await batcher.close()
    asyncio.run(main())
    assert not _threads_named("vqserve-infer")
