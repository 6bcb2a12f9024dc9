"""The device executor: the one process that owns the model when front-ends serve gRPC.

``vqserve serve --frontends N`` splits the server the way vLLM splits its API servers from
its engine core: N front-end processes (``serve/split/frontend.py``) take the requests on one
port, and this process, which loaded the model by its plan, runs every model call. Its
event loop does little per request: read a header, view the pixels in the sender's shared
arena, hand them to the same :class:`~vqserve.serve.engine.engine.Engine` and batcher a
single-process server uses (so batching across all front-ends, deadlines, expiry, the
plan, its start-up certificate, the background plan switch and the codebook metrics are
that code, not a copy), write the answer back into the arena and a header onto the socket.

:class:`ExecutorService` is the executor's side of the socket; the process around it (port,
front-ends, ``/metrics``, the model's load and drain) is ``serve/split/executor_server.py``,
and the front-end processes are started and watched by ``serve/split/pool.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading

from vqserve.core.shm import Arena
from vqserve.serve.error_codes import BatcherClosed
from vqserve.serve.liveness import DEFAULT_STALL_TIMEOUT_S, batcher_stall
from vqserve.serve.split import wire

log = logging.getLogger("vqserve.serve")


def identity_payload(engine) -> dict:
    """What a front-end needs to answer GetModelInfo and check requests like this process,
    and the methods whose short calls this batcher holds to fill (a front-end never holds
    those requests back: serve/split/frontend.py)."""
    info = engine.runtime.info.to_dict()
    certificate = engine.determinism
    fills = engine.batcher.fills_calls
    return {"info": info, "determinism": certificate.to_dict() if certificate is not None else None,
            "max_batch_pixels": engine.max_batch_pixels,
            "fill_methods": [method for method in ("encode", "decode") if fills(method)]}


class _Link:
    """One front-end's connection: its arena, its requests in flight, its replies."""

    def __init__(self, writer: asyncio.StreamWriter, arena: Arena):
        self.arena = arena
        self.out = wire.Outbox(writer)
        self.inflight: dict[int, asyncio.Future] = {}

    @property
    def closed(self) -> bool:
        return self.out.closed

    def send(self, reply: bytes) -> None:
        self.out.send(reply)


