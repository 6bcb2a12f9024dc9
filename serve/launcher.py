"""Compose a serving process from its parts: one process that does everything, or a device
executor with N front-end processes (``config.frontends``), as vLLM composes its API servers
and engine core. Both run by the same lifecycle (``serve/running.py``); the front-end
processes themselves are started by the executor (``serve/split/pool.py``) and compose their
own server (``serve/split/frontend.py``).

``serve_until_signal`` is what ``vqserve serve`` runs; :class:`ServerThread` runs the same
server on an event loop in a background thread, for tests, benchmarks and embedding.
"""

from __future__ import annotations

import asyncio
import os
import threading

from vqserve.serve.config import ServerConfig
from vqserve.serve.engine.local import LocalModel
from vqserve.serve.grpc_server import TokenizerServer
from vqserve.serve.logs import JsonFormatter, log, setup_logging
from vqserve.serve.metrics import Metrics
from vqserve.serve.running import run_until_signal
from vqserve.serve.split.executor_server import ExecutorServer

__all__ = ["JsonFormatter", "ServerConfig", "ServerThread", "TokenizerServer", "build_server", "log",
           "serve_in_thread", "serve_until_signal", "setup_logging"]


def build_server(config: ServerConfig, runtime=None):
    """The server ``config`` asks for: with ``frontends``, the device executor that starts
    them; else one process serving gRPC over the model it loads. ``runtime``: a loaded
    Runtime, or a zero-argument callable returning one, instead of loading ``config.model``."""
    if config.frontends:
        return ExecutorServer(config, runtime)
    return TokenizerServer(config, Metrics(role="all"), lambda state: LocalModel(config, state, runtime))


async def serve_until_signal(config: ServerConfig, runtime=None) -> int:
    """Run the server ``config`` asks for until SIGTERM/SIGINT, then drain; returns the exit
    status (0 after a clean drain)."""
    return await run_until_signal(build_server(config, runtime))


class ServerThread:
    """A server (:func:`build_server`) on its own event loop in a daemon thread.

    with ServerThread(ServerConfig(model=path, port=0, metrics_port=0)) as srv:
        TokenizerClient(f"127.0.0.1:{srv.port}").encode(images)
    """

    def __init__(self, config: ServerConfig, runtime=None):
        self.config = config
        self.runtime = runtime
        self.server: TokenizerServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="vqserve-server", daemon=True)
        self._ready = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._grace = 5.0

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int | None:
        return self.server.metrics_port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0, wait_loaded: bool = True) -> ServerThread:
        """Start; return once the model is loaded (or only bound, ``wait_loaded=False``)."""
        self._thread.start()
        event = self._ready if wait_loaded else self._bound
        if not event.wait(timeout):
            raise TimeoutError("the server did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def wait_loaded(self, timeout: float = 120.0) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError("the model did not load in time")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        asyncio.run(self._amain())

    async def _amain(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self.server = build_server(self.config, self.runtime)
            await self.server.start()
            self._bound.set()
            await self.server.wait_loaded()
        except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
            self._error = exc
            self._bound.set()
            self._ready.set()
            if self.server is not None:
                await self.server.stop(0)
            return
        self._ready.set()
        await self._stop.wait()
        await self.server.stop(self._grace)

    def call(self, coro, timeout: float | None = 30.0):
        """Run a coroutine on the server's loop from another thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 5.0) -> None:
        """Stop and wait for the thread. Safe to call twice, from any thread: a call that
        finds the loop already closed (another stop() got there first and the thread is
        on its way out) only waits."""
        if self.loop is not None and self._thread.is_alive():
            self._grace = grace
            try:
                self.loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:   # 'Event loop is closed': the server has already stopped
                pass
            self._thread.join(grace + 30)

    def __enter__(self) -> ServerThread:
        """Start, unless started already (``with vqserve.serve(...) as server`` starts first)."""
        return self if self._thread.is_alive() or self._ready.is_set() else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_in_thread(model: str | os.PathLike = "default", *, port: int = 50051,
                    host: str = "127.0.0.1", metrics_port: int = -1, wait_loaded: bool = True,
                    timeout: float = 600.0, **settings) -> ServerThread:
    """Start the server ``vqserve serve`` runs (both gRPC APIs, health, reflection) in a
    background thread of this process and return it, serving once the model is loaded.
    ``port=0`` picks a free port (``server.port``, ``server.target``); ``settings`` are
    :class:`~vqserve.serve.config.ServerConfig` fields (``max_batch_size``, ``dtype``,
    ``auth_token``, ...). Stop it with ``server.stop()`` or use it as a context manager::

        with vqserve.serve("default", port=0) as server:
            tokens = vqserve.TokenizerClient(server.target).encode(images)
    """
    config = ServerConfig(model=str(model), host=host, port=port, metrics_port=metrics_port,
                          **settings)
    return ServerThread(config).start(timeout=timeout, wait_loaded=wait_loaded)
