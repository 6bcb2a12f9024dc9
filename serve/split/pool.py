"""The front-end processes of a GPU node: how many, on which port, started, watched and stopped.

``--frontends auto`` picks how many by the device (:func:`default_frontends`). The executor
reserves the port with ``SO_REUSEPORT`` (:func:`reserve_port`) so every front-end binds the
same one and the kernel spreads connections over them. :class:`FrontendPool` starts N
``python -m vqserve.serve.split.frontend`` processes with the settings each needs, restarts
one that dies while serving, stops them first on SIGTERM (they drain while the executor still
answers them), and they end with the executor whatever kills it (``PR_SET_PDEATHSIG``).
"""


from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from vqserve.serve.config import frontend_settings
from vqserve.serve.preflight import PortInUseError

log = logging.getLogger("vqserve.serve")


def default_frontends(device: str, cores: int) -> int:
    """Front-end processes for ``--frontends auto``: none on a CPU (the model needs the
    cores, and one process serves at the model's speed there); on an accelerator half the
    cores, 1 to 8, so request handling never waits for one GIL while the other half runs
    the executor and the clients' share. On 2 cores with synthetic:200 (`vqserve bench
    serve --client-procs 2`, 3 interleaved rounds, docs/SERVING.md) one front-end served
    8-image calls at 0.78-0.83 of the device against 0.76-0.78 with two, and 1-image calls at
    0.26-0.29 against 0.28-0.31: one wins the larger calls on so few cores."""
    if not (device.startswith("cuda") or device.startswith("synthetic")):
        return 0
    return max(1, min(8, cores // 2))


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """Bind (not listen) ``host:port`` with SO_REUSEPORT, so the front-ends can bind the same
    port and ``port`` 0 becomes one fixed port for all of them. The socket receives no
    connection (only listening sockets do) and is held until the server stops."""

    bare = host.strip("[]") or None
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PortInUseError("gRPC", host, port, f"cannot be bound ({exc})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        detail = PortInUseError.IN_USE if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
        raise PortInUseError("gRPC", host, port, detail) from None
    return sock, sock.getsockname()[1]


class FrontendPool:
    """N ``python -m vqserve.serve.split.frontend`` processes with the settings a front-end needs
    (:func:`~vqserve.serve.config.frontend_settings`: its gRPC, engine and split sections)."""

    def __init__(self, config, count: int, port: int, socket_path: str, metrics_dir: str):
        settings = frontend_settings(config, port, socket_path)
        settings["log_level"] = logging.getLevelName(logging.getLogger("vqserve").level).lower()
        self.settings = json.dumps(settings)
        self.count = count
        self.metrics_dir = metrics_dir
        self.procs: list[subprocess.Popen] = []
        self.restarts = 0
        self.serving = False  # set once every front-end served: from then on one that dies is replaced
        self._stopping = False
        self._spawning = threading.Lock()  # a replacement is started whole, or not once stop() began
        self._watch: threading.Thread | None = None

    def _spawn(self) -> subprocess.Popen:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        proc = subprocess.Popen([sys.executable, "-m", "vqserve.serve.split.frontend"], stdin=subprocess.PIPE,
                                env=env, text=True)
        proc.stdin.write(self.settings)
        proc.stdin.close()
        return proc

    def start(self) -> None:
        self.procs = [self._spawn() for _ in range(self.count)]
        self._watch = threading.Thread(target=self._watch_loop, name="vqserve-frontends", daemon=True)
        self._watch.start()

    def failed_at_start(self) -> None:
        """Raise if a front-end ended before serving (its own error line is in the log)."""
        for proc in self.procs:
            if proc.poll() is not None:
                raise ChildProcessError(f"a front-end process ended with status {proc.returncode} before "
                                        "serving (its error is logged above)")

    def _watch_loop(self) -> None:
        """Restart a front-end that dies while serving (its connections fail; new ones land
        on the others meanwhile); its metric files stop counting as live. One that ends
        before every front-end served is a start-up failure: :meth:`failed_at_start`
        reports it and the server stops, so none is started in its place."""
        from prometheus_client import multiprocess

        reaped: set[int] = set()
        while not self._stopping:
            time.sleep(0.2)
            for i, proc in enumerate(self.procs):
                if proc.poll() is None or self._stopping or proc.pid in reaped or not self.serving:
                    continue
                reaped.add(proc.pid)
                multiprocess.mark_process_dead(proc.pid, self.metrics_dir)
                if proc.returncode in (0, -signal.SIGTERM):
                    continue  # stopped on purpose
                with self._spawning:
                    if self._stopping:
                        return
                    log.warning("front-end process %d ended with status %s; starting another",
                                proc.pid, proc.returncode, extra={"fields": {"event": "frontend_restart"}})
                    self.restarts += 1
                    self.procs[i] = self._spawn()

    def stop(self, grace: float) -> None:
        """SIGTERM every front-end (each drains within ``grace``), wait, then SIGKILL."""
        with self._spawning:  # no replacement starts after this
            self._stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
