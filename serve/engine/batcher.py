"""Dynamic batcher, generic over the ``Runtime`` interface, run by the execution plan.

Requests queue per (method, per-item shape, dtype). A model call takes up to one call's
rows from the queue whose head is oldest, splitting a request across calls when it is
larger, and results are put back together per request. How many rows a call holds and how
many calls run at once come from the runtime's execution plan when it has one (a
``PlannedRuntime``: ``micro_batch_for(method, shape)`` rows per call — measured per image
size by ``--plan auto`` — and ``plan.workers`` calls at once); otherwise one call at a time
of up to ``max_batch_size`` items, fewer where ``max_batch_pixels`` says so (peak memory
grows with the pixels in one model call, about 250 MB per megapixel to encode with the
default tokenizer in fp32).

When a call may start: as soon as a model slot is free and its queue holds a full call, or
its oldest request has waited ``max_delay``. The server's default delay is 0: on a CPU each
slot is a core of its own, so waiting can only add latency at low load, and under load calls
fill by themselves because every slot is busy while requests arrive. Each free slot takes
work as it frees, so closed-loop clients do not settle into alternating small and large
batches (one worker that took everything queued each time did).

**Filling padded calls on a shared device.** Where the slots share one device (CUDA, or its
stand-in ``synthetic:N``) and the plan pads a short call to the whole micro-batch (no
buckets), a short call costs the device a full one. Started at once, closed-loop clients
split into groups that never merge again, each padded: 64 one-image clients at micro-batch
64 on an H100 got 0.18 of bf16's in-process rate, and 16 clients at micro-batch 16 on
``synthetic:2000`` 0.33 of its capacity. So there a short call starts only when no call is
running, and then once the clients the queue's last call answered are back: the rows of
the requests it finished plus those queued when it ended, as many as a call holds
(closed-loop clients send their next request on the answer), or once the device has been
idle for one call time (clients that left; the shorter of the queue's average and its last
call, so one slow call such as a warm-up does not stretch the waits after it). A lone
request the plan runs unpadded goes at once only when no such clients are on their way. A
queue with no call yet waits for arrivals to pause for ``settle`` (a quarter of its call
time, 0.5 to 4 ms) instead. A full call starts whenever a slot frees. The pause alone,
the rule before, started a call on the first answered clients to come back, and the rest
waited for the next: 64 one-image clients at micro-batch 64 of ``synthetic:4000`` (2 cores)
got calls of 32-42 images, 0.46-0.57 of the device; waiting for them, calls of 64 and 0.82.

- a full queue refuses at once (:class:`QueueFull`);
- a request leaves the queue the moment it is cancelled or its deadline passes
  (:class:`DeadlineExpired`, by a timer of its own: no free model slot is needed for it),
  with every row of it not yet handed to a model call, however many of its calls already
  ran; its rows stop counting against ``max_queue`` at once. Only a call already running
  finishes (a model call cannot be interrupted), and its answer is dropped;
- a failing call holding several requests is retried one request at a time, so only the
  request that breaks the model fails; except on the device's two failures that are no
  request's fault (``serve/engine/device_faults.py``): out of memory fails the call's
  requests with RESOURCE_EXHAUSTED, and a poisoned CUDA context ends the process.

**Progress**, for health (``serve/liveness.py``): :meth:`Batcher.stalled_for` is how long
work has waited (requests queued or a call running) with no model call finishing, and
:attr:`Batcher.slowest_call_s` the longest call so far, which stretches the bound.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vqserve.serve.engine import device_faults
from vqserve.serve.engine.model_threads import ModelThreads

# the batcher's errors, at home in serve/error_codes.py with their status codes; named here too
from vqserve.serve.error_codes import BatcherClosed, DeadlineExpired, QueueFull

_MAX_KEYS_REMEMBERED = 256  # (method, shape, dtype) queues whose call time and last call are kept


@dataclass(eq=False)
class _Item:
    array: np.ndarray
    future: asyncio.Future
    enqueued: float
    deadline: float | None  # time.monotonic() value, or None
    key: tuple = ()         # its queue
    taken: int = 0          # rows handed to model calls so far
    answered: int = 0
    parts: list[tuple[int, np.ndarray]] = field(default_factory=list)
    queued: bool = False    # in its queue (rows not yet taken count in Batcher.queued)
    timer: asyncio.TimerHandle | None = None  # expires it at its deadline

    @property
    def rows(self) -> int:
        return int(self.array.shape[0])

    @property
    def left(self) -> int:
        return self.rows - self.taken

    def deliver(self, start: int, out: np.ndarray) -> None:
        """One call's rows of this request; the request completes with its last rows."""
        if self.future.done():
            return
        self.parts.append((start, out))
        self.answered += int(out.shape[0])
        if self.answered == self.rows:
            self.parts.sort(key=lambda p: p[0])
            self.future.set_result(self.parts[0][1] if len(self.parts) == 1
                                   else np.concatenate([p for _, p in self.parts]))


