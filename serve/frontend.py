"""A front-end process: gRPC, parsing, checks, image decoding and replies, with no model.

On a GPU node one Python process cannot both handle thousands of requests a second and
keep the device fed: its event loop and its model thread share one GIL while the device
waits. So ``vqserve serve --frontends N`` runs N of these processes on one port
(``SO_REUSEPORT``: the kernel spreads connections over them), each a full
:class:`~vqserve.serve.server.TokenizerServer` (auth before parse, budgets, deadlines,
health, reflection, SIGTERM drain) whose engine hands checked pixels to the one device
executor (``serve/executor.py``) instead of a local batcher:

- the pixels are written once into this process's shared arena (:mod:`vqserve.shm`) and
  the executor reads them in place; only a header crosses the socket (``serve/wire.py``);
- the executor batches across every front-end, runs the model by its plan and writes the
  answer into the same block; this process copies it out, frees the block and replies.

:class:`RemoteBatcher` has the local batcher's interface (``submit``, ``start``, ``close``,
``queued``), so the engine and both protocol adapters are the same code in either layout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
import socket
import sys
import time

import numpy as np

from vqserve.serve import wire
from vqserve.serve.batcher import BatcherClosed, DeadlineExpired, QueueFull
from vqserve.shm import Arena, ArenaFull, round_up


def default_arena_bytes(max_batch_size: int, max_pixels: int) -> int:
    """Room for several largest requests and their answers at once (pages are taken only
    when touched, so the size is a bound, not a cost)."""
    largest = max_batch_size * max_pixels * 3
    return max(256 << 20, 4 * largest)


class RemoteBatcher:
    """The executor's batcher, reached through this process's arena and a Unix socket."""

    def __init__(self, socket_path: str, arena_bytes: int, on_info=None):
        self.socket_path = socket_path
        self.arena = Arena(arena_bytes, name="vqserve-frontend")
        self.on_info = on_info or (lambda payload: None)
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future, int, int, int]] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._out: wire.Outbox | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self.info: dict | None = None
        self._info_ready: asyncio.Event | None = None

    @property
    def queued(self) -> int:
        return len(self._pending)

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
        return self.info

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
        kind = wire.KINDS[method]
        answer_shape, answer_dtype = self._answer_of(method, array)
        answer_bytes = math.prod(answer_shape) * np.dtype(answer_dtype).itemsize
        in_bytes = round_up(array.nbytes)
        size = in_bytes + answer_bytes
        try:
            offset = self.arena.alloc(size)
        except ArenaFull:
            raise QueueFull("the server is overloaded (its shared pixel memory is full); retry with "
                            "backoff") from None
        req_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[req_id] = (future, offset, size, answer_bytes)
        try:
            self.arena.put(offset, np.ascontiguousarray(array))
            self._out.send(wire.pack_request(req_id, kind, array.dtype, array.shape, deadline, offset,
                                             offset + in_bytes, answer_bytes))
        except BaseException:
            self._pending.pop(req_id, None)
            self.arena.free(offset, size)
            raise
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # the client went away: the executor drops the rows it has not run; the block
            # stays ours until its reply says the executor is done with it
            if not future.done() and self._writer is not None and not self._writer.is_closing():
                self._out.send(wire.pack_request(req_id, wire.CANCEL, "uint8", (), None, 0, 0, 0))
            raise

    def _answer_of(self, method: str, array: np.ndarray) -> tuple[tuple[int, ...], str]:
        info = self.info["info"]
        f, q = int(info["factor"]), int(info["codes_per_position"])
        if method == "encode":
            b, h, w = array.shape[:3]
            return ((b, h // f, w // f) if q == 1 else (b, h // f, w // f, q)), info["index_dtype"]
        b, h, w = array.shape[:3]
        return (b, h * f, w * f, 3), "uint8"

    async def _read_replies(self) -> None:
        reader, pending = self._reader, bytearray()
        try:
            while True:
                data = await reader.read(1 << 16)  # every reply that has arrived: one wake-up
                if not data:
                    break
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
        if status == wire.INFO:
            self.info = json.loads(message)
            self.on_info(self.info)
            self._info_ready.set()
            return
        entry = self._pending.pop(req_id, None)
        if entry is None:
            return
        future, offset, size, answer_bytes = entry
        try:
            if future.done():
                return
            if status == wire.OK:
                nbytes = math.prod(shape) * np.dtype(dtype).itemsize
                if nbytes > answer_bytes:
                    future.set_exception(RuntimeError("the executor's answer overran its block"))
                else:
                    future.set_result(self.arena.view(offset + size - answer_bytes, shape, dtype).copy())
            elif status == wire.CANCELLED:
                future.cancel()
            else:
                future.set_exception(wire.error_of(status, message))
        finally:
            self.arena.free(offset, size)

    def _fail_all(self, why: str) -> None:
        self._closed = True
        for future, _offset, _size, _answer in self._pending.values():
            if not future.done():
                future.set_exception(BatcherClosed(why))
        self._pending.clear()

    async def close(self) -> None:
        """Wait for the answers in flight, then close the connection."""
        self._closed = True
        while self._pending and self._task is not None and not self._task.done():
            await asyncio.sleep(0.01)
        if self._writer is not None:
            self._writer.close()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass


class _Served:
    """The engine's view of the executor's runtime: its identity alone."""

    def __init__(self, info):
        self.info = info


def _runtime_info(payload: dict):
    from vqserve.export.info import RuntimeInfo

    fields = dict(payload["info"])
    fields["levels"] = tuple(fields.get("levels") or ())
    return RuntimeInfo(**fields)


def _certificate(payload: dict):
    if not payload.get("determinism"):
        return None
    from vqserve.export.determinism import Certificate

    return Certificate(**payload["determinism"])


async def connect_engine(config, metrics):
    """An :class:`Engine` whose batcher is the executor's, with the executor's identity,
    plan and start-up certificate (kept current: a plan switch there is pushed here)."""
    from vqserve.serve.engine import Engine, default_decoded_bytes

    max_pixels_hint = config.max_pixels or 1024 * 1024
    remote = RemoteBatcher(config.executor_socket,
                           (config.arena_mb << 20) or default_arena_bytes(config.max_batch_size, max_pixels_hint))
    payload = await remote.connect()
    info = _runtime_info(payload)
    max_pixels = config.max_pixels or info.max_pixels
    engine = Engine(_Served(info), metrics, max_batch_size=config.max_batch_size,
                    max_delay_s=config.max_delay_ms / 1000.0, max_queue=config.max_queue,
                    max_message_bytes=config.max_message_mb * 1024 * 1024, max_pixels=max_pixels,
                    max_batch_pixels=payload.get("max_batch_pixels"),
                    max_decoded_bytes=((config.max_decoded_mb or 0) << 20)
                    or default_decoded_bytes(config.max_batch_size, max_pixels),
                    decode_threads=config.decode_threads, batcher=remote)
    engine.determinism = _certificate(payload)

    def update(later: dict) -> None:  # a plan switch in the executor: its new identity
        engine.info = dataclasses.replace(_runtime_info(later), max_pixels=engine.info.max_pixels)
        engine.identity = engine.info.identity()
        engine.determinism = _certificate(later)

    remote.on_info = update
    return engine


def main() -> int:
    """``python -m vqserve.serve.frontend``: started by the executor (serve/executor.py),
    its ServerConfig as JSON on stdin; ends with its parent whatever kills it."""
    from vqserve.lifetime import die_with_parent

    die_with_parent()
    from vqserve.serve.server import ServerConfig, serve_until_signal, setup_logging

    settings = json.loads(sys.stdin.read())
    setup_logging(settings.pop("log_level", "info"))
    config = ServerConfig(**settings)
    try:
        return asyncio.run(serve_until_signal(config))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
