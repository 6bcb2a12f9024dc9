"""Prometheus metrics for the service, in a registry of its own (names prefixed ``vqserve_``).

- ``vqserve_request_latency_seconds{method}``: whole RPC (or stream message) latency
- ``vqserve_queue_wait_seconds{method}``, ``vqserve_inference_seconds{method}``,
  ``vqserve_batch_size{method}``: per batch, ``method`` = encode | decode
- ``vqserve_requests_in_flight``: gauge; ``vqserve_streams_open{service}``: open streams
- ``vqserve_model_info{model_hash,source_hash,backend,dtype,device,exact}``: 1, the served model's
  identity (exact="true": the tokens of the model in fp32 eager)
- ``vqserve_batch_invariant{what}``: 1 when the start-up check found ``what`` (tokens |
  pixels) identical in every batch composition tried, 0 when not, -1 when not checked
- ``vqserve_requests_total{method,code}``, ``vqserve_errors_total{method,code}``,
  ``vqserve_items_total{method}``: counters
- ``vqserve_codebook_usage_ratio{method}``, ``vqserve_codebook_entropy_bits{method}``,
  ``vqserve_codebook_perplexity{method}``, ``vqserve_codebook_window_tokens{method}``:
  codebook use of the served traffic over a sliding window of recent tokens (encode
  outputs / decode inputs), so codebook collapse or drift shows in production.
"""

from __future__ import annotations

import errno
import math
import ssl
import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vqserve.core.codebook import codebook_stats
from vqserve.serve.preflight import PortInUseError

# Requests take 1 ms .. 10 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class CodebookUsage:
    """Counts of codes over a sliding window of the most recent ``window`` tokens.

    The window is a ring buffer in the narrowest dtype that holds every code, allocated and
    written once at start (2 MB for 2^20 uint16 codes): the server's memory does not grow
    as traffic fills it (a deque of int64 copies grew by ~10 MB per method over minutes,
    which a soak test reads as a leak)."""

    def __init__(self, codebook_size: int, window: int = 1 << 20):
        self.codebook_size = int(codebook_size)
        self.window = int(window)
        self._counts = np.zeros(self.codebook_size, dtype=np.int64)
        dtype = np.uint16 if self.codebook_size <= 1 << 16 else np.uint32 if self.codebook_size <= 1 << 32 else np.uint64
        self._ring = np.full(self.window, 0, dtype=dtype)  # written now, so its pages are resident now
        self._pos = 0
        self._total = 0
        self._lock = threading.Lock()
        # Codes seen but not yet counted: a request costs one small copy, and the counting
        # (a bincount or np.add.at, ~50 µs for one 256x256 image) happens once per
        # PENDING_TOKENS tokens or per scrape, in whichever thread gets there
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0

    PENDING_TOKENS = 1 << 16

    def add(self, indices: np.ndarray) -> None:
        """Count ``indices`` (copied now: the caller may reuse its buffer)."""
        flat = np.asarray(indices).reshape(-1)
        if flat.size == 0 or flat.dtype.kind not in "iu":
            return
        if flat.size > self.window:
            flat = flat[-self.window:]
        # valid codes only, in the ring's dtype: a copy, so the caller's buffer may be reused
        flat = flat[(flat >= 0) & (flat < self.codebook_size)].astype(self._ring.dtype)
        with self._lock:
            self._pending.append(flat)
            self._pending_tokens += flat.size
            if self._pending_tokens < self.PENDING_TOKENS:
                return
        self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending, self._pending_tokens = self._pending, [], 0
        if pending:
            self._count(np.concatenate(pending) if len(pending) > 1 else pending[0])

    def _count(self, flat: np.ndarray) -> None:
        if flat.size > self.window:
            flat = flat[-self.window:]
        with self._lock:
            start, filled = self._pos, self._total
            first = min(flat.size, self.window - start)
            for lo, part in ((start, flat[:first]), (0, flat[first:])):
                if not part.size:
                    continue
                hi = lo + part.size
                if lo < filled:  # evict the oldest codes this slice overwrites
                    self._update(self._ring[lo:min(hi, filled)], -1)
                self._ring[lo:hi] = part
                self._update(part, +1)
            self._pos = (start + flat.size) % self.window
            self._total = min(self.window, filled + flat.size)

    def _update(self, flat: np.ndarray, sign: int) -> None:
        flat = flat.astype(np.intp, copy=False)
        if flat.size * 4 < self.codebook_size:  # sparse update beats a full bincount
            np.add.at(self._counts, flat, sign)
        else:
            self._counts += sign * np.bincount(flat, minlength=self.codebook_size)

    def stats(self) -> dict:
        self.flush()
        with self._lock:
            counts = self._counts.copy()
        s = codebook_stats(counts)
        return {"usage": s["utilization"], "entropy_bits": s["entropy_bits"],
                "perplexity": s["perplexity"], "tokens": s["positions"]}