Segment = tuple[_Item, int, int]  # rows [start, stop) of one request in one call


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
    batches (the ``Runtime`` protocol); a ``PlannedRuntime`` also sets the rows per call and
    the calls at once (see the module docstring). ``max_delay_s=0`` and ``max_batch_size=1``
    turn batching off. ``max_queue`` bounds the queued items (images), over all queues.
    """

    def __init__(self, runtime, max_batch_size: int = 32, max_delay_s: float = 0.005,
                 max_queue: int = 1024, observer: Callable[[BatchStats], None] | None = None,
                 methods: tuple[str, ...] = ("encode", "decode"), max_batch_pixels: int | None = None,
                 pixels_per_item: Callable[[str, tuple[int, ...]], int] | None = None,
                 on_poisoned: Callable[[BaseException], None] = device_faults.exit_poisoned):
        """``max_batch_pixels``: the most pixels one model call may hold (None: no limit);
        ``pixels_per_item(method, item_shape)``: what one item costs (default: the product
        of its first two dimensions, i.e. H*W of an image). ``on_poisoned(exc)``: a call
        failed with an error after which the device runs nothing more (default: log one
        line and exit, ``serve/engine/device_faults.py``)."""
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
        self.on_poisoned = on_poisoned
        self._fns = {m: getattr(runtime, m) for m in methods}
        plan = getattr(runtime, "plan", None)
        self._micro_batch_for = getattr(runtime, "micro_batch_for", None) if plan is not None else None
        self.slots = int(plan.workers) if plan is not None else 1
        self._free = self.slots
        self._running: set[asyncio.Task] = set()
        self._queues: dict[tuple, collections.deque[_Item]] = {}
        self._queued_rows = 0
        self._threads = ModelThreads(self.slots)
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._accepting = True
        # filling padded calls (module docstring): only where the slots share one device
        device = str(getattr(getattr(runtime, "info", None), "device", ""))
        self._fill_plan = plan if plan is not None and device.startswith(("cuda", "synthetic")) else None
        self._call_s: dict[tuple, tuple[float, float]] = {}  # each queue's call time: moving average, last
        self._last_event = 0.0  # last arrival or finished call (monotonic)
        self._idle_since = 0.0  # when the last running call finished
        self._expected: dict[tuple, int] = {}  # rows a queue's next padded call waits for (its last call's + queued)
        self._progress_at = time.monotonic()  # the last call that finished, or work arriving at an idle batcher
        self.slowest_call_s = 0.0  # the longest model call so far (ok or failed)

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler on the running event loop."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._schedule(), name="vqserve-batcher")

    async def close(self) -> None:
        """Stop taking work, run everything already queued, then stop the workers."""
        self._accepting = False
        if self._task is not None:
            self._wakeup.set()
            await self._task
            self._task = None
        self._threads.close()

    @property
    def queued(self) -> int:
        return self._queued_rows

    @property
    def running_calls(self) -> int:
        return len(self._running)

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds that work has waited (rows queued or a call running) while no model call
        finished; 0 when there is no work."""
        if not self._queued_rows and not self._running:
            return 0.0
        return (time.monotonic() if now is None else now) - self._progress_at

    def fills_calls(self, method: str) -> bool:
        """Whether a short call of ``method`` waits for more requests to fill it (the
        padded-call rule above): whoever sends requests here should then not hold them back."""
        return self._fill_plan is not None and method not in self._fill_plan.bucketed

    def rows_per_call(self, method: str, item_shape: tuple[int, ...]) -> int:
        """How many items of this shape one model call holds: the plan's micro-batch for
        the shape; without a plan, the count limit lowered by the pixel budget (never < 1)."""
        if self._micro_batch_for is not None:
            return max(1, int(self._micro_batch_for(method, item_shape)))
        if self.max_batch_pixels is None:
            return self.max_batch_size
        per_item = max(1, self._pixels_per_item(method, item_shape))
        return max(1, min(self.max_batch_size, self.max_batch_pixels // per_item))

    # ---- submit ---------------------------------------------------------------------
    async def submit(self, method: str, array: np.ndarray, deadline: float | None = None) -> np.ndarray:
        """Queue ``array`` (a batch, axis 0) for ``method``; ``deadline`` is a monotonic time."""
        return await self.enqueue(method, array, deadline)

    def enqueue(self, method: str, array: np.ndarray, deadline: float | None = None) -> asyncio.Future:
        """:meth:`submit` without a coroutine: the future of the answer (cancelling it takes
        the rows not yet run out of the queue). The device executor answers thousands of
        requests a second this way, without a task per request."""
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
        loop = asyncio.get_running_loop()
        if not self._queued_rows and not self._running:  # work arrives at an idle batcher: its wait starts
            self._progress_at = time.monotonic()
        item = _Item(array, loop.create_future(), time.monotonic(), deadline, key, queued=True)
        self._queues.setdefault(key, collections.deque()).append(item)
        self._queued_rows += rows
        self._last_event = item.enqueued
        if deadline is not None:
            item.timer = loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, item)
        # However it ends (answered, failed, expired, or cancelled with its caller), what is
        # left of it leaves the queue at once.
        item.future.add_done_callback(lambda _future: self._settled(item))
        self._wakeup.set()
        return item.future

    def _expire(self, item: _Item) -> None:
        """The deadline timer: fail the request now, not when a model slot next frees
        (gRPC cancels a call whose deadline passed, but an in-process caller has no one to)."""
        if not item.future.done():
            where = "queued" if item.taken == 0 else \
                f"partly run ({item.answered} of its {item.rows} items answered; the rest are dropped)"
            item.future.set_exception(DeadlineExpired(f"the deadline passed while the request was {where}"))

    def _settled(self, item: _Item) -> None:
        """A request is over: stop its timer, and take its rows not yet run out of the queue."""
        if item.timer is not None:
            item.timer.cancel()
        if item.queued:
            q = self._queues[item.key]
            q.remove(item)
            self._unqueue(item)
            if not q:
                del self._queues[item.key]
            self._wakeup.set()  # the oldest head may have changed

    def _unqueue(self, item: _Item) -> None:
        """``item`` is out of its queue: its rows not taken no longer count as queued."""
        item.queued = False
        self._queued_rows -= item.left

    # ---- scheduling -----------------------------------------------------------------
    def _due(self, key: tuple, q: collections.deque) -> float:
        """When this queue's next call may start (monotonic; at once for a full call), or inf
        while a short padded call waits for the device to free (module docstring)."""
        rows = sum(it.left for it in q)
        cap = self.rows_per_call(key[0], key[1])
        if rows >= cap or not self._accepting:
            return 0.0
        due = q[0].enqueued + self.max_delay_s
        if cap == 1 or not self.fills_calls(key[0]):
            return due
        expected = min(cap, self._expected.get(key, 0))
        if rows == 1 and key[0] in self._fill_plan.lone_unpadded and expected <= 1:
            return due  # a lone image the plan runs unpadded costs its own row, and nobody is on the way
        if self._free < self.slots:
            return float("inf")  # the device is busy: the queue fills meanwhile
        call_s = min(self._call_s.get(key, (0.004, 0.004)))  # one slow call (a warm-up) bounds one wait only
        if rows >= expected > 0:
            return due  # every client the last call answered is back: nobody else is coming
        if expected:  # they are on their way: wait for them, idling the device one call at most
            return max(due, self._idle_since + call_s)
        settle = min(0.004, max(0.0005, call_s / 4))
        return max(due, min(self._last_event + settle, self._idle_since + call_s))

    def _ready(self, now: float) -> tuple[tuple | None, float | None]:
        """The key of the queue a free slot should run now (oldest head first), or None and
        the seconds until the soonest queue is due (None: until an arrival or a finished call
        wakes the scheduler)."""
        best, best_t, soonest = None, None, float("inf")
        for key, q in self._queues.items():
            if not q:
                continue
            head, due = q[0].enqueued, self._due(key, q)
            if now >= due:
                if best_t is None or head < best_t:
                    best, best_t = key, head
            else:
                soonest = min(soonest, due)
        return best, (None if soonest == float("inf") else soonest - now)

    def _take(self, key: tuple, now: float) -> list[Segment]:
        """Up to one call's rows from the queue, splitting the last request if it is larger."""
        q = self._queues[key]
        cap = self.rows_per_call(key[0], key[1])
        segments: list[Segment] = []
        rows = 0
        while q and rows < cap:
            item = q[0]
            expired = item.deadline is not None and now >= item.deadline
            if item.future.done() or expired:  # its done-callback has not run yet
                self._unqueue(q.popleft())
                if not item.future.done():
                    self._expire(item)
                continue
            n = min(item.left, cap - rows)
            segments.append((item, item.taken, item.taken + n))
            item.taken += n
            rows += n
            self._queued_rows -= n
            if item.left == 0:
                q.popleft()
                item.queued = False
        if not q:
            del self._queues[key]
        return segments

    async def _schedule(self) -> None:
        while True:
            now = time.monotonic()
            key, timeout = self._ready(now) if self._free > 0 else (None, None)
            if key is None:
                if not self._accepting and not self._running and not any(self._queues.values()):
                    return
                self._wakeup.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                continue
            segments = self._take(key, now)
            if segments:
                self._free -= 1
                task = asyncio.get_running_loop().create_task(self._execute(key[0], segments))
                self._running.add(task)
                task.add_done_callback(self._slot_freed)

    def _slot_freed(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._free += 1
        self._last_event = self._progress_at = time.monotonic()
        if self._free == self.slots:
            self._idle_since = self._last_event
        self._wakeup.set()

    async def _execute(self, method: str, segments: list[Segment]) -> None:
        fn = self._fns[method]
        start = time.monotonic()
        waits = [start - it.enqueued for it, a, _ in segments if a == 0]
        parts = [it.array if (a, b) == (0, it.rows) else it.array[a:b] for it, a, b in segments]
        rows = sum(b - a for _, a, b in segments)
        requests = len({id(it) for it, _, _ in segments})

        def call():  # in the model's thread: the copy that stacks requests keeps off the event loop
            t0 = time.perf_counter()
            stacked = parts[0] if len(parts) == 1 else np.concatenate(parts)
            out = np.asarray(fn(stacked))
            return out, time.perf_counter() - t0

        try:
            out, infer_s = await self._threads.run(call)
        except Exception as exc:  # noqa: BLE001 - the runtime's error goes to its requests
            elapsed = time.monotonic() - start
            self.slowest_call_s = max(self.slowest_call_s, elapsed)
            self._observe(BatchStats(method, rows, requests, waits, elapsed, ok=False))
            if device_faults.is_poisoned(exc):
                self.on_poisoned(exc)  # by default the process ends here
                self._fail_call(segments, exc)
                return
            if device_faults.is_out_of_memory(exc):  # the device, not a request: each of them alone would fail too
                self._fail_call(segments, device_faults.out_of_memory(exc, rows))
                return
            if requests == 1:
                item = segments[0][0]
                if not item.future.done():
                    item.future.set_exception(exc)
                return
            # Isolate the culprit: run each request's rows on their own.
            for seg in segments:
                if not seg[0].future.done():
                    await self._execute(method, [seg])
            return
        self.slowest_call_s = max(self.slowest_call_s, time.monotonic() - start)
        self._observe(BatchStats(method, rows, requests, waits, infer_s))
        offset = 0
        for item, a, b in segments:
            item.deliver(a, out[offset: offset + (b - a)])
            offset += b - a
        if self.fills_calls(method):
            self._remember_call(segments, infer_s)

    @staticmethod
    def _fail_call(segments: list[Segment], error: BaseException) -> None:
        for item, _, _ in segments:
            if not item.future.done():
                item.future.set_exception(error)

    def _remember_call(self, segments: list[Segment], infer_s: float) -> None:
        """What the next padded call of this queue waits for: its call time, and the clients
        this call answered, who send their next requests now (closed loop), with those queued
        meanwhile (a request split over calls is answered by its last one)."""
        key = segments[0][0].key
        if len(self._expected) >= _MAX_KEYS_REMEMBERED and key not in self._expected:
            self._expected.clear()  # a client sending ever new shapes must not grow the server
            self._call_s.clear()
        average = infer_s if key not in self._call_s else 0.8 * self._call_s[key][0] + 0.2 * infer_s
        self._call_s[key] = (average, infer_s)
        q = self._queues.get(key)
        answered = sum(item.rows for item, _, b in segments if b == item.rows)
        self._expected[key] = answered + (sum(it.left for it in q) if q else 0)

    def _observe(self, stats: BatchStats) -> None:
        if self.observer is not None:
            try:
                self.observer(stats)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                pass


def _image_pixels(method: str, item_shape: tuple[int, ...]) -> int:
    return int(np.prod(item_shape[:2])) if len(item_shape) >= 2 else 1
