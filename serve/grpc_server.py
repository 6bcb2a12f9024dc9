"""The gRPC server of one process: both APIs on one port, health, reflection, TLS, auth,
``/metrics``, structured logs and a SIGTERM drain. It knows no roles: what answers the
requests is its *model side*, handed in by whoever composes the process
(``serve/launcher.py``): the model in this process (``serve/engine/local.py``), or, in a
front-end process, the device executor reached through shared memory
(``serve/split/frontend.py``).

The parts live beside it: auth and the stream cap in ``serve/api/gates.py``, health and
reflection in ``serve/api/discovery.py``, the JSON logs in ``serve/logs.py``, the gRPC servers
themselves (one, or ``--listeners`` sharing a front-end's port) in ``serve/grpc_listeners.py``,
the port and TLS checks made before anything starts in ``serve/preflight.py``, the
``/metrics`` endpoint in ``serve/metrics.py``; this module wires them and runs the lifecycle.

Lifecycle: the port is bound and health answers NOT_SERVING while the model side loads (in
the background); then SERVING, except while the model side says it makes no progress
(``why_stalled()``, ``serve/liveness.py``: a wedged device, a stopped executor). On
SIGTERM/SIGINT health goes NOT_SERVING, the server stops accepting RPCs, lets in-flight ones
finish within ``grace_s``, closes the model side and exits 0.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from vqserve import __version__
from vqserve.serve.api import oip as service_oip
from vqserve.serve.api import v1 as service_v1
from vqserve.serve.api.discovery import (
    REFLECTION_SERVICES,
    DrainingHealthServicer,
    add_health,
    add_reflection,
)
from vqserve.serve.api.gates import BearerTokenAuth, StreamGate
from vqserve.serve.config import ServerConfig
from vqserve.serve.grpc_listeners import Listeners
from vqserve.serve.liveness import HealthWatch, check_interval
from vqserve.serve.logs import event as _event
from vqserve.serve.metrics import Metrics, start_metrics_endpoint, stop_metrics_endpoint
from vqserve.serve.preflight import PortInUseError, check_before_start
from vqserve.serve.state import ServerState

__all__ = ["ServerConfig", "ServerState", "StreamGate", "TokenizerServer"]

SERVICES = (service_v1.SERVICE_NAME, service_oip.SERVICE_NAME)


class TokenizerServer:
    """gRPC on one port over a model side: ``model_for(state)`` builds it once the server's
    state exists (``load()`` fills ``state.engine``, ``announce(port, metrics_port)`` after
    SERVING, ``why_stalled()`` asked every moment after that, ``stop()``/``cancel()``/``close()``
    on the drain).

    ``share_port``: the port was reserved by the executor and is shared with the other
    front-ends (``SO_REUSEPORT``), so it is not checked free and gets ``config.listeners``
    gRPC servers; otherwise one server on a port checked free first."""

    SERVICES = SERVICES

    def __init__(self, config: ServerConfig, metrics: Metrics, model_for, share_port: bool = False):
        self.config = config
        self.metrics = metrics
        self.share_port = share_port
        self.state = ServerState(self.metrics)
        self.model = model_for(self.state)
        self.health = DrainingHealthServicer(lambda: self.state.step)
        self.gate = StreamGate(config.max_streams, self.metrics,
                               (service_v1.SERVICE_NAME, health.SERVICE_NAME, *REFLECTION_SERVICES))
        self.listeners: Listeners | None = None  # the gRPC server(s) on the port
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http = None
        self._load_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._stopped = False

    async def start(self) -> int:
        """Bind and start serving (health NOT_SERVING); the model side loads in the background.

        A port in use raises :class:`PortInUseError` and leaves nothing running, so the
        event loop can close without a half-started gRPC server to clean up after."""
        check_before_start(self.config, port_reserved=self.share_port)
        try:
            return await self._start()
        except BaseException:
            await self._abort_start()
            raise

    async def _abort_start(self) -> None:
        """Undo a partial :meth:`_start`: stop gRPC and the metrics endpoint if they are up."""
        if self.listeners is not None:
            await self.listeners.stop(None)
            self.listeners = None
        stop_metrics_endpoint(self._metrics_http)
        self._metrics_http = None

    async def _start(self) -> int:
        cfg = self.config
        limit = cfg.max_message_mb * 1024 * 1024
        interceptors = []
        if cfg.auth_token:
            interceptors.append(BearerTokenAuth(cfg.auth_token))
        interceptors.append(self.gate)  # after auth: a refused token never takes a stream's place
        v1, oip = service_v1.TokenizerService(self.state), service_oip.InferenceService(self.state)

        def register(server: grpc.aio.Server) -> None:
            service_v1.add_to_server(v1, server)
            service_oip.add_to_server(oip, server)
            add_health(self.health, server)
            add_reflection(server, (*self.SERVICES, health.SERVICE_NAME))

        self.listeners = Listeners(cfg.listeners if self.share_port else 1,
                                   [("grpc.max_receive_message_length", limit),
                                    ("grpc.max_send_message_length", limit)],
                                   interceptors, register, share_port=self.share_port)
        for name in ("", *self.SERVICES):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        creds = None
        if cfg.tls_cert:  # both, and loadable: start() checked
            creds = grpc.ssl_server_credentials(
                [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
        self.port = self.listeners.add_port(cfg.host, cfg.port, creds)
        if not self.port:
            raise PortInUseError("gRPC", cfg.host, cfg.port, "could not be bound (in use, or the address is not local)")
        await self.listeners.start()
        self._metrics_http, self.metrics_port = start_metrics_endpoint(cfg, self.metrics)
        listening = self.model.LISTENING_EVENT
        log_listening(cfg, listening, f"gRPC listening on {cfg.host}:{self.port}", self.port, self.metrics_port)
        self._load_task = asyncio.get_running_loop().create_task(self._load())
        return self.port

    async def _load(self) -> None:
        """The model side loads; then every service says SERVING and the model side announces."""
        await self.model.load()
        await self._set_serving(True)
        self.model.announce(self.port, self.metrics_port)
        watch = HealthWatch(self.model.why_stalled, self._set_serving, check_interval(self.config.stall_timeout_s))
        self._watch_task = asyncio.get_running_loop().create_task(watch.run())

    async def _set_serving(self, serving: bool) -> None:
        """Every service SERVING, or every one NOT_SERVING (the model side stalled)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.SERVICES):
            await self.health.set(name, status)

    async def wait_loaded(self) -> None:
        """Wait for the model; re-raises a load failure."""
        await self._load_task

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new RPCs, finish in-flight ones within ``grace``.

        Streams end as soon as their requests are answered (see :class:`StreamGate`), so
        the drain takes as long as the work in flight, not the whole grace period."""
        if self._stopped:
            return
        self._stopped = True
        self.model.stop()
        grace = self.config.grace_s if grace is None else grace
        _event("draining", f"draining (grace {grace}s)", grace_s=grace)
        self.state.ready = False
        if self._watch_task is not None:
            self._watch_task.cancel()
        await self.health.enter_graceful_shutdown()  # also ends every health Watch
        self.gate.drain()  # client streams: answer what was read, then UNAVAILABLE
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        self.model.cancel()
        t0 = time.perf_counter()
        if self.listeners is not None:
            await self.listeners.stop(grace)
        await self.model.close()
        stop_metrics_endpoint(self._metrics_http)
        _event("stopped", "stopped", drain_s=round(time.perf_counter() - t0, 3))


def log_listening(cfg: ServerConfig, event: str, message: str, port: int, metrics_port: int | None,
                  **fields) -> None:
    """The bound ports and the guards on them, as one structured line."""
    _event(event, message, port=port, metrics_port=metrics_port, tls=bool(cfg.tls_cert),
           auth=bool(cfg.auth_token), metrics_tls=cfg.metrics_tls, metrics_auth=cfg.metrics_auth,
           max_streams=cfg.max_streams, version=__version__, **fields)
