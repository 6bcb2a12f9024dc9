"""Operations: TLS and bearer-token auth, SIGTERM drain of a real `vqserve serve` process,
and the `vqserve encode` / `vqserve decode` client commands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from tests.helpers import ROOT, assert_matches_reference
from vqserve.export.runtimes.loader import EagerRuntime
from vqserve.serve.api import codec
from vqserve.serve.clients.sync import TokenizerClient
from vqserve.serve.config import ServerConfig
from vqserve.serve.launcher import ServerThread

pytestmark = pytest.mark.timeout(180)



def config(**kw) -> ServerConfig:
    base = dict(backend="eager", device="cpu", host="127.0.0.1", port=0, metrics_port=-1,
                max_batch_size=8, max_delay_ms=5, grace_s=5)
    return ServerConfig(**{**base, **kw})


# ---- TLS and auth -------------------------------------------------------------------------


def test_tls_and_bearer_token(tiny_checkpoint, cert, photos, tmp_path, capsys):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cert_path, key_path = cert
    cfg = config(model=tiny_checkpoint, tls_cert=str(cert_path), tls_key=str(key_path), auth_token="s3cret")
    with ServerThread(cfg) as srv:
        target = f"localhost:{srv.port}"
        ref = EagerRuntime(tiny_checkpoint).encode(photos[:2])
        with TokenizerClient(target, token="s3cret", tls_ca=cert_path, timeout=30) as c:
            np.testing.assert_array_equal(c.encode(photos[:2]), ref)
            np.testing.assert_array_equal(c.encode(photos[:2], batch_size=1), ref)  # streams too
        for token in (None, "wrong"):
            with TokenizerClient(target, token=token, tls_ca=cert_path, timeout=30) as c:
                with pytest.raises(grpc.RpcError) as err:
                    c.encode_batch(photos[:1])
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "bearer token" in err.value.details()
                with pytest.raises(grpc.RpcError) as err:
                    list(c.encode_stream([photos[:1]]))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open without a token.
        creds = grpc.ssl_channel_credentials(cert_path.read_bytes())
        with grpc.secure_channel(target, creds) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        # Plaintext to a TLS port fails.
        with TokenizerClient(f"127.0.0.1:{srv.port}", token="s3cret", timeout=5) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.encode_batch(photos[:1])
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # ... and the CLI says what to pass (was: "is `vqserve serve` running and ready there?")
        from PIL import Image

        from vqserve.cli import main

        Image.fromarray(photos[0]).save(tmp_path / "p.png")
        capsys.readouterr()
        assert main(["health", "--server", target]) == 1
        assert main(["encode", "--server", target, str(tmp_path), "--out", str(tmp_path / "tok")]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2 and all(ln.endswith("a server that serves TLS closes a plaintext connection like "
                                                   "this: then pass --tls (and --tls-ca CA.pem for a certificate "
                                                   "of your own CA)") for ln in lines), lines


# ---- a real `vqserve serve` process ------------------------------------------------------------
def start_process(args: list[str], env_extra: dict | None = None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    proc = subprocess.Popen([sys.executable, "-m", "vqserve", "serve", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    lines: list[str] = []
    ready = threading.Event()
    info: dict = {}

    def pump():
        for line in proc.stderr:
            lines.append(line)
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") == "serving":
                info.update(entry)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(120) or not info:
        proc.kill()
        raise AssertionError("server did not start:\n" + "".join(lines))
    return proc, info, lines


def in_flight(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("vqserve_requests_in_flight "):
            return float(line.split()[1])
    return 0.0


def test_sigterm_drains_without_losing_accepted_requests(tiny_checkpoint, photos):
    proc, info, lines = start_process(
        ["--model", tiny_checkpoint, "--device", "cpu", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--max-batch-size", "2", "--max-delay-ms", "0", "--grace", "60"])
    try:
        target = f"127.0.0.1:{info['port']}"
        # 16 images upscaled to 256x256: 8 batches of 2 keep the single worker busy long
        # enough that requests are still in flight when SIGTERM arrives
        images = np.concatenate([photos] * 4).repeat(4, axis=1).repeat(4, axis=2)
        n = 8
        results: list = [None] * n
        with TokenizerClient(target, timeout=120) as client:
            client.wait_ready(30)

            def call(i):
                try:
                    results[i] = client.encode_batch(images[2 * i: 2 * i + 2])
                except grpc.RpcError as exc:
                    results[i] = exc

            threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            accepted = in_flight(info["metrics_port"])
            while accepted < n and time.monotonic() < deadline:
                time.sleep(0.005)
                accepted = max(accepted, in_flight(info["metrics_port"]))
                if accepted >= 2 and all(r is None for r in results) is False:
                    break  # some already finished: drain now, while others are in flight
            assert accepted >= 2, "requests did not reach the server"
            proc.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(120)
            assert proc.wait(90) == 0, "".join(lines)
        ref = EagerRuntime(tiny_checkpoint).encode(images)
        served = 0
        for i, r in enumerate(results):
            if isinstance(r, np.ndarray):
                np.testing.assert_array_equal(r, ref[2 * i: 2 * i + 2])
                served += 1
            else:  # only requests that arrived after the drain began may be refused
                assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAVAILABLE, r
        assert served >= accepted, f"{accepted} accepted requests, only {served} answered"
        events = [json.loads(line).get("event") for line in lines if line.startswith("{")]
        assert "draining" in events and events[-1] == "stopped"
        with TokenizerClient(target, timeout=2) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.encode_batch(photos[:1])
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- client commands ---------------------------------------------------------------------------
def test_encode_and_decode_commands(tiny_checkpoint, photos, tmp_path, capsys):
    from PIL import Image

    from vqserve.cli import main

    rt = EagerRuntime(tiny_checkpoint)
    files = []
    for i, img in enumerate(photos):
        path = tmp_path / "in" / f"img{i}.png"
        path.parent.mkdir(exist_ok=True)
        Image.fromarray(img).save(path)
        files.append(str(path))
    jpg = tmp_path / "in" / "small.jpg"
    Image.fromarray(photos[0, :32, :32]).save(jpg, quality=95)
    with ServerThread(config(model=tiny_checkpoint)) as srv:
        server = ["--server", srv.target]
        assert main(["encode", *server, *files, str(jpg), "--out", str(tmp_path / "tok")]) == 0
        expected = rt.encode(photos)
        for i in range(4):
            np.testing.assert_array_equal(np.load(tmp_path / "tok" / f"img{i}.npy"), expected[i])
        assert np.load(tmp_path / "tok" / "small.npy").shape == (4, 4)

        assert main(["encode", *server, *files, "--out", str(tmp_path / "all.npy")]) == 0
        np.testing.assert_array_equal(np.load(tmp_path / "all.npy"), expected)

        capsys.readouterr()
        assert main(["encode", *server, files[0]]) == 0
        line = json.loads(capsys.readouterr().out.strip())
        assert line["shape"] == [8, 8] and np.array_equal(np.array(line["indices"]), expected[0])

        tok = [str(tmp_path / "tok" / f"img{i}.npy") for i in range(4)]
        assert main(["decode", *server, *tok, str(tmp_path / "all.npy"), "--out", str(tmp_path / "rec")]) == 0
        # Same batch composition as the server ran (one file = one request = one batch):
        # CPU conv kernels may differ by 1 LSB between batch sizes, so compare like with like;
        # and between thread counts (the server's and this process's), so within one level
        want = rt.decode(expected)
        for i in range(4):
            assert_matches_reference(codec.read_image_file(tmp_path / "rec" / f"img{i}.png"),
                                     rt.decode(expected[i: i + 1])[0], "decoded file")
            assert_matches_reference(codec.read_image_file(tmp_path / "rec" / f"all_{i}.png"), want[i], "decoded")

        bad = tmp_path / "bad.npy"
        np.save(bad, np.full((2, 2), 5000, np.uint16))
        assert main(["decode", *server, str(bad), "--out", str(tmp_path / "rec")]) == 1
        assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert main(["encode", "--server", "127.0.0.1:1", "nope.png"]) == 2  # missing file: clear error


def test_serve_flags_match_the_contract():
    from vqserve.cli import build_parser
    from vqserve.commands.common import UsageError
    from vqserve.commands.serve import config_from_args

    args = build_parser().parse_args(
        ["serve", "--model", "m", "--backend", "onnx", "--dtype", "bf16", "--device", "cpu", "--port", "0",
         "--metrics-port", "0", "--max-batch-size", "4", "--max-delay-ms", "2", "--max-queue", "9",
         "--host", "127.0.0.1"])
    cfg = config_from_args(args)
    assert (cfg.model, cfg.backend, cfg.dtype, cfg.device, cfg.port, cfg.metrics_port) == (
        "m", "onnx", "bf16", "cpu", 0, 0)
    assert config_from_args(build_parser().parse_args(["serve"])).dtype is None  # artifacts keep their dtype
    assert (cfg.max_batch_size, cfg.max_delay_ms, cfg.max_queue, cfg.host) == (4, 2.0, 9, "127.0.0.1")
    with pytest.raises(UsageError, match=r"--max-batch-size \(VQSERVE_MAX_BATCH_SIZE\) must be 1\.\."):
        config_from_args(build_parser().parse_args(["serve", "--max-batch-size", "0"]))


def test_serves_an_exported_artifact(tiny_checkpoint, photos, tmp_path):
    """`serve --model ARTIFACT_DIR` runs the exported format through load_runtime."""
    from vqserve.cli import main
    from vqserve.export.runtimes.loader import load_runtime

    art = tmp_path / "ts"
    if main(["export", "--model", tiny_checkpoint, "--format", "torchscript", "--dtype", "fp32",
             "--out", str(art)]) != 0:
        pytest.skip("`vqserve export --format torchscript` is not available in this checkout")
    rt = load_runtime(art, device="cpu")
    with ServerThread(config(model=str(art), backend="auto")) as srv, TokenizerClient(srv.target, timeout=60) as c:
        assert c.model_info()["backend"] == "torchscript"
        indices = c.encode(photos)
        np.testing.assert_array_equal(indices, rt.encode(photos))
        np.testing.assert_array_equal(c.decode(indices), rt.decode(indices))
