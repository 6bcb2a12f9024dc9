"""A real S3 endpoint on this machine, for the object-storage tests and ``vqserve bench
tokenize --s3``: moto in server mode on 127.0.0.1 (a subprocess on a free port, ``pip install
'moto[server]'``), behind a small HTTP proxy that logs every request (so LIST / GET / PUT can
be counted) and injects faults on demand (an HTTP status, or a connection reset, for the
requests a rule matches).

Clients reach it through the standard chain only: ``AWS_ENDPOINT_URL`` names the proxy and
the credentials are fake values (:data:`ACCESS_KEY`, :data:`SECRET_KEY`), so a test can grep
everything written for them.
"""

from __future__ import annotations

import http.client
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

ACCESS_KEY = "AKIAVQSERVETEST0001"
SECRET_KEY = "vqserve-test-secret/Zq9xW2r7Lk0pT4mN8bV6cX1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Request:
    method: str
    bucket: str
    key: str
    query: dict

    @property
    def kind(self) -> str:
        """LIST, GET, PUT, HEAD, POST or DELETE (a listing is a GET of the bucket)."""
        return "LIST" if self.is_list else self.method

    @property
    def is_list(self) -> bool:
        return self.method == "GET" and not self.key and ("list-type" in self.query or "prefix" in self.query
                                                          or not self.query)


@dataclass
class Fault:
    """Answer requests that ``match`` with ``status`` (or reset the connection when status is
    0), ``times`` times (None: always)."""

    match: Callable[[Request], bool]
    status: int = 503
    times: int | None = 1
    hits: int = 0


@dataclass
class Proxy:
    upstream: int
    log: list[Request] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fault_for(self, req: Request) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if (f.times is None or f.hits < f.times) and f.match(req):
                    f.hits += 1
                    return f
        return None

    def requests(self, bucket: str | None = None) -> list[Request]:
        with self.lock:
            return [r for r in self.log if bucket is None or r.bucket == bucket]


def _handler(proxy: Proxy):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return data
                    data += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _control(self) -> None:
            """``/__proxy__/log``: the request log as JSON lines (kind bucket key), then cleared."""
            with proxy.lock:
                lines = "".join(f"{r.kind} {r.bucket} {r.key}\n" for r in proxy.log)
                proxy.log.clear()
            data = lines.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _forward(self):
            if self.path.startswith("/__proxy__/"):
                return self._control()
            parts = urlsplit(self.path)
            bucket, _, key = parts.path.lstrip("/").partition("/")
            req = Request(self.command, bucket, key, parse_qs(parts.query, keep_blank_values=True))
            body = self._body()
            with proxy.lock:
                proxy.log.append(req)
            fault = proxy.fault_for(req)
            if fault is not None and fault.status == 0:  # a reset mid-request
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                self.connection.close()
                self.close_connection = True
                return
            if fault is not None:
                payload = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                           b"<Message>injected</Message></Error>")
                self.send_response(fault.status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("transfer-encoding", "connection", "expect")}
            headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=60)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
            finally:
                conn.close()
            self.send_response(answer.status)
            for k, v in answer.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                    self.send_header(k, v)
            length = answer.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


def moto_client(port: int):
    """A boto3 client straight to moto (not through the proxy: set-up requests stay out of its log)."""
    import boto3

    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)


class ObjectStore:
    """moto's S3 on a free port with the logging, fault-injecting proxy in front."""

    def __init__(self, workdir):
        self.moto_port = free_port()
        env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": "256", "MOTO_CALL_RESET_API": "false"}
        self.log_path = os.path.join(workdir, "moto.log")
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                         str(self.moto_port)], stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.moto_port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start (see {self.log_path})") from None
                time.sleep(0.1)
        self.proxy = Proxy(self.moto_port)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.proxy))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="s3-proxy")
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def env(self) -> dict:
        return endpoint_env(self.endpoint)

    def client(self):
        return moto_client(self.moto_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def endpoint_env(endpoint: str) -> dict:
    """The standard chain's variables that reach ``endpoint`` with the fake credentials."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_ENDPOINT_URL": endpoint,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def fetch_log(endpoint: str) -> list[tuple[str, str, str]]:
    """A proxy's request log (``kind bucket key``) through its control path, then cleared: for
    a proxy in another process."""
    conn = http.client.HTTPConnection(endpoint.split("//", 1)[1], timeout=30)
    try:
        conn.request("GET", "/__proxy__/log")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return [tuple((line + "  ").split(" ", 2)) for line in text.splitlines()]


def serve() -> None:
    """``python -m vqserve.bench.s3_endpoint``: the endpoint in a process of its own (so its proxy
    takes no CPU or GIL from the process it measures). Prints one JSON line (endpoint, moto's
    pid) and serves until stdin closes."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="vqserve-s3-endpoint-") as workdir:
        store = ObjectStore(workdir)
        try:
            print(json.dumps({"endpoint": store.endpoint, "moto_port": store.moto_port,
                              "moto_pid": store.process.pid}), flush=True)
            sys.stdin.read()
        finally:
            store.close()


if __name__ == "__main__":
    serve()
