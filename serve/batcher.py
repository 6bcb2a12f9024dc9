"""Dynamic batcher, generic over the ``Runtime`` interface.

Requests queue per (method, per-item shape, dtype). A batch runs when its queue holds
a full batch or when its oldest request has waited ``max_delay``; results are split back
per request. A full batch is ``max_batch_size`` items, fewer where ``max_batch_pixels``
says so: peak memory grows with the pixels in one model call (about 250 MB per megapixel
to encode with the default tokenizer in fp32), so a budget in pixels, not a count, is
what keeps a batch of large images inside the device. A single request larger than the
budget runs in chunks that fit it. One worker thread runs the model, so the event loop never
blocks on inference and batches form naturally while the model is busy.

- a full queue refuses at once (:class:`QueueFull`);
- a request that was cancelled, or whose deadline passed, is dropped before its batch
  runs (:class:`DeadlineExpired`) and never takes a seat in it;
- a failing batch of several requests is retried one request at a time, so only the
  request that breaks the model fails.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


class QueueFull(Exception):
    """The batcher's queue has no room; the client should back off (RESOURCE_EXHAUSTED)."""


class DeadlineExpired(Exception):
    """The request's deadline passed before its batch could run (DEADLINE_EXCEEDED)."""


class BatcherClosed(Exception):
    """The batcher is draining or closed and takes no new work (UNAVAILABLE)."""


@dataclass(eq=False)
class _Item:
    array: np.ndarray
    future: asyncio.Future
    enqueued: float
    deadline: float | None  # time.monotonic() value, or None

    @property
    def rows(self) -> int:
        return int(self.array.shape[0])


@dataclass
class BatchStats:
    """What one batch did, for metrics: the observer gets one per model call."""

    method: str
    size: int                 # items (images) in the batch
    requests: int
    queue_waits: list[float] = field(default_factory=list)  # seconds, per request
    inference_s: float = 0.0
    ok: bool = True


