"""A real TorchServe on loopback, started and stopped from Python: the tests and the
TorchServe benchmark share this launcher so it is written once.

``TorchServe(store, run_dir)`` writes a ``config.properties`` for free ports in
``port_range``, keeps the pid file, worker sockets and logs in private directories (two
TorchServes on one machine never share ``/tmp/.ts.sock.*`` or ``/tmp/.model_server.pid``)
and runs ``torchserve --foreground`` in its own process group, so ``stop`` can end the
launcher, the Java frontend and every Python worker together. Token authorization is off:
callers are loopback tests and benchmarks; never copy that into a deployment.

TorchServe's gRPC ``inference.proto`` ships only inside ``model-server.jar``:
:func:`extract_protos` takes it out, and :func:`predictions_messages` compiles it into a
private descriptor pool, so a caller in this interpreter never clashes with another
``google.rpc`` already registered (googleapis-common-protos, tritonclient).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from vqserve.core.lifetime import ending_with_this_thread

INFERENCE_SERVICE = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
PROTO_FILES = ("inference.proto", "google/rpc/status.proto")


def free_ports(n: int, port_range: tuple[int, int]) -> list[int]:
    """``n`` loopback ports in ``port_range`` (inclusive) that nothing listens on now."""
    ports = []
    for port in range(port_range[0], port_range[1] + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"fewer than {n} free ports in {port_range[0]}-{port_range[1]}")


class TorchServe:
    """``torchserve --foreground`` in its own process group; ``stop`` ends the whole group.

    ``vmargs``: JVM options (None keeps TorchServe's JVM defaults). ``threads``: the
    workers' ``OMP_NUM_THREADS`` (0 leaves the environment's). ``properties``: extra
    ``config.properties`` lines.
    """

    def __init__(self, store: Path, run_dir: Path, port_range: tuple[int, int],
                 vmargs: str | None = None, threads: int = 1,
                 properties: tuple[str, ...] = ()):
        self.inference, self.management, self.metrics, self.grpc, self.grpc_mgmt = \
            free_ports(5, port_range)
        self.run_dir = Path(run_dir)
        self.tmp = Path(tempfile.mkdtemp(prefix="vqts-"))  # short: worker socket paths live here
        self.config = self.run_dir / "config.properties"
        lines = [
            f"inference_address=http://127.0.0.1:{self.inference}",
            f"management_address=http://127.0.0.1:{self.management}",
            f"metrics_address=http://127.0.0.1:{self.metrics}",
            "grpc_inference_address=127.0.0.1", f"grpc_inference_port={self.grpc}",
            "grpc_management_address=127.0.0.1", f"grpc_management_port={self.grpc_mgmt}",
            f"initial_worker_port={self.grpc_mgmt + 1}",   # names worker sockets in self.tmp
            "disable_token_authorization=true",            # loopback tests and benchmarks only
            "enable_model_api=true", "install_py_dep_per_model=false",
            "default_workers_per_model=1", "disable_system_metrics=true",
            f"model_store={store}",
            *([f"vmargs={vmargs}"] if vmargs else []),
            *properties,
        ]
        self.config.write_text("\n".join(lines) + "\n")
        self.log = self.run_dir / "torchserve.out"
        script = Path(sys.executable).with_name("torchserve")
        env = {**os.environ, "TMPDIR": str(self.tmp), "TEMP": str(self.tmp),
               "LOG_LOCATION": str(self.run_dir / "logs"),
               "METRICS_LOCATION": str(self.run_dir / "logs")}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(script), "--start", "--ncs", "--foreground", "--model-store", str(store),
                 "--ts-config", str(self.config)],
                cwd=self.run_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self._reaper = _group_reaper(self.proc.pid, self.tmp)

    def __enter__(self) -> TorchServe:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def url(self, path: str, management: bool = False) -> str:
        return f"http://127.0.0.1:{self.management if management else self.inference}{path}"

    def wait_ready(self, timeout: float = 60) -> None:
        """Until ``/ping`` answers 200; raise with the log's tail if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"torchserve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/ping"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"torchserve not ready after {timeout}s:\n{self.tail()}")

    def register(self, archive: str, batch_size: int, max_batch_delay_ms: int, workers: int = 1,
                 timeout: float = 180) -> None:
        """Register ``<archive>.mar`` from the store; on return all ``workers`` are READY.

        ``synchronous=true`` alone is not that: TorchServe answers once the registration is
        done, and a second worker can still be starting (seen: the model described 1 of 2
        workers READY right after the answer). So the workers are awaited here, within the
        same ``timeout``, and their absence is an error naming how many came up."""
        deadline = time.monotonic() + timeout
        status, _, body = http(self.url(
            f"/models?url={archive}.mar&batch_size={batch_size}&max_batch_delay={max_batch_delay_ms}"
            f"&initial_workers={workers}&synchronous=true", management=True), method="POST",
            timeout=timeout)
        if status != 200:
            raise RuntimeError(f"registering {archive}: {status} {body!r}\n{self.tail()}")
        ready = 0
        while True:
            described = self.describe(archive)
            ready = sum(w.get("status") == "READY" for w in described.get("workers", []))
            if ready >= workers:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"registering {archive}: {ready}/{workers} worker(s) READY after "
                                   f"{timeout:.0f} s\n{self.tail()}")
            time.sleep(0.2)

    def describe(self, archive: str) -> dict:
        """The management API's description of a registered model (batching, workers)."""
        status, _, body = http(self.url(f"/models/{archive}", management=True), method="GET")
        if status != 200:
            raise RuntimeError(f"describing {archive}: {status} {body!r}")
        return json.loads(body)[0]

    def tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-4000:]

    def stop(self) -> None:
        """SIGTERM the whole group (launcher, Java frontend, Python workers), then SIGKILL."""
        if self._reaper is not None:  # ended first: this process stops the group itself
            self._reaper.kill()
            self._reaper.wait()
        end_group(self.proc.pid, self.tmp, reap=self.proc.poll)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)


