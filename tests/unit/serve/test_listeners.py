"""Several grpc.aio servers on one port in one process (serve/grpc_listeners.py), and
``vqserve serve --listeners N`` giving each front-end that many.

Real gRPC servers and clients on loopback; the served model is ``synthetic:N``, the
stand-in accelerator (export/runtimes/synthetic.py), since front-ends exist for GPU nodes and this
machine has none."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.helpers import ServeProcess, child_pids
from vqserve.export.runtimes.synthetic import block_tokens
from vqserve.serve.clients.sync import TokenizerClient
from vqserve.serve.grpc_listeners import Listeners

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # not the process's shared one


def listening_sockets(pid: int, port: int) -> int:
    """How many sockets process ``pid`` holds that LISTEN on TCP ``port`` (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(fields[9])
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            held.add(link[len("socket:["):-1])
    return len(inodes & held)


def _health_server(state: health.aio.HealthServicer):
    def register(server):
        health_pb2_grpc.add_HealthServicer_to_server(state, server)
    return register


def test_every_listener_binds_the_one_port_and_answers():
    """Port 0: the first server's pick binds them all; connections spread over them, and
    every one is answered by the shared services; stop ends them all."""
    async def scenario():
        servicer = health.aio.HealthServicer()
        listeners = Listeners(3, [], [], _health_server(servicer), share_port=True)
        port = listeners.add_port("127.0.0.1", 0)
        assert port > 0
        assert listening_sockets(os.getpid(), port) == 3
        await listeners.start()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION) for _ in range(12)]
        replies = await asyncio.gather(*(health_pb2_grpc.HealthStub(c).Check(health_pb2.HealthCheckRequest(),
                                                                             timeout=30) for c in channels))
        assert all(r.status == health_pb2.HealthCheckResponse.SERVING for r in replies)
        for c in channels:
            await c.close()
        await listeners.stop(None)
        for _ in range(600):  # gRPC closes its sockets on its own threads: poll (a bound, not a timing)
            if listening_sockets(os.getpid(), port) == 0:
                break
            await asyncio.sleep(0.1)
        assert listening_sockets(os.getpid(), port) == 0

    asyncio.run(scenario())


def test_a_port_that_does_not_bind_is_reported_as_zero():
    async def scenario():
        taken = Listeners(1, [], [], _health_server(health.aio.HealthServicer()), share_port=False)
        port = taken.add_port("127.0.0.1", 0)
        await taken.start()
        try:  # the first holder did not share its port: nothing else binds it
            second = Listeners(2, [], [], _health_server(health.aio.HealthServicer()), share_port=True)
            assert second.add_port("127.0.0.1", port) == 0
            await second.stop(None)
        finally:
            await taken.stop(None)

    asyncio.run(scenario())


@pytest.mark.parametrize("count, share, why", [(0, True, "at least one"), (2, False, "SO_REUSEPORT")])
def test_impossible_listener_counts_are_refused(count, share, why):
    with pytest.raises(ValueError, match=why):
        Listeners(count, [], [], lambda server: None, share_port=share)


def test_each_frontend_runs_its_listeners_and_serves_through_all():
    """``--listeners 3``: the front-end process listens three times on the port, and calls
    over many connections get the model's tokens."""
    with ServeProcess(["--model", "synthetic:50", "--frontends", "1", "--listeners", "3"]) as srv:
        frontends = child_pids(srv.proc.pid)
        assert len(frontends) == 1
        assert listening_sockets(frontends[0], srv.port) == 3
        assert listening_sockets(srv.proc.pid, srv.port) == 0  # the executor only reserves it
        for k in range(9):
            client = TokenizerClient(srv.target)
            images = np.random.default_rng(k).integers(0, 256, (1 + k % 3, 64, 64, 3), dtype=np.uint8)
            np.testing.assert_array_equal(client.encode(images), block_tokens(images))
            client.close()


def test_listeners_flag_refuses_nonsense_in_one_line():
    done = subprocess.run([sys.executable, "-m", "vqserve", "serve", "--model", "synthetic:0", "--listeners", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--listeners" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_layout_comparison_whose_servers_all_fail_reports_them():
    """``bench serve --layouts`` where no layout's server starts: each failure is a row
    naming its layout and the server's own error (it crashed with ZeroDivisionError)."""
    from vqserve.bench.load import LoadCase, compare_layouts

    images = np.zeros((1, 64, 64, 3), np.uint8)
    rows = compare_layouts("synthetic:0", {"broken": ["--listeners", "0"]}, [LoadCase("v1", "raw", 1)], images,
                           procs=1, callers=1, seconds=0.1, rounds=2, log=lambda line: None)
    assert [row["layout"] for row in rows] == ["broken"]
    assert "--listeners" in rows[0]["error"]


def test_tls_reaches_every_listener_of_a_frontend(cert):
    """Each listener binds the port with the same TLS pair: calls over many encrypted
    connections (spread over the listeners by the kernel) are all answered, and tokens
    come back through TLS."""
    cert_path, key_path = cert
    with ServeProcess(["--model", "synthetic:50", "--frontends", "1", "--listeners", "3",
                       "--tls-cert", str(cert_path), "--tls-key", str(key_path)]) as srv:
        creds = grpc.ssl_channel_credentials(cert_path.read_bytes())
        for _ in range(12):
            with grpc.secure_channel(f"localhost:{srv.port}", creds, options=OWN_CONNECTION) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
                assert status.status == health_pb2.HealthCheckResponse.SERVING
        images = np.random.default_rng(7).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
        with TokenizerClient(f"localhost:{srv.port}", tls_ca=cert_path, timeout=30) as client:
            np.testing.assert_array_equal(client.encode(images), block_tokens(images))
