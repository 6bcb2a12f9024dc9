"""``RemoteBatcher``: a front-end's batcher whose model is the device executor's.

A front-end process (``serve/split/frontend.py``) hands each checked request to this object
exactly as a single-process server hands it to its local :class:`~vqserve.serve.engine.batcher.Batcher`
(``submit``, ``start``, ``close``, ``queued``), so the engine and both protocol adapters are the
same code in either layout. Underneath:

- the pixels are written once into this process's shared arena (:mod:`vqserve.core.shm`) and
  the executor reads them in place; only a header crosses the socket (``serve/split/wire.py``);
- requests of one (method, item shape, dtype) leave together as one group, so the executor
  sees few large requests rather than many small ones;
- the executor batches across every front-end, runs the model by its plan and writes the
  answer into the same block; this process copies it out, frees the block and replies;
- a heartbeat (``wire.PING`` every ``heartbeat_s``) asks the executor whether it is there and
  its model progresses: :meth:`RemoteBatcher.why_stalled` is what this front-end's health
  reports (``serve/liveness.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
import socket
import time

import numpy as np

from vqserve.core.shm import Arena, ArenaFull, round_up
from vqserve.core.token_layout import TokenLayout
from vqserve.serve.error_codes import BatcherClosed, DeadlineExpired, QueueFull
from vqserve.serve.split import wire


def default_arena_bytes(max_batch_size: int, max_pixels: int) -> int:
    """Room for several largest requests and their answers at once (pages are taken only
    when touched, so the size is a bound, not a cost)."""
    largest = max_batch_size * max_pixels * 3
    return max(256 << 20, 4 * largest)


@dataclasses.dataclass(eq=False)
class _Member:
    """One request in a group: its caller's future and its rows of the group's block."""

    future: asyncio.Future
    array: np.ndarray | None  # until it is written into the group's block
    rows: int
    deadline: float | None
    start: int = 0  # its first row in the group's block


@dataclasses.dataclass(eq=False)
class _Group:
    """Requests of one (method, item shape, dtype) sent to the executor as one request."""

    method: str
    key: tuple
    members: list[_Member] = dataclasses.field(default_factory=list)
    req_id: int = 0  # once sent
    block: tuple[int, int, int] = (0, 0, 0)  # offset, size, answer bytes: once sent

    @property
    def rows(self) -> int:
        return sum(m.rows for m in self.members)


class RemoteBatcher:
    """The executor's batcher, reached through this process's arena and a Unix socket.

    Requests leave in groups: those with the same method, item shape and dtype travel as
    one request to the executor (their arrays side by side in one block, at most
    ``max_group_rows`` rows), and each caller gets its own rows of the one answer. A group
    leaves at the end of the event-loop turn when fewer than ``window`` groups of its kind
    are at the executor; otherwise it takes the requests that arrive until one comes back
    (or until it is full, when it leaves at once).

    Why: a front-end receives requests about one per turn, so each one-image request cost
    the executor its own header, queue entry, future, reply and codebook count, and both
    processes their own wake-ups. On 2 cores with ``synthetic:200`` and 16 one-image
    callers that work, not the device, set the pace. Why a window of 2 (double buffering:
    one group on the device, the next waiting for it): with 1 the CPU-bound case above did
    best (0.30-0.31 of the device against 0.29 with 2, and 0.26-0.28 before groups), but a
    device-bound one (``synthetic:2000``, the same callers) fell from 0.70-0.80 to 0.53-0.63,
    because the device then idled while each group's answer went back and the next group
    came; with 2 it stayed at 0.67-0.83 (docs/SERVING.md).

    Where the executor's plan pads short calls and waits for requests to fill them (the
    batcher's fill rule), that method's requests are never held: they leave every turn,
    since holding them would leave those calls half empty. A group is batched like a
    request of several rows (the executor's batcher may split it between calls), so tokens
    do not change: the plan's certificate says its calls are batch-invariant. A caller that
    goes away leaves its group if the group has not left; once it has, the executor drops
    the group's rows not yet run when no caller of it waits any more."""

    def __init__(self, socket_path: str, arena_bytes: int, on_info=None, max_group_rows: int = 32,
                 window: int = 2, on_group=None, heartbeat_s: float = 1.0):
        self.socket_path = socket_path
        self.arena = Arena(arena_bytes, name="vqserve-frontend")
        self.on_info = on_info or (lambda payload: None)
        self.on_group = on_group  # (method, requests) of each group sent: the group-size metric
        self.max_group_rows = max(1, int(max_group_rows))
        self._ids = itertools.count(1)
        self._pending: dict[int, _Group] = {}  # sent, by request id, until their reply
        self._open: dict[tuple, _Group] = {}   # taking requests until they may leave
        self._in_flight: dict[tuple, int] = {}  # groups sent per key, not answered yet
        self.window = max(1, int(window))
        self._turn_scheduled = False
        self._never_held: frozenset[str] = frozenset()  # methods whose short calls wait to fill there
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._out: wire.Outbox | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self.info: dict | None = None
        self._info_ready: asyncio.Event | None = None
        self.groups_sent = 0     # requests to the executor ...
        self.requests_sent = 0   # ... and the callers' requests they carried
        self.heartbeat_s = heartbeat_s
        self._heard_at = time.monotonic()  # the executor's last message of any kind
        self._executor_stall: str | None = None  # why the executor's model is stalled (its last PONG)
        self._heartbeat: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        return sum(len(group.members) for groups in (self._pending, self._open) for group in groups.values())

    async def connect(self, timeout: float = 600.0) -> dict:
        """Connect (the executor may still be starting), hand over the arena, and wait for
        the served model's identity (sent once the model is loaded)."""
        self._info_ready = asyncio.Event()
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no executor answered at {self.socket_path}") from None
                await asyncio.sleep(0.05)
        self.arena.send_to(sock, json.dumps({"pid": os.getpid(), "arena_bytes": self.arena.size}).encode())
        self._reader, self._writer = await asyncio.open_unix_connection(sock=sock)
        self._out = wire.Outbox(self._writer)
        self._task = asyncio.get_running_loop().create_task(self._read_replies())
        await self._info_ready.wait()
        if self.info is None:
            raise ConnectionError("the executor closed the connection before the model was loaded")
        self._heard_at = time.monotonic()
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        return self.info

    async def _beat(self) -> None:
        """Ask the executor every ``heartbeat_s`` whether it is there and progressing."""
        while not self._closed:
            self._out.send(wire.pack_request(0, wire.PING, "uint8", (), None, 0, 0, 0))
            await asyncio.sleep(self.heartbeat_s)

    def why_stalled(self, timeout_s: float) -> str | None:
        """Why this front-end cannot serve: the executor has not answered for longer than
        ``timeout_s``, or says its model makes no progress; None when it serves."""
        silent = time.monotonic() - self._heard_at
        if silent > timeout_s:
            return (f"the device executor has not answered for {silent:.1f} s (--stall-timeout {timeout_s:g} s): "
                    "stopped, deadlocked or gone")
        return self._executor_stall

    def start(self) -> None:  # the Batcher interface: nothing to start, the executor runs
        pass

    def ready(self) -> None:
        """Tell the executor this front-end serves (it logs "serving" once all do)."""
        self._out.send(wire.pack_request(0, wire.READY, "uint8", (), None, 0, 0, 0))

    async def submit(self, method: str, array: np.ndarray, deadline: float | None = None) -> np.ndarray:
        if self._closed or self._writer is None:
            raise BatcherClosed("the server is shutting down")
        if deadline is not None and deadline <= time.monotonic():
            raise DeadlineExpired("the deadline passed before the request reached the model")
        rows = int(array.shape[0])
        key = (method, array.shape[1:], array.dtype.str)
        group = self._open.get(key)
        if group is not None and group.rows + rows > self.max_group_rows:
            self._send(self._open.pop(key))  # full: it leaves now, this request opens the next
            group = None
        if group is None:
            group = self._open[key] = _Group(method, key)
        if self._may_leave(key):
            self._end_of_turn()
        member = _Member(asyncio.get_running_loop().create_future(), np.ascontiguousarray(array), rows, deadline)
        group.members.append(member)
        try:
            return await member.future
        except asyncio.CancelledError:
            self._withdraw(group, member)
            raise

    def _withdraw(self, group: _Group, member: _Member) -> None:
        """A caller went away. Not sent yet: its rows leave the group. Sent: the executor
        drops the rows it has not run once no caller of the group waits; the block stays
        ours until its reply says the executor is done with it."""
        if not group.req_id:
            if member in group.members:
                group.members.remove(member)
            return
        if group.req_id in self._pending and all(m.future.done() for m in group.members) \
                and self._writer is not None and not self._writer.is_closing():
            self._out.send(wire.pack_request(group.req_id, wire.CANCEL, "uint8", (), None, 0, 0, 0))

    def _end_of_turn(self) -> None:
        """Send the open groups that may leave once this event-loop turn ends (once a turn)."""
        if not self._turn_scheduled:
            self._turn_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_open)

    def _send_open(self) -> None:
        """The end of the turn: the open groups whose window has room leave."""
        self._turn_scheduled = False
        for key, group in list(self._open.items()):
            if self._may_leave(key):
                del self._open[key]
                self._send(group)

    def _may_leave(self, key: tuple) -> bool:
        """Whether the open group of ``key`` leaves at the end of this turn: the window has
        room, or the executor's plan pads short calls of this method and waits for requests
        to fill them (holding requests back then would leave those calls half empty)."""
        return key[0] in self._never_held or self._in_flight.get(key, 0) < self.window

    def _send(self, group: _Group) -> None:
        """Write the group's pixels into one block and its header onto the socket."""
        now = time.monotonic()
        for m in group.members:  # held past its deadline: it ends here, the others go on
            if m.deadline is not None and m.deadline <= now and not m.future.done():
                m.future.set_exception(DeadlineExpired("the deadline passed before the request reached the model"))
        members = [m for m in group.members if not m.future.done()]
        if not members:
            return
        group.members = members
        first = members[0].array
        item_shape, rows = first.shape[1:], group.rows
        shape = (rows, *item_shape)
        answer_shape, answer_dtype = self._answer_of(group.method, shape)
        answer_bytes = math.prod(answer_shape) * np.dtype(answer_dtype).itemsize
        in_bytes = round_up(rows * math.prod(item_shape) * first.dtype.itemsize)
        size = in_bytes + answer_bytes
        try:
            offset = self.arena.alloc(size)
        except ArenaFull:
            self._fail(members, QueueFull("the server is overloaded (its shared pixel memory is full); retry "
                                          "with backoff"))
            return
        group.req_id, group.block = next(self._ids), (offset, size, answer_bytes)
        deadlines = [m.deadline for m in members]
        deadline = None if None in deadlines else max(deadlines)  # each caller's own is gRPC's to keep
        try:
            at, start = offset, 0
            for m in members:
                self.arena.put(at, m.array)
                at += m.array.nbytes
                m.start, start, m.array = start, start + m.rows, None
            self._out.send(wire.pack_request(group.req_id, wire.KINDS[group.method], first.dtype, shape,
                                             deadline, offset, offset + in_bytes, answer_bytes))
        except BaseException as exc:  # noqa: BLE001 - every caller hears of it
            self.arena.free(offset, size)
            self._fail(members, exc)
            return
        self._pending[group.req_id] = group
        self._in_flight[group.key] = self._in_flight.get(group.key, 0) + 1
        self.groups_sent += 1
        self.requests_sent += len(members)
        if self.on_group is not None:
            try:
                self.on_group(group.method, len(members))
            except Exception:  # noqa: BLE001 - metrics must never break serving
                pass

    @staticmethod
    def _fail(members: list[_Member], exc: BaseException) -> None:
        for m in members:
            if not m.future.done():
                m.future.set_exception(exc)

    def _answer_of(self, method: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
        info = self.info["info"]
        layout = TokenLayout.from_info(info)
        if method == "encode":
            return (shape[0], *layout.token_shape(shape[1], shape[2])), info["index_dtype"]
        return (shape[0], *layout.image_size(shape[1:]), 3), "uint8"

    async def _read_replies(self) -> None:
        reader, pending = self._reader, bytearray()
        try:
            while True:
                data = await reader.read(1 << 16)  # every reply that has arrived: one wake-up
                if not data:
                    break
                self._heard_at = time.monotonic()
                pending += data
                for reply in wire.split_replies(pending):
                    self._settle(*reply)
        except (ConnectionError, OSError):
            pass
        finally:
            self._fail_all("the device executor went away; retry (another replica, or this one restarted)")
            self._info_ready.set()

    def _settle(self, req_id: int, status: int, dtype: str, shape: tuple[int, ...], message: str) -> None:
        """One reply: the identity pushed by the executor, or a request's answer or error
        (its block is freed in every case: the executor is done with it)."""
        if status == wire.PONG:
            self._executor_stall = message or None
            return
        if status == wire.INFO:
            self.info = json.loads(message)
            self._never_held = frozenset(self.info.get("fill_methods") or ())
            self.on_info(self.info)
            self._info_ready.set()
            return
        group = self._pending.pop(req_id, None)
        if group is None:
            return
        self._in_flight[group.key] -= 1
        if group.key in self._open:  # the requests held for this window
            self._end_of_turn()
        offset, size, answer_bytes = group.block
        try:
            if status == wire.OK:
                nbytes = math.prod(shape) * np.dtype(dtype).itemsize
                if nbytes > answer_bytes:
                    self._fail(group.members, RuntimeError("the executor's answer overran its block"))
                    return
                answer = self.arena.view(offset + size - answer_bytes, shape, dtype)
                for m in group.members:
                    if not m.future.done():
                        m.future.set_result(answer[m.start:m.start + m.rows].copy())
            elif status == wire.CANCELLED:
                for m in group.members:
                    m.future.cancel()
            else:
                self._fail(group.members, wire.error_of(status, message))
        finally:
            self.arena.free(offset, size)

    def _fail_all(self, why: str) -> None:
        self._closed = True
        for groups in (self._pending, self._open):
            for group in groups.values():
                self._fail(group.members, BatcherClosed(why))
            groups.clear()
        self._in_flight.clear()

    async def close(self) -> None:
        """Wait for the answers in flight, then close the connection."""
        self._closed = True
        while (self._pending or self._open) and self._task is not None and not self._task.done():
            await asyncio.sleep(0.01)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._writer is not None:
            self._writer.close()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass
