"""`vqserve health`: the container HEALTHCHECK and the humans' probe, against a real server."""

from __future__ import annotations

import socket

import pytest

from vqserve.cli import main
from vqserve.serve.config import ServerConfig
from vqserve.serve.launcher import ServerThread

pytestmark = pytest.mark.timeout(120)


def test_health_command_against_a_live_server(tiny_checkpoint, capsys):
    cfg = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1", port=0,
                       metrics_port=-1, auth_token="secret", grace_s=2)
    with ServerThread(cfg) as srv:
        assert main(["health", "--server", srv.target]) == 0  # no token needed for health
        assert capsys.readouterr().out.strip() == f"{srv.target}: SERVING"
        assert main(["health", "--server", srv.target, "--service", "vqserve.v1.Tokenizer"]) == 0
        assert main(["health", "--server", srv.target, "--service", "no.such.Service"]) == 1
        assert "NOT_FOUND" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["health", "--server", f"127.0.0.1:{port}", "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert "unreachable" in err and "Traceback" not in err
