"""Assemble the grpc.aio server: both APIs on one port, health, reflection, TLS, auth,
Prometheus ``/metrics``, structured logs, and a SIGTERM drain. The parts live beside it:
auth and the stream cap in ``serve/api/gates.py``, health and reflection in
``serve/api/discovery.py``, the JSON logs in ``serve/logs.py``, the gRPC servers themselves (one,
or ``--listeners`` in a front-end) in ``serve/split/listeners.py``, the port and TLS checks made
before anything starts in ``serve/preflight.py``, the choice of execution plan and
the switch to a measured one in ``serve/engine/serving_plan.py``, the engine, batcher, front-ends
and device executor in their own modules; this one wires them and runs the lifecycle.

Lifecycle: the port is bound and health answers NOT_SERVING while the model loads (in a
worker thread); then SERVING. On SIGTERM/SIGINT health goes NOT_SERVING, the server
stops accepting RPCs, lets in-flight ones finish within ``grace_s``, flushes the batcher
and exits 0.

``ServerThread`` runs the same server on an event loop in a background thread, for
tests, benchmarks and embedding.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from vqserve import __version__
from vqserve.core.machine import available_cores
from vqserve.export.runtimes.execution import PlannedRuntime
from vqserve.serve.api import oip as service_oip
from vqserve.serve.api import v1 as service_v1
from vqserve.serve.api.discovery import (
    REFLECTION_SERVICES,
    DrainingHealthServicer,
    add_health,
    add_reflection,
)
from vqserve.serve.api.errors import Tracker
from vqserve.serve.api.gates import BearerTokenAuth, StreamGate
from vqserve.serve.engine.engine import Engine, default_batch_pixels
from vqserve.serve.engine.planning import DEFAULT_PLAN_BUDGET_S, run_in_daemon
from vqserve.serve.engine.serving_plan import ServingPlan
from vqserve.serve.logs import JsonFormatter, log, setup_logging
from vqserve.serve.logs import event as _event
from vqserve.serve.metrics import Metrics
from vqserve.serve.preflight import PortInUseError, check_port_free, check_tls_pair
from vqserve.serve.split.listeners import Listeners

__all__ = ["JsonFormatter", "ServerConfig", "ServerThread", "StreamGate", "TokenizerServer", "log",
           "serve_until_signal", "setup_logging"]


@dataclass
class ServerConfig:
    model: str = "default"
    backend: str = "auto"
    dtype: str | None = None         # None: fp32 for checkpoints, the exported dtype for artifacts
    device: str = "auto"
    host: str = "[::]"
    port: int = 50051                # 0 = ephemeral (the bound port is logged)
    metrics_port: int = 50052        # 0 = ephemeral, negative = no metrics endpoint
    metrics_host: str = "0.0.0.0"
    max_batch_size: int = 32
    max_delay_ms: float = 0.0        # a free model slot never waits for a fuller call (serve/engine/batcher.py)
    max_queue: int = 1024            # queued items (images), over all queues
    max_message_mb: int = 64         # per gRPC message, each way
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None
    grace_s: float = 30.0            # drain time on SIGTERM
    max_streams: int = 256           # open streaming calls per service (EncodeStream+DecodeStream, ...)
    expect_hash: str | None = None   # refuse a model whose model_hash differs, before loading it
    metrics_auth: bool = False       # /metrics requires the gRPC bearer token (auth_token)
    metrics_tls: bool = False        # /metrics over HTTPS with tls_cert / tls_key
    max_pixels: int | None = None    # per image (H*W); None: the runtime's own (1024*1024)
    max_batch_pixels: int | None = None  # per model call; None: default_batch_pixels(device)
    max_decoded_mb: int | None = None    # decoded PNG/JPEG in flight; None: default_decoded_bytes
    decode_threads: int | None = None    # PNG/JPEG decoding threads; None: up to 4
    micro_batch: int | None = None   # images per model call (fixed, padded); None: default_plan(device)
    model_workers: int | None = None  # model calls at once, one thread each; None: default_plan(device)
    self_check: bool = True          # measure batch invariance at start (GetModelInfo.determinism)
    threads: int | None = None       # intra-op threads per model call; None: the plan's (1 on CPU)
    cuda_graphs: bool = True         # False: never replay calls from CUDA graphs (export/runtimes/cuda_graphs.py)
    plan: str = "default"            # "auto": the cached plan, else serve the safe plan and measure in
    #                                  the background; "default": default_plan(device); else a plan
    #                                  file (`vqserve plan --out`). `vqserve serve` defaults to auto.
    plan_cache: str | None = None    # where measured plans are kept; None: export.planner.cache_dir()
    min_agreement: float = 0.995     # --dtype auto: least token agreement with fp32 for a lower dtype
    plan_budget_s: float = DEFAULT_PLAN_BUDGET_S  # --plan auto: the background measurement stops after this
    frontends: int | None = 0        # gRPC front-end processes (serve/split/frontend.py) before one device
    #                                  executor; 0: one process does everything; None: by the device
    #                                  (serve/split/executor.py default_frontends). `vqserve serve`: auto.
    executor_socket: str | None = None  # set in a front-end process: the executor it forwards to
    arena_mb: int = 0                # a front-end's shared pixel memory; 0: default_arena_bytes
    listeners: int = 8               # gRPC servers per front-end process, on its port (serve/split/listeners.py)


# ---- the server -----------------------------------------------------------------------------
class ServerState:
    """What the services read: the engine (None while loading), readiness, metrics."""

    def __init__(self, metrics: Metrics):
        self.engine: Engine | None = None
        self.ready = False
        self.metrics = metrics
        self.tracker = Tracker(metrics)


class TokenizerServer:
    SERVICES = (service_v1.SERVICE_NAME, service_oip.SERVICE_NAME)

    def __init__(self, config: ServerConfig, runtime=None):
        """``runtime``: a loaded Runtime, a zero-argument callable returning one (run in a
        worker thread while health says NOT_SERVING), or None to ``load_runtime`` from config."""
        self.config = config
        self._runtime = runtime
        # one process serves it all, or this is a front-end, or the executor behind front-ends
        self.role = "frontend" if config.executor_socket else "executor" if config.frontends else "all"
        self._metrics_dir = tempfile.mkdtemp(prefix="vqserve-metrics-") if self.role == "executor" else None
        self.metrics = Metrics(role=self.role, multiproc_dir=self._metrics_dir)
        self.executor = None   # ExecutorService, when front-ends serve
        self.pool = None       # FrontendPool
        self._reservation: socket.socket | None = None
        self.state = ServerState(self.metrics)
        self.health = DrainingHealthServicer()
        self.gate = StreamGate(config.max_streams, self.metrics,
                               (service_v1.SERVICE_NAME, health.SERVICE_NAME, *REFLECTION_SERVICES))
        self.listeners: Listeners | None = None  # the gRPC server(s) on the port
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http = None
        self._load_task: asyncio.Task | None = None
        self._plan_task: asyncio.Task | None = None
        self.plans = ServingPlan(config, self.state, self._publish)
        self._stopped = False

    async def start(self) -> int:
        """Bind and start serving (health NOT_SERVING); the model loads in the background.

        A port in use raises :class:`PortInUseError` and leaves nothing running, so the
        event loop can close without a half-started gRPC server to clean up after."""
        cfg = self.config
        if self.role != "frontend":  # its executor checked the pair and reserved the port it shares
            check_tls_pair(cfg.tls_cert, cfg.tls_key)  # one line, before any port or process
            check_port_free("gRPC", cfg.host, cfg.port)
        if cfg.metrics_port > 0:
            check_port_free("metrics", cfg.metrics_host, cfg.metrics_port)
        try:
            return await self._start()
        except BaseException:
            await self._abort_start()
            raise

    async def _abort_start(self) -> None:
        """Undo a partial :meth:`_start`: stop gRPC, the front-ends, the executor's socket and
        the metrics endpoint if they are up."""
        if self.pool is not None:
            self.pool.stop(0)
        if self.executor is not None:
            await self.executor.close()
        if self._reservation is not None:
            self._reservation.close()
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
        if self.listeners is not None:
            await self.listeners.stop(None)
            self.listeners = None
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None

    async def _start(self) -> int:
        if self.role == "executor":
            return await self._start_executor()
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

        frontend = self.role == "frontend"  # its port is shared with the other front-ends
        self.listeners = Listeners(cfg.listeners if frontend else 1,
                                   [("grpc.max_receive_message_length", limit),
                                    ("grpc.max_send_message_length", limit)],
                                   interceptors, register, share_port=frontend)
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
        self._start_metrics()
        self._listening("listening" if self.role == "all" else "frontend_listening",
                        f"gRPC listening on {cfg.host}:{self.port}")
        return self.port

    def _listening(self, event: str, msg: str, **fields) -> None:
        """Log the bound ports and settings, then load the model in the background."""
        cfg = self.config
        _event(event, msg, port=self.port, metrics_port=self.metrics_port, tls=bool(cfg.tls_cert),
               auth=bool(cfg.auth_token), metrics_tls=cfg.metrics_tls, metrics_auth=cfg.metrics_auth,
               max_streams=cfg.max_streams, version=__version__, **fields)
        self._load_task = asyncio.get_running_loop().create_task(self._load())

    async def _start_executor(self) -> int:
        """The device executor behind ``frontends`` front-end processes (serve/split/executor.py):
        reserve the port, listen for the front-ends, start them and ``/metrics``, load."""
        from vqserve.serve.split.executor import ExecutorService, FrontendPool, reserve_port

        cfg = self.config
        self._reservation, self.port = reserve_port(cfg.host, cfg.port)
        self.executor = ExecutorService(self.state)
        await self.executor.start()
        self._start_metrics()
        self.pool = FrontendPool(cfg, cfg.frontends, self.port, self.executor.path, self._metrics_dir)
        self.pool.start()
        cores = available_cores()  # what --frontends auto sized by: a container's CPU limit included
        self._listening("listening", f"gRPC listening on {cfg.host}:{self.port} ({cfg.frontends} front-end "
                        f"processes, one device executor; {cores} usable cores)", frontends=cfg.frontends,
                        cores=cores, executor_socket=self.executor.path)
        if cfg.frontends > cores:  # each starts a Python with gRPC: start-up time and memory, for no speed
            _event("frontends_exceed_cores", f"{cfg.frontends} front-end processes on {cores} cores: more "
                   "processes than cores only adds CPU per request, memory and start-up time (--frontends "
                   "auto picks half the cores, 1 to 8)", level=logging.WARNING, frontends=cfg.frontends,
                   cores=cores)
        return self.port

    def _start_metrics(self) -> None:
        cfg = self.config
        if cfg.metrics_port >= 0:
            if cfg.metrics_auth and not cfg.auth_token:
                raise ValueError("--metrics-auth needs --auth-token-file: /metrics asks for the gRPC token")
            if cfg.metrics_tls and not (cfg.tls_cert and cfg.tls_key):
                raise ValueError("--metrics-tls needs --tls-cert and --tls-key: /metrics uses the same pair")
            try:
                self._metrics_http, self.metrics_port = self.metrics.start_http(
                    cfg.metrics_port, cfg.metrics_host, token=cfg.auth_token if cfg.metrics_auth else None,
                    tls=(cfg.tls_cert, cfg.tls_key) if cfg.metrics_tls else None)
            except ssl.SSLError:
                raise  # a bad certificate or key, not a port problem
            except OSError as exc:
                detail = (PortInUseError.IN_USE if exc.errno == errno.EADDRINUSE
                          else f"could not be bound ({exc.strerror or exc})")
                raise PortInUseError("metrics", cfg.metrics_host, cfg.metrics_port, detail) from None

    async def _load(self) -> None:
        """Load the model and serve it at once: by the plan from the cache or a plan file, else
        by the safe plan while the fast one is measured in the background (serve/engine/planning.py)."""
        cfg = self.config
        if self.role == "frontend":
            return await self._load_frontend()
        t0 = time.perf_counter()
        runtime = self._runtime
        chosen, measure_later, device = None, False, cfg.device
        if runtime is None:
            from vqserve.export.runtimes.loader import load_runtime, resolve_device

            device = resolve_device(cfg.device)
            chosen, measure_later = await run_in_daemon(lambda: self.plans.find(device))
            if measure_later and cfg.dtype == "auto":  # a lower dtype changes tokens: choose before serving
                chosen, measure_later = await self.plans.measure(device, foreground=True), False

            def runtime():
                if chosen is not None:  # the planned backend: the model as given, or its export
                    return chosen.load(cfg.model, cfg.backend, device, cfg.expect_hash,
                                       artifacts=self.plans.artifacts(), log=lambda msg: _event("plan_progress", msg))
                return load_runtime(cfg.model, backend=cfg.backend, dtype=None if cfg.dtype == "auto" else cfg.dtype,
                                    device=device, expect_hash=cfg.expect_hash)  # checked before the files load
        if callable(runtime) and not hasattr(runtime, "encode"):  # a loader: run it off the loop
            runtime = await run_in_daemon(runtime)
        from vqserve.export.runtimes.loader import check_expected_hash

        check_expected_hash(cfg.expect_hash, runtime.info.model_hash, cfg.model)  # a runtime given ready-made
        source = chosen.source if chosen else ("measuring" if measure_later else
                                              "safe" if cfg.plan == "auto" else "default")
        raw = runtime
        runtime, plan, certificate = await self.plans.planned(raw, chosen.plan if chosen else None, source)
        if chosen is not None and chosen.source == "file":  # measured elsewhere: does this machine agree?
            from vqserve.export.plan.planner import check_reproduces

            await run_in_daemon(lambda: check_reproduces(raw, cfg.model, device, chosen, certificate))
        self._publish(runtime, certificate)
        max_pixels = cfg.max_pixels or runtime.info.max_pixels
        engine = Engine(runtime, self.metrics, max_batch_size=cfg.max_batch_size,
                        max_delay_s=cfg.max_delay_ms / 1000.0, max_queue=cfg.max_queue,
                        max_message_bytes=cfg.max_message_mb * 1024 * 1024, max_pixels=max_pixels,
                        max_batch_pixels=cfg.max_batch_pixels
                        or default_batch_pixels(runtime.info.device, max_pixels),
                        max_decoded_bytes=(cfg.max_decoded_mb or 0) << 20 or None,
                        decode_threads=cfg.decode_threads)
        engine.determinism = certificate
        engine.batcher.start()
        self.state.engine = engine
        self.state.ready = True
        self.metrics.queue_depth.set_function(lambda: engine.batcher.queued)
        for name in ("", *self.SERVICES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.executor is not None:  # the front-ends serve once they have the identity
            self.executor.publish()
            await self.executor.wait_ready(self.pool.count, self.pool.failed_at_start)
            self.pool.serving = True
        info = runtime.info
        tokens = "exact: the model's fp32 tokens" if info.exact else f"NOT exact: {info.dtype}, asked for"
        _event("serving", f"serving {info.backend}/{info.dtype} on {info.device} at port {self.port} ({tokens})",
               port=self.port, metrics_port=self.metrics_port, backend=info.backend, dtype=info.dtype,
               exact=info.exact, device=info.device, codebook_size=info.codebook_size, factor=info.factor,
               model_hash=info.model_hash, source_hash=info.source_hash, load_s=round(time.perf_counter() - t0, 3),
               max_batch_size=cfg.max_batch_size, max_delay_ms=cfg.max_delay_ms, max_queue=cfg.max_queue,
               max_pixels=engine.info.max_pixels, max_batch_pixels=engine.max_batch_pixels,
               max_decoded_bytes=engine.decoder.budget.limit, plan=plan.to_dict(), plan_source=source,
               frontends=self.pool.count if self.pool else 0,
               determinism=certificate.summary() if certificate else "not checked (--no-self-check)")
        if measure_later and not self._stopped:
            self._plan_task = asyncio.get_running_loop().create_task(self.plans.switch_to_measured(device))

    async def _load_frontend(self) -> None:
        """A front-end's engine: the executor's identity and limits, its batcher remote."""
        from vqserve.serve.split.frontend import connect_engine

        engine = await connect_engine(self.config, self.metrics)
        self.state.engine = engine
        self.state.ready = True
        for name in ("", *self.SERVICES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        engine.batcher.ready()
        _event("frontend_serving", f"front-end {os.getpid()} serving on port {self.port}", port=self.port,
               pid=os.getpid())

    def _publish(self, runtime: PlannedRuntime, certificate) -> None:
        """The identity, plan and start-up check of what serves now, in the metrics and logs
        (and, behind front-ends, to each of them)."""
        if self.executor is not None:
            self.executor.publish()
        info = runtime.info
        self.metrics.set_model(info)
        self.metrics.set_plan(info.backend, info.dtype, runtime.plan, runtime.source)
        self.metrics.set_determinism(certificate)
        if certificate is not None and not certificate.invariant:
            _event("not_batch_invariant", certificate.summary(), level=logging.WARNING, plan=runtime.plan.to_dict())

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
        self.plans.stop()  # a plan being measured: ended now, nothing of it cached, no switch after
        grace = self.config.grace_s if grace is None else grace
        _event("draining", f"draining (grace {grace}s)", grace_s=grace)
        self.state.ready = False
        await self.health.enter_graceful_shutdown()  # also ends every health Watch
        self.gate.drain()  # client streams: answer what was read, then UNAVAILABLE
        for task in (self._load_task, self._plan_task):
            if task is not None and not task.done():
                task.cancel()
        t0 = time.perf_counter()
        if self.listeners is not None:
            await self.listeners.stop(grace)
        if self.pool is not None:  # the front-ends drain first, while the model still answers them
            await asyncio.get_running_loop().run_in_executor(None, self.pool.stop, grace)
        if self.state.engine is not None:
            await self.state.engine.close()
        if self.executor is not None:
            await self.executor.close()
        if self._reservation is not None:
            self._reservation.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
        _event("stopped", "stopped", drain_s=round(time.perf_counter() - t0, 3))


async def serve_until_signal(config: ServerConfig, runtime=None) -> int:
    """Run until SIGTERM/SIGINT, then drain; returns the exit status (0 after a clean drain)."""
    server = TokenizerServer(config, runtime)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await server.start()
    load = asyncio.ensure_future(server.wait_loaded())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        _event("load_failed", f"could not load the model: {load.exception()}", level=logging.ERROR)
        stopper.cancel()
        await server.stop(0)
        raise load.exception()
    await stopper
    await server.stop()
    return 0


class ServerThread:
    """A TokenizerServer on its own event loop in a daemon thread.

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
            self.server = TokenizerServer(self.config, self.runtime)
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
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
