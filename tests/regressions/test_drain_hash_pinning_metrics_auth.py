"""Hardening (issue 13, items 6, 8 and 10): each test reproduced its problem before the fix.

* 6: a SIGTERM drain waited the whole grace period whenever a health Watch or an idle
  EncodeStream was open, and any number of idle streams was accepted.
* 8: a re-hashed pt2 artifact (its manifest's hashes updated to match the tampered files)
  carrying a pickle payload ran code in `vqserve serve`; a checkpoint's model_hash covered
  its weights only. Now `--expect-hash` refuses any other model before anything loads.
* 10: /metrics could not require the gRPC bearer token or TLS.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import queue
import re
import shutil
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vqserve.cli import main as cli_main
from vqserve.core.files import sha256_file
from vqserve.core.identity import ModelHashMismatch
from vqserve.export.runtimes.loader import EagerRuntime, load_runtime, model_hash_of
from vqserve.model.checkpoint import checkpoint_hash
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc
from vqserve.serve.api.gates import StreamGate
from vqserve.serve.clients import TokenizerClient, tensor_msg
from vqserve.serve.config import ServerConfig
from vqserve.serve.launcher import ServerThread

pytestmark = pytest.mark.timeout(180)

SERVICE = "vqserve.v1.Tokenizer"


def config(model: str, **kw) -> ServerConfig:
    base = dict(model=model, backend="eager", device="cpu", host="127.0.0.1", port=0, metrics_port=-1,
                max_batch_size=8, max_delay_ms=0, grace_s=30)
    return ServerConfig(**{**base, **kw})


def metrics_text(srv, scheme: str = "http", token: str | None = None, ca: Path | None = None) -> str:
    request = urllib.request.Request(f"{scheme}://127.0.0.1:{srv.metrics_port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    return urllib.request.urlopen(request, timeout=10, context=context).read().decode()


def metric(text: str, name: str, **labels) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(sel) + r"\}" if sel else "") + r" (\S+)$"
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def open_stream(channel, method: str = "EncodeStream"):
    """A bidirectional stream fed from a queue (``None`` half-closes it)."""
    requests: queue.Queue = queue.Queue()
    responses = getattr(pb_grpc.TokenizerStub(channel), method)(iter(requests.get, None))
    return requests, responses


def encode_request(images: np.ndarray, request_id: str = "") -> pb.EncodeRequest:
    return pb.EncodeRequest(images=tensor_msg(images), request_id=request_id)


class SlowRuntime:
    """The real tiny runtime, slowed down so a request is surely in flight at SIGTERM."""

    def __init__(self, inner, delay: float):
        self.inner, self.info, self.delay = inner, inner.info, delay
        self.started = threading.Event()

    def encode(self, x):
        self.started.set()
        time.sleep(self.delay)
        return self.inner.encode(x)

    def decode(self, x):
        return self.inner.decode(x)


# ---- item 6: drain ends idle streams at once; a cap on open streams ------------------------------
def test_drain_ends_idle_streams_at_once_and_answers_what_was_accepted(tiny_checkpoint, photos):
    """Was: stop(grace=30) took the full 30 s with one idle EncodeStream or health Watch open."""
    slow = SlowRuntime(EagerRuntime(tiny_checkpoint, device="cpu"), delay=0.5)
    srv = ServerThread(config(tiny_checkpoint), runtime=slow).start()
    channel = grpc.insecure_channel(srv.target)
    try:
        ref = slow.inner.encode(photos[:2])
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        _idle_q, idle = open_stream(channel)
        busy_q, busy = open_stream(channel)
        busy_q.put(encode_request(photos[:1], "busy"))
        unary: dict = {}
        caller = threading.Thread(target=lambda: unary.update(
            out=pb_grpc.TokenizerStub(channel).Encode(encode_request(photos[1:2]), timeout=60)))
        caller.start()
        assert slow.started.wait(30), "no request reached the model"
        wait_for(lambda: srv.server.gate.open.get(SERVICE) == 2 and srv.server.gate.open.get(
            "grpc.health.v1.Health") == 1 and srv.server.metrics.in_flight._value.get() >= 2)
        t0 = time.monotonic()
        srv.stop(grace=30)
        took = time.monotonic() - t0
        caller.join(30)
        assert took < 5, f"the drain took {took:.1f} s of its 30 s grace"
        # the accepted requests were answered: the unary call, and the stream's one message
        np.testing.assert_array_equal(np.frombuffer(unary["out"].indices.data, np.uint16).reshape(1, 8, 8),
                                      ref[1:2])
        first = next(busy)
        assert first.request_id == "busy" and not first.HasField("error")
        np.testing.assert_array_equal(np.frombuffer(first.indices.data, np.uint16).reshape(1, 8, 8), ref[:1])
        for stream in (busy, idle):  # then each stream ends, saying why
            with pytest.raises(grpc.RpcError) as err:
                next(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in err.value.details()
        rest = list(watch)  # the watch saw NOT_SERVING, then ended cleanly
        assert [r.status for r in rest] == [health_pb2.HealthCheckResponse.NOT_SERVING]
    finally:
        channel.close()
        srv.stop(grace=0)


def test_streams_over_the_cap_are_refused_and_counted(tiny_checkpoint, photos):
    """Was: any number of idle streams was accepted (2,000 in the reproduction)."""
    cfg = config(tiny_checkpoint, max_streams=2, metrics_port=0, grace_s=2)
    with ServerThread(cfg) as srv:
        channel = grpc.insecure_channel(srv.target)
        try:
            opened = []
            for i in range(2):
                q, responses = open_stream(channel)
                q.put(encode_request(photos[:1], f"s{i}"))
                assert next(responses).request_id == f"s{i}"  # admitted and answering
                opened.append((q, responses))
            for method in ("EncodeStream", "DecodeStream"):  # one cap for the service's streams
                _q, refused = open_stream(channel, method)
                with pytest.raises(grpc.RpcError) as err:
                    next(refused)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "allows 2 at once (--max-streams)" in err.value.details()
            # health watches count apart: token-less watchers cannot crowd out streams, nor these them
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
            text = metrics_text(srv)
            assert metric(text, "vqserve_requests_total", method="EncodeStream", code="RESOURCE_EXHAUSTED") == 1
            assert metric(text, "vqserve_errors_total", method="DecodeStream", code="RESOURCE_EXHAUSTED") == 1
            assert metric(text, "vqserve_streams_open", service=SERVICE) == 2
            # a stream that ends frees its place
            q, responses = opened[0]
            q.put(None)
            assert list(responses) == []
            wait_for(lambda: srv.server.gate.open[SERVICE] == 1)
            q, responses = open_stream(channel)
            q.put(encode_request(photos[:1], "again"))
            assert next(responses).request_id == "again"
            q.put(None)
            opened[1][0].put(None)
        finally:
            channel.close()


def test_sigterm_with_idle_streams_exits_promptly(tiny_checkpoint, photos):
    """A real `vqserve serve` with an idle EncodeStream and a health Watch open: SIGTERM
    with --grace 60 exits 0 in seconds."""
    from tests.integration.test_serve_ops import start_process

    proc, info, lines = start_process(
        ["--model", tiny_checkpoint, "--device", "cpu", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--grace", "60"])
    channel = grpc.insecure_channel(f"127.0.0.1:{info['port']}")
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        q, stream = open_stream(channel)
        q.put(encode_request(photos[:1], "warm"))
        assert next(stream).request_id == "warm"  # open, answered, now idle
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "".join(lines)
        took = time.monotonic() - t0
        assert took < 10, f"exit took {took:.1f} s of the 60 s grace"
        with pytest.raises(grpc.RpcError) as err:
            next(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        events = [json.loads(line).get("event") for line in lines if line.startswith("{")]
        assert events[-2:] == ["draining", "stopped"]
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _serve_config(*flags: str):
    from vqserve.cli import build_parser
    from vqserve.commands.serve import config_from_args

    return config_from_args(build_parser().parse_args(["serve", "--model", "default", *flags]))


def test_max_streams_flag_and_variable(monkeypatch, capsys):
    assert _serve_config().max_streams == 256
    assert _serve_config("--max-streams", "8").max_streams == 8
    monkeypatch.setenv("VQSERVE_MAX_STREAMS", "9")
    assert _serve_config().max_streams == 9
    assert cli_main(["serve", "--max-streams", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--max-streams (VQSERVE_MAX_STREAMS) must be 1..1000000" in err and len(err.splitlines()) == 1


def test_stream_gate_message_names_the_limit():
    from vqserve.serve.metrics import Metrics

    gate = StreamGate(1, Metrics())
    assert gate.admit(SERVICE, "EncodeStream") is None
    refused = gate.admit(SERVICE, "DecodeStream")
    assert refused and "allows 1 at once (--max-streams)" in refused
    assert gate.admit("grpc.health.v1.Health", "Watch") is None  # counted apart
    gate.release(SERVICE)
    assert gate.admit(SERVICE, "DecodeStream") is None


# ---- item 8: --expect-hash, checked before anything that can run code is loaded ------------------
class Payload:
    """Unpickling this creates the marker file: proof that code from the artifact ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def pt2_artifact(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pt2") / "art"
    assert cli_main(["export", "--model", tiny_checkpoint, "--format", "pt2", "--out", str(out),
                     "--min-agreement", "0", "--min-decode-psnr", "0", "--parity-size", "32",
                     "--parity-count", "2", "--quiet"]) == 0
    return out


def tampered_copy(artifact: Path, where: Path, marker: Path) -> Path:
    """``artifact`` with a pickle payload in encode.pt2 (its sample inputs, which
    torch.export.load unpickles, retrying without weights_only when that fails), and the
    manifest re-hashed to match, as whoever can write the folder can do."""
    bad = where / "tampered"
    shutil.copytree(artifact, bad)
    buffer = io.BytesIO()
    import torch

    torch.save({"x": Payload(marker)}, buffer)
    path = bad / "encode.pt2"
    with zipfile.ZipFile(path) as old:
        members = {i.filename: old.read(i.filename) for i in old.infolist()}
    (name,) = [n for n in members if n.endswith("data/sample_inputs/model.pt")]
    members[name] = buffer.getvalue()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as new:
        for member, data in members.items():
            new.writestr(member, data)
    manifest = json.loads((bad / "manifest.json").read_text())
    for file in manifest["files"]:
        data = (bad / file).read_bytes()
        manifest["files"][file] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (bad / "manifest.json").write_text(json.dumps(manifest))
    return bad


def test_rehashed_pt2_is_refused_before_it_can_run_code(pt2_artifact, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    bad = tampered_copy(pt2_artifact, tmp_path, marker)
    good = model_hash_of(pt2_artifact)
    # the problem: the manifest check passes (it was re-hashed), and loading runs the payload
    with pytest.raises(Exception):  # noqa: B017 - the payload's object then breaks the load
        load_runtime(bad)
    assert marker.exists(), "the pickle payload did not run: the test proves nothing"
    marker.unlink()
    # the defence: the expected hash is checked on the files before torch sees them
    with pytest.raises(ModelHashMismatch) as err:
        load_runtime(bad, expect_hash=good)
    assert good in str(err.value) and model_hash_of(bad) in str(err.value)
    assert not marker.exists()
    # the same on the command line: one line naming both hashes, exit 2, nothing bound
    capsys.readouterr()  # torch's own log of the load above
    assert cli_main(["serve", "--model", str(bad), "--expect-hash", good.upper(), "--device", "cpu",
                     "--port", "0", "--metrics-port", "-1"]) == 2
    out = capsys.readouterr().err.strip()
    assert len(out.splitlines()) == 1 and good in out and model_hash_of(bad) in out, out
    assert not marker.exists()
    photos_dir = tmp_path / "in"
    photos_dir.mkdir()
    (photos_dir / "a.png").write_bytes(_png(np.zeros((32, 32, 3), np.uint8)))
    assert cli_main(["tokenize", str(photos_dir), "--out", str(tmp_path / "tok"), "--model", str(bad),
                     "--expect-hash", good, "--workers", "0", "--no-progress"]) == 2
    out = capsys.readouterr().err.strip()
    assert good in out and "refusing to load" in out, out
    assert not marker.exists() and not (tmp_path / "tok").exists()


def test_expected_hash_serves_and_is_shown(pt2_artifact, photos):
    good = model_hash_of(pt2_artifact)
    cfg = config(str(pt2_artifact), backend="auto", expect_hash=good, metrics_port=0, grace_s=2)
    with ServerThread(cfg) as srv, TokenizerClient(srv.target, timeout=60) as client:
        info = client.model_info()
        assert info["model_hash"] == good and info["backend"] == "pt2"
        assert client.encode(photos[:1]).shape == (1, 8, 8)
        text = metrics_text(srv)
        source = info["source_hash"]
        assert metric(text, "vqserve_model_info", backend="pt2", device="cpu", dtype="fp32",
                      model_hash=good, source_hash=source, exact=str(info["exact"]).lower()) == 1
        assert source != good and info["exact"], "an exact export names its checkpoint beside its own hash"
    with pytest.raises(ModelHashMismatch):  # the API refuses as the command line does
        ServerThread(config(str(pt2_artifact), backend="auto", expect_hash="0" * 64)).start()


def test_checkpoint_hash_covers_config_and_weights(tiny_checkpoint, tmp_path):
    """Was: a checkpoint's model_hash was the sha256 of model.safetensors alone."""
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, copy)
    before = EagerRuntime(copy).info.model_hash
    assert before == checkpoint_hash(copy) == model_hash_of(copy)
    config_path = copy / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["meta"] = {"note": "edited"}
    config_path.write_text(json.dumps(cfg))
    assert sha256_file(copy / "model.safetensors") == sha256_file(Path(tiny_checkpoint) / "model.safetensors")
    after = EagerRuntime(copy).info.model_hash
    assert after != before and after == checkpoint_hash(copy)
    with pytest.raises(ModelHashMismatch, match="refusing to load"):
        load_runtime(copy, expect_hash=before)
    assert load_runtime(copy, expect_hash=after.upper()).info.model_hash == after


def test_tokenize_with_the_expected_hash(tiny_checkpoint, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(2):
        (src / f"{i}.png").write_bytes(_png(np.full((32, 32, 3), 40 * i, np.uint8)))
    good = checkpoint_hash(tiny_checkpoint)
    args = ["tokenize", str(src), "--model", tiny_checkpoint, "--workers", "0", "--no-progress"]
    assert cli_main([*args, "--out", str(tmp_path / "ok"), "--expect-hash", good]) == 0
    manifest = json.loads((tmp_path / "ok" / "__vqserve__" / "manifest.json").read_text())
    assert manifest["model"]["model_hash"] == good
    assert cli_main([*args, "--out", str(tmp_path / "no"), "--expect-hash", "f" * 64]) == 2
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("argv", [["serve", "--expect-hash", "xyz"],
                                  ["serve", "--expect-hash", "g" * 64],
                                  ["tokenize", "x", "--out", "y", "--expect-hash", "abc"]])
def test_bad_hash_syntax_is_a_one_line_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exited:  # argparse's own exit, with vqserve's one line
        cli_main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "64 hexadecimal digits" in err, err


def test_bad_hash_in_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("VQSERVE_EXPECT_HASH", "nothex")
    assert cli_main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "VQSERVE_EXPECT_HASH" in err, err


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


# ---- item 10: /metrics behind the bearer token, and over TLS -------------------------------------


def _status(fn) -> int:
    try:
        fn()
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def test_metrics_require_the_bearer_token(tiny_checkpoint):
    """Was: /metrics answered anyone, even with token auth on for gRPC."""
    cfg = config(tiny_checkpoint, auth_token="s3cret", metrics_auth=True, metrics_port=0, grace_s=2)
    with ServerThread(cfg) as srv:
        assert _status(lambda: metrics_text(srv)) == 401
        assert _status(lambda: metrics_text(srv, token="wrong")) == 401
        text = metrics_text(srv, token="s3cret")
        assert "vqserve_requests_in_flight" in text and "# TYPE vqserve_model_info gauge" in text
    with ServerThread(config(tiny_checkpoint, auth_token="s3cret", metrics_port=0, grace_s=2)) as srv:
        assert "vqserve_requests_in_flight" in metrics_text(srv)  # opt-in: scrapers must send it


def test_metrics_over_tls_with_the_grpc_pair(tiny_checkpoint, cert, photos):
    cert_path, key_path = cert
    cfg = config(tiny_checkpoint, tls_cert=str(cert_path), tls_key=str(key_path), auth_token="s3cret",
                 metrics_tls=True, metrics_auth=True, metrics_port=0, grace_s=2)
    with ServerThread(cfg) as srv:
        with pytest.raises((OSError, http.client.HTTPException)):  # no plaintext answer
            metrics_text(srv, token="s3cret")
        with pytest.raises(urllib.error.URLError):  # an untrusted certificate is refused
            metrics_text(srv, scheme="https", token="s3cret", ca=None)
        assert _status(lambda: metrics_text(srv, scheme="https", ca=cert_path)) == 401
        text = metrics_text(srv, scheme="https", token="s3cret", ca=cert_path)
        assert "vqserve_requests_in_flight" in text
        with TokenizerClient(f"localhost:{srv.port}", token="s3cret", tls_ca=cert_path, timeout=30) as c:
            assert c.encode(photos[:1]).shape == (1, 8, 8)  # gRPC unchanged beside it


def test_metrics_switches_need_their_gRPC_settings(tmp_path, capsys, monkeypatch):
    assert cli_main(["serve", "--metrics-tls"]) == 2
    assert "--metrics-tls (VQSERVE_METRICS_TLS) needs --tls-cert" in capsys.readouterr().err
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    monkeypatch.setenv("VQSERVE_METRICS_AUTH", "true")
    cfg = _serve_config("--auth-token-file", str(token))
    assert cfg.metrics_auth and cfg.auth_token == "s3cret" and not cfg.metrics_tls
    monkeypatch.setenv("VQSERVE_METRICS_AUTH", "maybe")
    assert cli_main(["serve"]) == 2
    assert "VQSERVE_METRICS_AUTH='maybe'" in capsys.readouterr().err
