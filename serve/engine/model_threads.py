"""The threads that run model calls for the batcher, answering into the event loop.

Why not ``loop.run_in_executor`` over a ``ThreadPoolExecutor``: each call there makes a
``concurrent.futures.Future``, chains it to an asyncio future with two callbacks, and
passes through the pool's work queue and its idle-thread semaphore. That is Python the
event loop's thread runs for every model call, under the GIL the model's threads need to
launch kernels. One round trip cost about 103 µs of CPU on a 2-vCPU Xeon against 75 µs
here (``loop.run_in_executor`` of a no-op vs :meth:`ModelThreads.run`), and the device
executor makes one per model call. Here a call is a tuple on a ``SimpleQueue`` (C code)
and its answer one ``call_soon_threadsafe`` that settles the caller's asyncio future.

The threads live as long as the batcher (named ``vqserve-infer_<i>``): thread-local state
a runtime keeps (CUDA streams and graphs, torch's inference mode) stays with them.
:func:`call_and_answer` (run a function in a thread, settle a future on the loop) is also
the body of ``run_in_daemon``'s one-off threads (serve/engine/planning.py).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import Callable

_STOP = None


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # cancelled by its caller meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def call_and_answer(fn: Callable[[], object], future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
    """In a worker thread: run ``fn()`` and settle ``future`` on ``loop`` with its result or
    its exception (nothing if the loop closed meanwhile: nobody waits for the answer)."""
    try:
        result, error = fn(), None
    except BaseException as exc:  # noqa: BLE001 - the awaiting coroutine gets it
        result, error = None, exc
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:
        pass


class ModelThreads:
    """``await threads.run(fn)``: ``fn()`` in one of ``count`` threads, its result or error.

    The threads start with the first call and hold only the queue, not this object: one
    dropped without :meth:`close` is collected and its threads stop."""

    def __init__(self, count: int, name: str = "vqserve-infer"):
        self.count, self.name = max(1, int(count)), name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def run(self, fn: Callable[[], object]) -> asyncio.Future:
        """A future of ``fn()``'s result, run in a model thread (call from the event loop)."""
        if self._closed:
            raise RuntimeError("the model threads are closed")
        if not self._threads:
            self._start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((fn, future, loop))
        return future

    def _start(self) -> None:
        self._threads = [threading.Thread(target=_work, args=(self._calls,), name=f"{self.name}_{i}", daemon=True)
                         for i in range(self.count)]
        for thread in self._threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._calls, self.count)

    def close(self) -> None:
        """Let the calls already queued finish, then stop the threads (waits for them)."""
        if self._closed:
            return
        self._closed = True
        if self._threads:
            self._finalizer.detach()
        _stop(self._calls, len(self._threads))
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()


def _work(calls: queue.SimpleQueue) -> None:
    while (call := calls.get()) is not _STOP:
        call_and_answer(*call)
        del call  # hold no array between calls


def _stop(calls: queue.SimpleQueue, count: int) -> None:
    for _ in range(count):
        calls.put(_STOP)
