"""The device executor process of a GPU node: the model, and the front-ends that serve it.

``vqserve serve --frontends N`` (``serve/launcher.py``) runs this instead of a gRPC server:
it reserves the port (the front-ends bind it too, ``serve/split/pool.py``), answers the
front-ends on a Unix socket (``serve/split/executor.py``), starts them and serves ``/metrics``
for every process, then loads the model by its plan exactly as a single process does
(``serve/engine/local.py``). It says SERVING through its front-ends once each of them has the
model's identity, and on SIGTERM stops them first, while the model still answers them.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import tempfile
import time

from vqserve.core.machine import available_cores
from vqserve.serve.config import ServerConfig
from vqserve.serve.engine.local import LocalModel
from vqserve.serve.grpc_server import log_listening
from vqserve.serve.logs import event as _event
from vqserve.serve.metrics import Metrics, start_metrics_endpoint, stop_metrics_endpoint
from vqserve.serve.preflight import check_before_start
from vqserve.serve.split.executor import ExecutorService
from vqserve.serve.split.pool import FrontendPool, reserve_port
from vqserve.serve.state import ServerState


class ExecutorServer:
    """The executor behind ``config.frontends`` front-end processes, with the lifecycle of a
    server (``start``, ``wait_loaded``, ``stop``) so one launcher runs either."""

    def __init__(self, config: ServerConfig, runtime=None):
        self.config = config
        self._metrics_dir = tempfile.mkdtemp(prefix="vqserve-metrics-")
        self.metrics = Metrics(role="executor", multiproc_dir=self._metrics_dir)
        self.state = ServerState(self.metrics)
        self.executor: ExecutorService | None = None
        self.pool: FrontendPool | None = None
        self.model = LocalModel(config, self.state, runtime, on_publish=self._publish_to_frontends)
        self._reservation: socket.socket | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http = None
        self._load_task: asyncio.Task | None = None
        self._stopped = False

    def _publish_to_frontends(self) -> None:
        if self.executor is not None:
            self.executor.publish()

    async def start(self) -> int:
        """Reserve the port, listen for the front-ends, start them and ``/metrics``; the model
        loads in the background. Nothing is left running when a step fails."""
        check_before_start(self.config)
        try:
            return await self._start()
        except BaseException:
            await self._abort_start()
            raise

    async def _start(self) -> int:
        cfg = self.config
        self._reservation, self.port = reserve_port(cfg.host, cfg.port)
        self.executor = ExecutorService(self.state, cfg.stall_timeout_s)
        await self.executor.start()
        self._metrics_http, self.metrics_port = start_metrics_endpoint(cfg, self.metrics)
        self.pool = FrontendPool(cfg, cfg.frontends, self.port, self.executor.path, self._metrics_dir)
        self.pool.start()
        cores = available_cores()  # what --frontends auto sized by: a container's CPU limit included
        log_listening(cfg, "listening", f"gRPC listening on {cfg.host}:{self.port} ({cfg.frontends} front-end "
                      f"processes, one device executor; {cores} usable cores)", self.port, self.metrics_port,
                      frontends=cfg.frontends, cores=cores, executor_socket=self.executor.path)
        if cfg.frontends > cores:  # each starts a Python with gRPC: start-up time and memory, for no speed
            _event("frontends_exceed_cores", f"{cfg.frontends} front-end processes on {cores} cores: more "
                   "processes than cores only adds CPU per request, memory and start-up time (--frontends "
                   "auto picks half the cores, 1 to 8)", level=logging.WARNING, frontends=cfg.frontends,
                   cores=cores)
        self._load_task = asyncio.get_running_loop().create_task(self._load())
        return self.port

    async def _abort_start(self) -> None:
        """Undo a partial :meth:`_start`: the front-ends, the socket, the port, ``/metrics``."""
        if self.pool is not None:
            self.pool.stop(0)
        if self.executor is not None:
            await self.executor.close()
        if self._reservation is not None:
            self._reservation.close()
        shutil.rmtree(self._metrics_dir, ignore_errors=True)
        stop_metrics_endpoint(self._metrics_http)
        self._metrics_http = None

    async def _load(self) -> None:
        """Load the model; the front-ends serve once they have its identity."""
        await self.model.load()
        self.executor.publish()
        await self.executor.wait_ready(self.pool.count, self.pool.failed_at_start)
        self.pool.serving = True
        self.model.announce(self.port, self.metrics_port, frontends=self.pool.count)

    async def wait_loaded(self) -> None:
        """Wait for the model and every front-end; re-raises a failure of either."""
        await self._load_task

    async def stop(self, grace: float | None = None) -> None:
        """Drain: the front-ends first (they finish their requests while the model still
        answers them), then the model, the socket, the port and ``/metrics``."""
        if self._stopped:
            return
        self._stopped = True
        self.model.stop()
        grace = self.config.grace_s if grace is None else grace
        _event("draining", f"draining (grace {grace}s)", grace_s=grace)
        self.state.ready = False
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        self.model.cancel()
        t0 = time.perf_counter()
        if self.pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.pool.stop, grace)
        await self.model.close()
        if self.executor is not None:
            await self.executor.close()
        if self._reservation is not None:
            self._reservation.close()
        stop_metrics_endpoint(self._metrics_http)
        shutil.rmtree(self._metrics_dir, ignore_errors=True)
        _event("stopped", "stopped", drain_s=round(time.perf_counter() - t0, 3))