class CodebookCollector(Collector):
    """The codebook gauges, computed once per scrape (not once per gauge)."""

    GAUGES = {
        "usage": ("vqserve_codebook_usage_ratio",
                  "Fraction of the codebook seen in the recent-token window."),
        "entropy_bits": ("vqserve_codebook_entropy_bits",
                         "Entropy (bits) of code frequencies in the window."),
        "perplexity": ("vqserve_codebook_perplexity",
                       "2**entropy: the effective number of codes in use."),
        "tokens": ("vqserve_codebook_window_tokens", "Tokens in the codebook-usage window."),
    }

    def __init__(self, usage: dict[str, CodebookUsage]):
        self.usage = usage

    def collect(self):
        stats = {method: tracker.stats() for method, tracker in self.usage.items()}
        for key, (name, doc) in self.GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["method"])
            for method, s in stats.items():
                family.add_metric([method], s[key])
            yield family


class _Unrecorded:
    """A metric this process does not own (see :class:`Metrics`' ``role``): every update is
    a no-op, so the code that records it needs no branch."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self


ROLES = ("all", "frontend", "executor")


class Metrics:
    """The service's metrics in one registry.

    ``role``: ``all`` (one process serves everything); with front-end processes, each front-end
    records the request metrics (latency, codes, in-flight, streams) in prometheus-client's
    multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, set for it by the executor), and the
    executor records the model metrics (queue wait, batches, inference, identity, plan, codebook
    use) and serves ``/metrics`` with both: its own registry plus the front-ends' files summed
    (``multiproc_dir``). Each metric is owned by exactly one process, so none is counted twice
    and none is missing."""

    def __init__(self, codebook_size: int | None = None, window: int = 1 << 20, role: str = "all",
                 multiproc_dir: str | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if multiproc_dir:
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(r, path=multiproc_dir)
        self._define(r, {"frontend": self.MODEL_METRICS, "executor": self.REQUEST_METRICS}.get(role, ()))
        for method in ("encode", "decode"):  # exported at zero where no front-end sends groups (one process)
            self.group_size.labels(method)
        self.usage: dict[str, CodebookUsage] = {}
        if codebook_size:
            self.set_codebook(codebook_size, window)

    REQUEST_METRICS = ("request_latency", "in_flight", "requests", "errors", "streams_open", "group_size")
    MODEL_METRICS = ("queue_wait", "inference", "batch_size", "items", "queue_depth", "model_info",
                     "batch_invariant", "plan_info")

    def _define(self, r: CollectorRegistry, skip: tuple[str, ...]) -> None:
        def make(name: str, factory) -> None:  # a metric another process owns is never created here:
            setattr(self, name, _Unrecorded() if name in skip else factory())  # (its file would count it twice)

        make("request_latency", lambda: Histogram(
            "vqserve_request_latency_seconds", "Request latency, receipt to response, by RPC method.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r))
        make("queue_wait", lambda: Histogram(
            "vqserve_queue_wait_seconds", "Time a request waited in the batcher queue.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r))
        make("inference", lambda: Histogram(
            "vqserve_inference_seconds", "Model time per batch.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r))
        make("batch_size", lambda: Histogram(
            "vqserve_batch_size", "Items (images) per model call.",
            ["method"], buckets=BATCH_BUCKETS, registry=r))
        make("group_size", lambda: Histogram(
            "vqserve_group_size", "Requests per group a front-end process sends to the device executor "
            "(front-ends only: one process serving everything sends none).",
            ["method"], buckets=BATCH_BUCKETS, registry=r))
        make("in_flight", lambda: Gauge("vqserve_requests_in_flight", "Requests being served now.", registry=r,
                               multiprocess_mode="livesum"))
        make("requests", lambda: Counter("vqserve_requests", "Requests by RPC method and status code.",
                                ["method", "code"], registry=r))
        make("errors", lambda: Counter("vqserve_errors", "Failed requests by RPC method and status code.",
                              ["method", "code"], registry=r))
        make("items", lambda: Counter("vqserve_items", "Images encoded or decoded.", ["method"], registry=r))
        make("queue_depth", lambda: Gauge("vqserve_queue_items", "Items waiting in the batcher queue.", registry=r))
        make("streams_open", lambda: Gauge("vqserve_streams_open", "Open streaming calls, by gRPC service "
                                  "(at most --max-streams each).", ["service"], registry=r,
                                  multiprocess_mode="livesum"))
        make("model_info", lambda: Gauge("vqserve_model_info", "1 for the model being served; its identity "
                                "is in the labels (model_hash: sha256 over every file loaded; source_hash: "
                                "the checkpoint whose tokens these are; exact: true when they are that "
                                "checkpoint's fp32 eager tokens).",
                                ["model_hash", "source_hash", "backend", "dtype", "device", "exact"], registry=r))
        make("batch_invariant", lambda: Gauge("vqserve_batch_invariant", "1 when the start-up check found "
                                     "tokens (what=tokens) or decoded pixels (what=pixels) "
                                     "independent of the batch; 0 when not; -1 not checked.",
                                     ["what"], registry=r))
        make("plan_info", lambda: Gauge("vqserve_execution_plan", "1 for the execution plan every model call "
                               "runs by; the plan is in the labels (micro_batch: per image side when "
                               "measured, e.g. '64:8 256:1'; source: safe (serving before or without a "
                               "measurement), measuring (safe, a measurement running in the background), "
                               "measured, cache, file (--plan FILE) or default (--plan default); "
                               "'+flags' when flags overrode part of it).",
                               ["backend", "dtype", "micro_batch", "workers", "intra_op_threads", "source"],
                               registry=r))

    def set_codebook(self, codebook_size: int, window: int = 1 << 20) -> None:
        if self.role == "frontend":  # the executor sees every token: it keeps the window
            return
        self.usage = {m: CodebookUsage(codebook_size, window) for m in ("encode", "decode")}
        self.registry.register(CodebookCollector(self.usage))

    def observe_batch(self, stats) -> None:
        """Observer for :class:`vqserve.serve.engine.batcher.Batcher`."""
        self.batch_size.labels(stats.method).observe(stats.size)
        self.inference.labels(stats.method).observe(stats.inference_s)
        for w in stats.queue_waits:
            self.queue_wait.labels(stats.method).observe(w)
        if stats.ok:
            self.items.labels(stats.method).inc(stats.size)

    def observe_group(self, method: str, requests: int) -> None:
        """Observer for a front-end's :class:`vqserve.serve.split.frontend.RemoteBatcher`."""
        self.group_size.labels(method).observe(requests)

    def record_codes(self, method: str, indices: np.ndarray) -> None:
        tracker = self.usage.get(method)
        if tracker is not None:
            tracker.add(indices)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def set_model(self, info) -> None:
        """Publish the served model's identity (a ``RuntimeInfo``) as ``vqserve_model_info``."""
        self.model_info.clear()  # one series: the model served now (a measured plan can switch backend)
        self.model_info.labels(info.model_hash, info.source_hash or info.model_hash, info.backend, info.dtype,
                               info.device, str(bool(info.exact)).lower()).set(1)

    def set_plan(self, backend: str, dtype: str, plan, source: str) -> None:
        """Publish the execution plan (an ``ExecutionPlan``) as ``vqserve_execution_plan``
        (one series: the plan every call runs by now)."""
        micro = " ".join(f"{math.isqrt(p)}:{m}" for p, m in plan.micro_batch_by_pixels) or str(plan.micro_batch)
        self.plan_info.clear()
        self.plan_info.labels(backend, dtype, micro, str(plan.workers), str(plan.intra_op_threads), source).set(1)

    def set_determinism(self, certificate) -> None:
        """Publish the start-up batch-invariance check (a ``Certificate`` or None)."""
        for what, attr in (("tokens", "batch_invariant"), ("pixels", "decode_batch_invariant")):
            value = -1 if certificate is None else int(bool(getattr(certificate, attr)))
            self.batch_invariant.labels(what).set(value)

    def start_http(self, port: int, host: str = "0.0.0.0", token: str | None = None,
                   tls: tuple[str, str] | None = None):
        """Serve ``/metrics`` on ``host:port`` (0 = ephemeral); returns (server, bound port).

        ``token``: every scrape must send ``Authorization: Bearer <token>`` (else 401).
        ``tls``: (cert, key) PEM files; the endpoint speaks HTTPS only. Both are opt-in
        because a scraper must be configured to match (docs/SERVING.md, "Security")."""
        import socket
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client import make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer

        app = make_wsgi_app(self.registry)
        if token:
            app = _bearer_only(app, token)
        context = None
        if tls is not None:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls[0], tls[1])

        class Server(ThreadingWSGIServer):
            address_family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]

            def finish_request(self, request, client_address):
                if context is not None:  # handshake here, in the request's thread, not in accept()
                    request.settimeout(10)
                    try:
                        request = context.wrap_socket(request, server_side=True)
                    except OSError:  # plaintext or a failed handshake: drop the connection
                        return
                super().finish_request(request, client_address)

        class Quiet(WSGIRequestHandler):
            def log_message(self, *args) -> None:  # scrapes are not log lines
                pass

        server = make_server(host, port, app, Server, handler_class=Quiet)
        threading.Thread(target=server.serve_forever, name="vqserve-metrics", daemon=True).start()
        return server, server.server_port