class Batcher:
    """``await batcher.submit("encode", array)`` -> the runtime's output for ``array``.

    ``runtime`` is anything with ``encode``/``decode`` methods taking and returning numpy
    batches (the ``Runtime`` protocol). ``max_delay_s=0`` and ``max_batch_size=1`` turn
    batching off. ``max_queue`` bounds the queued items (images), over all queues.
    """

    def __init__(self, runtime, max_batch_size: int = 32, max_delay_s: float = 0.005,
                 max_queue: int = 1024, observer: Callable[[BatchStats], None] | None = None,
                 methods: tuple[str, ...] = ("encode", "decode"), max_batch_pixels: int | None = None,
                 pixels_per_item: Callable[[str, tuple[int, ...]], int] | None = None):
        """``max_batch_pixels``: the most pixels one model call may hold (None: no limit);
        ``pixels_per_item(method, item_shape)``: what one item costs (default: the product
        of its first two dimensions, i.e. H*W of an image)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay must be >= 0, got {max_delay_s}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if max_batch_pixels is not None and max_batch_pixels < 1:
            raise ValueError(f"max_batch_pixels must be >= 1, got {max_batch_pixels}")
        self.max_batch_pixels = max_batch_pixels
        self._pixels_per_item = pixels_per_item or _image_pixels
        self.runtime = runtime
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.max_queue = max_queue
        self.observer = observer
        self._fns = {m: getattr(runtime, m) for m in methods}
        self._queues: dict[tuple, collections.deque[_Item]] = {}
        self._queued_rows = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vqserve-infer")
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._accepting = True

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler on the running event loop."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._schedule(), name="vqserve-batcher")

    async def close(self) -> None:
        """Stop taking work, run everything already queued, then stop the worker."""
        self._accepting = False
        if self._task is not None:
            self._wakeup.set()
            await self._task
            self._task = None
        self._executor.shutdown(wait=True)

    @property
    def queued(self) -> int:
        return self._queued_rows

    def rows_per_call(self, method: str, item_shape: tuple[int, ...]) -> int:
        """How many items of this shape one model call may hold: the count limit, lowered
        by the pixel budget (never below one)."""
        if self.max_batch_pixels is None:
            return self.max_batch_size
        per_item = max(1, self._pixels_per_item(method, item_shape))
        return max(1, min(self.max_batch_size, self.max_batch_pixels // per_item))

    # ---- submit ---------------------------------------------------------------------
    async def submit(self, method: str, array: np.ndarray, deadline: float | None = None) -> np.ndarray:
        """Queue ``array`` (a batch, axis 0) for ``method``; ``deadline`` is a monotonic time."""
        if method not in self._fns:
            raise ValueError(f"unknown method {method!r}; expected one of {sorted(self._fns)}")
        if not self._accepting or self._task is None:
            raise BatcherClosed("the server is draining and takes no new requests")
        rows = int(array.shape[0])
        if rows > self.max_batch_size:
            raise ValueError(f"a request of {rows} items exceeds max-batch-size {self.max_batch_size}")
        if self._queued_rows + rows > self.max_queue:
            raise QueueFull(
                f"queue full: {self._queued_rows} items queued, limit {self.max_queue}; retry with backoff"
            )
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExpired("the deadline passed before the request was queued")
        key = (method, tuple(array.shape[1:]), array.dtype.str)
        item = _Item(array, asyncio.get_running_loop().create_future(), time.monotonic(), deadline)
        self._queues.setdefault(key, collections.deque()).append(item)
        self._queued_rows += rows
        self._wakeup.set()
        # Cancelling the caller cancels the future; the scheduler then skips the item.
        return await item.future

    # ---- scheduling -----------------------------------------------------------------
    def _ready(self, now: float) -> tuple | None:
        """The key of the queue to run now (oldest head first), or None."""
        best, best_t = None, None
        for key, q in self._queues.items():
            if not q:
                continue
            rows = sum(it.rows for it in q)
            head = q[0].enqueued
            if rows >= self.rows_per_call(key[0], key[1]) or now - head >= self.max_delay_s or not self._accepting:
                if best_t is None or head < best_t:
                    best, best_t = key, head
        return best

    def _next_due(self, now: float) -> float | None:
        heads = [q[0].enqueued for q in self._queues.values() if q]
        if not heads:
            return None
        return max(0.0, min(heads) + self.max_delay_s - now)

    def _take(self, key: tuple, now: float) -> list[_Item]:
        q = self._queues[key]
        cap = self.rows_per_call(key[0], key[1])
        batch: list[_Item] = []
        rows = 0
        while q and (not batch or rows + q[0].rows <= cap):
            item = q.popleft()
            self._queued_rows -= item.rows
            if item.future.done():  # cancelled by the client
                continue
            if item.deadline is not None and now >= item.deadline:
                item.future.set_exception(DeadlineExpired("the deadline passed while the request was queued"))
                continue
            batch.append(item)
            rows += item.rows
        if not q:
            del self._queues[key]
        return batch

    async def _schedule(self) -> None:
        while True:
            now = time.monotonic()
            key = self._ready(now)
            if key is None:
                if not self._accepting and not any(self._queues.values()):
                    return
                self._wakeup.clear()
                timeout = self._next_due(now)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                continue
            batch = self._take(key, now)
            if batch:
                await self._execute(key[0], batch)

    async def _execute(self, method: str, batch: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        fn = self._fns[method]
        start = time.monotonic()
        waits = [start - it.enqueued for it in batch]
        arrays = [it.array for it in batch]
        stacked = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        step = self.rows_per_call(method, tuple(stacked.shape[1:]))

        def call():
            t0 = time.perf_counter()
            if stacked.shape[0] <= step:
                out = fn(stacked)
            else:  # one request over the pixel budget: run it in chunks that fit
                out = np.concatenate([np.asarray(fn(stacked[i:i + step]))
                                      for i in range(0, stacked.shape[0], step)])
            return out, time.perf_counter() - t0

        try:
            out, infer_s = await loop.run_in_executor(self._executor, call)
        except Exception as exc:  # noqa: BLE001 - the runtime's error goes to its requests
            self._observe(BatchStats(method, stacked.shape[0], len(batch), waits, time.monotonic() - start, ok=False))
            if len(batch) == 1:
                if not batch[0].future.done():
                    batch[0].future.set_exception(exc)
                return
            # Isolate the culprit: run each request on its own.
            for item in batch:
                if not item.future.done():
                    await self._execute(method, [item])
            return
        self._observe(BatchStats(method, stacked.shape[0], len(batch), waits, infer_s))
        offset = 0
        for item in batch:
            part = out[offset: offset + item.rows]
            offset += item.rows
            if not item.future.done():
                item.future.set_result(part)

    def _observe(self, stats: BatchStats) -> None:
        if self.observer is not None:
            try:
                self.observer(stats)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                pass


def _image_pixels(method: str, item_shape: tuple[int, ...]) -> int:
    return int(np.prod(item_shape[:2])) if len(item_shape) >= 2 else 1
