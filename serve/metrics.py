"""Prometheus metrics for the service, in a registry of its own (names prefixed ``vqserve_``).

- ``vqserve_request_latency_seconds{method}``: whole RPC (or stream message) latency
- ``vqserve_queue_wait_seconds{method}``, ``vqserve_inference_seconds{method}``,
  ``vqserve_batch_size{method}``: per batch, ``method`` = encode | decode
- ``vqserve_requests_in_flight``: gauge
- ``vqserve_requests_total{method,code}``, ``vqserve_errors_total{method,code}``,
  ``vqserve_items_total{method}``: counters
- ``vqserve_codebook_usage_ratio{method}``, ``vqserve_codebook_entropy_bits{method}``,
  ``vqserve_codebook_perplexity{method}``, ``vqserve_codebook_window_tokens{method}``:
  codebook use of the served traffic over a sliding window of recent tokens (encode
  outputs / decode inputs), so codebook collapse or drift shows in production.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vqserve.model.evaluation import codebook_stats

# Requests take 1 ms .. 10 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class CodebookUsage:
    """Counts of codes over a sliding window of the most recent ``window`` tokens."""

    def __init__(self, codebook_size: int, window: int = 1 << 20):
        self.codebook_size = int(codebook_size)
        self.window = int(window)
        self._counts = np.zeros(self.codebook_size, dtype=np.int64)
        self._chunks: collections.deque[np.ndarray] = collections.deque()
        self._total = 0
        self._lock = threading.Lock()

    def add(self, indices: np.ndarray) -> None:
        flat = np.asarray(indices).reshape(-1)
        if flat.size == 0:
            return
        if flat.size > self.window:
            flat = flat[-self.window:]
        flat = flat.astype(np.int64, copy=False)
        flat = flat[(flat >= 0) & (flat < self.codebook_size)]
        with self._lock:
            self._update(flat, +1)
            self._chunks.append(flat)
            self._total += flat.size
            while self._total > self.window and self._chunks:
                old = self._chunks.popleft()
                self._update(old, -1)
                self._total -= old.size

    def _update(self, flat: np.ndarray, sign: int) -> None:
        if flat.size * 4 < self.codebook_size:  # sparse update beats a full bincount
            np.add.at(self._counts, flat, sign)
        else:
            self._counts += sign * np.bincount(flat, minlength=self.codebook_size)

    def stats(self) -> dict:
        with self._lock:
            counts = torch.from_numpy(self._counts.copy())
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


class Metrics:
    def __init__(self, codebook_size: int | None = None, window: int = 1 << 20):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_latency = Histogram(
            "vqserve_request_latency_seconds", "Request latency, receipt to response, by RPC method.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "vqserve_queue_wait_seconds", "Time a request waited in the batcher queue.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.inference = Histogram(
            "vqserve_inference_seconds", "Model time per batch.",
            ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(
            "vqserve_batch_size", "Items (images) per model call.",
            ["method"], buckets=BATCH_BUCKETS, registry=r)
        self.in_flight = Gauge("vqserve_requests_in_flight", "Requests being served now.", registry=r)
        self.requests = Counter("vqserve_requests", "Requests by RPC method and status code.",
                                ["method", "code"], registry=r)
        self.errors = Counter("vqserve_errors", "Failed requests by RPC method and status code.",
                              ["method", "code"], registry=r)
        self.items = Counter("vqserve_items", "Images encoded or decoded.", ["method"], registry=r)
        self.queue_depth = Gauge("vqserve_queue_items", "Items waiting in the batcher queue.", registry=r)
        self.usage: dict[str, CodebookUsage] = {}
        if codebook_size:
            self.set_codebook(codebook_size, window)

    def set_codebook(self, codebook_size: int, window: int = 1 << 20) -> None:
        self.usage = {m: CodebookUsage(codebook_size, window) for m in ("encode", "decode")}
        self.registry.register(CodebookCollector(self.usage))

    def observe_batch(self, stats) -> None:
        """Observer for :class:`vqserve.serve.batcher.Batcher`."""
        self.batch_size.labels(stats.method).observe(stats.size)
        self.inference.labels(stats.method).observe(stats.inference_s)
        for w in stats.queue_waits:
            self.queue_wait.labels(stats.method).observe(w)
        if stats.ok:
            self.items.labels(stats.method).inc(stats.size)

    def record_codes(self, method: str, indices: np.ndarray) -> None:
        tracker = self.usage.get(method)
        if tracker is not None:
            tracker.add(indices)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def start_http(self, port: int, host: str = "0.0.0.0"):
        """Serve ``/metrics`` on ``host:port`` (0 = ephemeral); returns (server, bound port)."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port
