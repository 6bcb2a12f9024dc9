"""The decode worker processes of the overlapped engine, and the shared arena they decode into.

Apart from the engine's run (``offline/engine.py``) because this is the part that lives in
other processes: what a worker runs (map the parent's arena, decode each task into its slot,
send back a few ints per image shape), the pool that feeds them through pipes without helper
threads, and the socket that hands the arena's descriptor to each worker. A worker loads no
torch; the engine only sends tasks and reads :class:`SlotResult` back.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from vqserve.core import images
from vqserve.core.lifetime import Stopped, lower_priority
from vqserve.core.shm import Arena, round_up
from vqserve.offline.errors import TokenizeError
from vqserve.offline.tasks import Task, _decode_worker_start, decode_task, shape_groups

ALIGN = 64  # each shape's block in a slot starts on this many bytes

_ARENA = None


def _worker_start(address: str | None) -> None:
    """A decode worker: dies with its parent (``tasks._decode_worker_start``), runs below
    its priority, then maps the parent's arena, whose descriptor it receives over the Unix
    socket at ``address``."""
    global _ARENA
    _decode_worker_start()
    lower_priority(5)  # the main process feeds the device: it must get a core whenever it asks
    if address:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(address)
            header, fd = Arena.receive(sock)
        _ARENA = Arena.attach(fd, int(header))


@dataclass
class SlotResult:
    """What a worker sends back: per record an error string or ``(orig_h, orig_w, crop)``;
    per image shape ``(shape, offset or None, indices)``; pixels that missed the slot. The
    task itself stays in the main process (``task`` is filled in there: unpickling its
    records again cost the main thread ~6 µs per image)."""

    task: Task | None
    metas: list
    groups: list
    overflow: dict          # group number -> stacked pixels (did not fit the slot)
    seconds: float


def decode_into_slot(task: Task, pre: images.Preprocess, image_column: str, slot: int,
                     slot_bytes: int) -> SlotResult:
    t0 = time.perf_counter()
    items = decode_task(task, pre, image_column).items
    metas, order = shape_groups(items)
    groups, overflow, used = [], {}, 0
    for g, (shape, idx) in enumerate(order.items()):
        nbytes = int(np.prod(shape)) * len(idx)
        if _ARENA is not None and used + nbytes <= slot_bytes:
            block = _ARENA.view(slot + used, (len(idx), *shape), np.uint8)
            for j, i in enumerate(idx):
                block[j] = items[i].pixels
            groups.append((shape, slot + used, idx))
            used += round_up(nbytes, ALIGN)
        else:
            groups.append((shape, None, idx))
            overflow[g] = np.stack([items[i].pixels for i in idx])
    return SlotResult(None, metas, groups, overflow, time.perf_counter() - t0)


def _worker_main(conn, address: str | None, pre: images.Preprocess, image_column: str) -> None:
    """A decode worker's life: map the arena, then decode each ``(task, slot, slot_bytes)``
    received into its slot and send back the :class:`SlotResult`, until ``None`` or EOF."""
    _worker_start(address)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task, slot, slot_bytes = msg
        try:
            conn.send(decode_into_slot(task, pre, image_column, slot, slot_bytes))
        except Exception as exc:  # noqa: BLE001 - a worker bug: one line to the parent
            conn.send(f"decode worker failed on shard {task.shard} task {task.index}: "
                      f"{type(exc).__name__}: {exc}")


class _DecodePool:
    """``workers`` spawned processes, each with its own pipe; the main thread sends tasks and
    reads results itself (no helper threads: a ProcessPoolExecutor spent ~100 µs of this
    process's CPU per image on its management and feeder threads). Each worker holds up to
    ``depth`` tasks so it never waits between two."""

    def __init__(self, workers: int, address: str | None, pre: images.Preprocess, image_column: str,
                 depth: int = 2):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # never fork a process holding torch threads
        self.depth, self.conns, self.procs = depth, [], []
        self.queued: list[deque] = []                  # per worker: (task, slot) sent, in order
        for i in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, address, pre, image_column),
                               name=f"vqserve-decode-{i}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
            self.queued.append(deque())
        self.selector = selectors.DefaultSelector()
        for i, conn in enumerate(self.conns):
            self.selector.register(conn, selectors.EVENT_READ, i)

    def room(self) -> int | None:
        """A worker with the fewest tasks queued, if it has room."""
        i = min(range(len(self.conns)), key=lambda k: len(self.queued[k]))
        return i if len(self.queued[i]) < self.depth else None

    def send(self, worker: int, task: Task, slot: int, slot_bytes: int) -> None:
        self.conns[worker].send((task, max(0, slot), slot_bytes if slot >= 0 else 0))
        self.queued[worker].append((task, slot))

    @property
    def busy(self) -> bool:
        return any(self.queued)

    def results(self, timeout: float) -> list:
        """``(SlotResult, slot)`` of every worker that has one ready (waiting up to ``timeout``)."""
        out = []
        # one selector for the run (multiprocessing.connection.wait builds one per call); a
        # worker with nothing queued is readable only when it died, which is reported at once
        for key, _ in self.selector.select(timeout):
            i = key.data
            conn = self.conns[i]
            try:
                got = conn.recv()
            except (EOFError, OSError):
                proc = self.procs[i]
                proc.join(1)
                if proc.exitcode in (-signal.SIGINT, -signal.SIGTERM):
                    # the stop signal sent to the whole process group, which reached this
                    # worker while it started, before it could leave the signal to us
                    raise Stopped(-proc.exitcode) from None
                raise TokenizeError(f"decode worker {i} (pid {proc.pid}) died "
                                             f"(exit code {proc.exitcode})") from None
            if isinstance(got, str):
                raise TokenizeError(got)
            got.task, slot = self.queued[i].popleft()
            out.append((got, slot))
        return out

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():  # it ignores SIGTERM (its parent handles stopping)
                proc.kill()
                proc.join(5)
        self.selector.close()
        for conn in self.conns:
            conn.close()


class _ArenaServer:
    """The arena and the socket its descriptor is handed over on, to every worker that asks."""

    def __init__(self, size: int):
        self.arena = Arena(size, name="vqserve-tokenize")
        self.address = f"\0vqserve-tokenize-{os.getpid()}-{id(self):x}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(64)
        self.thread = threading.Thread(target=self._serve, name="vqserve-arena", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    self.arena.send_to(conn, str(self.arena.size).encode())
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