class ExecutorService:
    """Answers front-ends on a Unix socket in a private directory (mode 0700); a front-end's
    heartbeat (``wire.PING``) gets why the model is stalled, or an empty answer
    (``serve/liveness.py``, with ``stall_timeout_s``)."""

    def __init__(self, state, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S):
        self.state = state  # the server's ServerState: engine is None until loaded
        self.stall_timeout_s = stall_timeout_s
        self.directory = tempfile.mkdtemp(prefix="vqserve-executor-")
        os.chmod(self.directory, 0o700)
        self.path = os.path.join(self.directory, "executor.sock")
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections: set[asyncio.Task] = set()
        self.ready_frontends = 0
        self._ready_changed: asyncio.Event | None = None
        self._closed = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready_changed = asyncio.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        threading.Thread(target=self._accept, name="vqserve-executor-accept", daemon=True).start()

    def _accept(self) -> None:
        """Accept and take each front-end's arena (a descriptor over the socket: blocking
        calls, so in this thread), then serve the connection on the event loop."""
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            try:
                conn.settimeout(10)
                header, fd = Arena.receive(conn)
                hello = json.loads(header)
                arena = Arena.attach(fd, int(hello["arena_bytes"]))
                conn.settimeout(None)
            except (OSError, ValueError, KeyError) as exc:
                log.warning("a front-end's handshake failed: %s", exc)
                conn.close()
                continue
            asyncio.run_coroutine_threadsafe(self._track(conn, arena, hello), self._loop)

    async def _track(self, conn: socket.socket, arena: Arena, hello: dict) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            await self._serve(conn, arena, hello)
        finally:
            self._connections.discard(task)

    async def _serve(self, conn: socket.socket, arena: Arena, hello: dict) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=conn)
        self._writers.add(writer)
        link = _Link(writer, arena)
        was_ready = False
        pending = bytearray()
        size = wire.REQUEST.size
        try:
            if self.state.ready and self.state.engine is not None:
                writer.write(wire.info_message(identity_payload(self.state.engine)))
            while True:
                try:  # every header that has arrived, in one read: one wake-up for many requests
                    data = await reader.read(1 << 16)
                except ConnectionError:
                    return
                if not data:
                    return
                pending += data
                whole = len(pending) - len(pending) % size
                for at in range(0, whole, size):
                    request = wire.unpack_request(bytes(pending[at:at + size]))
                    kind = request["kind"]
                    if kind == wire.PING:
                        link.send(wire.pack_reply(0, wire.PONG, message=self.why_stalled() or ""))
                    elif kind == wire.CANCEL:
                        future = link.inflight.get(request["id"])
                        if future is not None:
                            future.cancel()
                    elif kind == wire.READY:
                        was_ready = True
                        self.ready_frontends += 1
                        self._ready_changed.set()
                    else:
                        self._start(request, link)
                del pending[:whole]
        finally:
            self._writers.discard(writer)
            if was_ready:
                self.ready_frontends -= 1
            for future in list(link.inflight.values()):  # the front-end is gone: nobody waits for these
                future.cancel()
            link.out.closed = True
            writer.close()
            arena.close()

    def why_stalled(self) -> str | None:
        """Why the model makes no progress while work waits, or None."""
        engine = self.state.engine
        return None if engine is None else batcher_stall(engine.batcher, self.stall_timeout_s)

    def _start(self, request: dict, link: _Link) -> None:
        """Queue one request on the engine's batcher (no task: a done-callback replies)."""
        req_id = request["id"]
        kind = request["kind"]
        try:
            engine = self.state.engine
            if engine is None or self._closed:
                raise BatcherClosed("the model is not loaded or the server is stopping")
            if request["dtype"] is None:
                raise ValueError("unknown dtype code")
            method = wire.METHODS.get(kind)
            if method is None:
                raise ValueError(f"unknown request kind {kind}")
            array = link.arena.view(request["offset"], request["shape"], request["dtype"])
            future = engine.enqueue_checked(method, array, request["deadline"])
        except Exception as exc:  # noqa: BLE001 - every request gets one reply
            link.send(self._failure(req_id, exc))
            return
        link.inflight[req_id] = future
        future.add_done_callback(lambda done: self._finish(request, method, engine, done, link))

    def _finish(self, request: dict, method: str, engine, future: asyncio.Future, link: _Link) -> None:
        req_id = request["id"]
        link.inflight.pop(req_id, None)
        if link.closed:
            return
        if future.cancelled():
            link.send(wire.pack_reply(req_id, wire.CANCELLED))
            return
        try:
            exc = future.exception()
            if exc is not None:
                raise exc
            out = engine.answer(method, future.result())
            if out.nbytes > request["capacity"]:
                raise RuntimeError(f"the answer ({out.nbytes} bytes) is larger than its block "
                                   f"({request['capacity']} bytes)")
            link.arena.put(request["answer_offset"], out)
            reply = wire.pack_reply(req_id, wire.OK, out)
        except Exception as exc:  # noqa: BLE001 - every request gets one reply
            reply = self._failure(req_id, exc)
        link.send(reply)

    @staticmethod
    def _failure(req_id: int, exc: BaseException) -> bytes:
        status, message = wire.status_of(exc)
        if status == wire.FAILED:
            log.error("executor: a request failed", exc_info=exc)
        return wire.pack_reply(req_id, status, message=message)

    def publish(self) -> None:
        """Send the served identity to every front-end (after loading, and after a switch)."""
        engine = self.state.engine
        if engine is None:
            return
        message = wire.info_message(identity_payload(engine))
        for writer in list(self._writers):
            if not writer.is_closing():
                writer.write(message)

    async def wait_ready(self, count: int, failed) -> None:
        """Until ``count`` front-ends serve; ``failed()`` raises if one could not start."""
        while self.ready_frontends < count:
            failed()
            self._ready_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ready_changed.wait(), 0.2)

    async def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        for writer in list(self._writers):
            writer.close()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        shutil.rmtree(self.directory, ignore_errors=True)
