"""``TorchServe.register`` returns only once every worker asked for is READY.

Regression: TorchServe answers a ``synchronous=true`` registration while a second worker can
still be starting; `vqserve bench serve` then logged "1/2 worker(s) ready" and measured a
TorchServe with one worker (the integration test saw it at random, describe showing both
READY a moment later). The race cannot be provoked on purpose in a real TorchServe, so its
management API is played here by a small HTTP server that answers the moment the race needs:
one worker READY at the first describe, both at a later one.
"""

from __future__ import annotations

import json
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vqserve.export.torchserve.server import TorchServe


def _management_api(ready_after: list[int]):
    """An HTTP server answering register (200) and describe: the n-th describe reports
    ``ready_after[n]`` READY workers of 2 (the last count repeats)."""
    calls = {"describe": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802 (http.server's name)
            self._reply(b'{"status": "registered"}')

        def do_GET(self):  # noqa: N802
            n = ready_after[min(calls["describe"], len(ready_after) - 1)]
            calls["describe"] += 1
            workers = [{"status": "READY"}] * n + [{"status": "UNLOADING"}] * (2 - n)
            self._reply(json.dumps([{"batchSize": 8, "workers": workers}]).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, calls


def _torchserve_at(port: int, tmp_path) -> TorchServe:
    ts = object.__new__(TorchServe)  # the object's HTTP side only: no Java server is started
    ts.management = ts.inference = port
    ts.proc = types.SimpleNamespace(poll=lambda: None)
    ts.log = tmp_path / "ts_log.log"
    return ts


def test_register_waits_until_every_worker_is_ready(tmp_path):
    server, calls = _management_api([1, 1, 2])
    try:
        ts = _torchserve_at(server.server_address[1], tmp_path)
        ts.register("vqserve-encode", 8, 5, workers=2, timeout=30)
        assert calls["describe"] == 3
        assert [w["status"] for w in ts.describe("vqserve-encode")["workers"]] == ["READY", "READY"]
    finally:
        server.shutdown()


def test_workers_that_never_come_up_are_an_error_naming_the_count(tmp_path):
    server, _ = _management_api([1])
    try:
        ts = _torchserve_at(server.server_address[1], tmp_path)
        with pytest.raises(RuntimeError, match=r"registering vqserve-encode: 1/2 worker\(s\) READY after 1 s"):
            ts.register("vqserve-encode", 8, 5, workers=2, timeout=1)
    finally:
        server.shutdown()