def end_group(group: int, tmp: Path | str, reap=lambda: None, grace_s: float = 25.0) -> None:
    """SIGTERM process group ``group``, wait up to ``grace_s`` for all of it to go (workers
    may outlive the launcher briefly; ``reap`` collects a member that is our child, whose
    zombie would otherwise count as alive), SIGKILL what is left, remove ``tmp``."""
    def gone() -> bool:
        reap()
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        return False

    with contextlib.suppress(ProcessLookupError):  # the group may end at any point
        os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not gone():
            os.killpg(group, signal.SIGKILL)
    shutil.rmtree(tmp, ignore_errors=True)


def _reaper_main(group: int, tmp: str) -> None:
    """The reaper's life (:func:`_group_reaper`): on SIGTERM, which the kernel sends when the
    caller's thread ends, end the group."""
    def end(*_):
        end_group(group, tmp)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one that came while starting: now
    while True:
        signal.pause()


def _group_reaper(group: int, tmp: Path) -> subprocess.Popen | None:
    """A small process that ends TorchServe's process group (its own session, so no signal
    of ours reaches it) and removes its private folder when the process that started it
    ends, kill -9 included: a killed benchmark or test run leaves no Java server holding
    ports and memory. :meth:`TorchServe.stop` kills it first and stops the group itself."""

    arm = ending_with_this_thread()
    if arm is None:  # not Linux: stop() is the only way the group ends
        return None

    def start() -> None:  # SIGTERM held until the reaper's handler is in place
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        arm()

    quiet = subprocess.DEVNULL  # holds no pipe of the caller's open (a reader waiting for EOF)
    code = "import sys; from vqserve.export.torchserve.server import _reaper_main; _reaper_main(int(sys.argv[1]), sys.argv[2])"
    return subprocess.Popen([sys.executable, "-c", code, str(group), str(tmp)], stdin=quiet, stdout=quiet,
                            stderr=quiet, preexec_fn=start)


def http(url: str, body: bytes | None = None, headers: dict | None = None,
         method: str | None = None, timeout: float = 60) -> tuple[int, dict, bytes]:
    """One HTTP call: (status, lower-cased headers, body); HTTP errors are returned, not raised."""
    h = {"Content-Type": "application/octet-stream", **(headers or {})}
    req = urllib.request.Request(url, data=body, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def extract_protos(dest: Path) -> Path:
    """Copy ``inference.proto`` and the ``google/rpc/status.proto`` it imports out of
    TorchServe's ``model-server.jar`` into ``dest``; return ``dest``."""
    import ts

    jar = Path(ts.__file__).parent / "frontend" / "model-server.jar"
    with zipfile.ZipFile(jar) as z:
        for name in PROTO_FILES:
            z.extract(name, dest)
    return dest


def predictions_messages():
    """``(PredictionsRequest, PredictionResponse)`` message classes of TorchServe's gRPC
    inference API, built from the jar's own proto in a private descriptor pool."""
    import importlib.resources

    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="vqts-proto-") as tmp:
        src = extract_protos(Path(tmp) / "proto")
        out = Path(tmp) / "set.pb"
        include = str(importlib.resources.files("grpc_tools") / "_proto")
        rc = protoc.main(["protoc", f"-I{src}", f"-I{include}", f"--descriptor_set_out={out}",
                          "--include_imports", "inference.proto"])
        if rc:
            raise RuntimeError("grpc_tools.protoc failed on TorchServe's inference.proto")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for f in files.file:  # protoc lists dependencies first
        pool.Add(f)
    package = INFERENCE_SERVICE.rsplit(".", 1)[0]
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))
                 for name in ("PredictionsRequest", "PredictionResponse"))