def _bearer_only(app, token: str):
    """A WSGI app that answers 401 unless ``Authorization: Bearer <token>`` is sent (compared
    in constant time, as the gRPC interceptor does)."""
    import hmac

    expected = f"Bearer {token}".encode()

    def guarded(environ, start_response):
        got = environ.get("HTTP_AUTHORIZATION", "").encode()
        if hmac.compare_digest(got, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                             ("WWW-Authenticate", 'Bearer realm="vqserve metrics"')])
        return [b"missing or wrong bearer token: send 'Authorization: Bearer <token>'\n"]

    return guarded


def start_metrics_endpoint(cfg, metrics: Metrics):
    """``/metrics`` of a serving process as ``cfg`` asks (its ``metrics_*`` settings): returns
    (HTTP server, bound port), or (None, None) when ``metrics_port`` is negative. A port in
    use is a :class:`~vqserve.serve.preflight.PortInUseError`; a bad certificate or key its
    own ``ssl.SSLError``."""
    if cfg.metrics_port < 0:
        return None, None
    if cfg.metrics_auth and not cfg.auth_token:
        raise ValueError("--metrics-auth needs --auth-token-file: /metrics asks for the gRPC token")
    if cfg.metrics_tls and not (cfg.tls_cert and cfg.tls_key):
        raise ValueError("--metrics-tls needs --tls-cert and --tls-key: /metrics uses the same pair")
    try:
        return metrics.start_http(cfg.metrics_port, cfg.metrics_host,
                                  token=cfg.auth_token if cfg.metrics_auth else None,
                                  tls=(cfg.tls_cert, cfg.tls_key) if cfg.metrics_tls else None)
    except ssl.SSLError:
        raise  # a bad certificate or key, not a port problem
    except OSError as exc:
        detail = (PortInUseError.IN_USE if exc.errno == errno.EADDRINUSE
                  else f"could not be bound ({exc.strerror or exc})")
        raise PortInUseError("metrics", cfg.metrics_host, cfg.metrics_port, detail) from None


def stop_metrics_endpoint(http) -> None:
    """Stop an endpoint :func:`start_metrics_endpoint` started (None: nothing to stop)."""
    if http is not None:
        http.shutdown()
        http.server_close()
