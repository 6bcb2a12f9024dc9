"""`vqserve serve --frontends N`: gRPC in N front-end processes, one device executor.

Real servers in their own processes, real clients. The model is ``synthetic:N``, the
stand-in accelerator (export/runtimes/synthetic.py): this machine has no GPU, and the layout exists
for GPU nodes; its tokens are a known function of the pixels, so every answer is checked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest

from tests.helpers import ServeProcess, alive, child_pids, wait_until
from vqserve.export.runtimes.synthetic import SyntheticRuntime, block_tokens
from vqserve.serve.clients.sync import TokenizerClient


@pytest.fixture(scope="module")
def split_server():
    with ServeProcess(["--model", "synthetic:50", "--frontends", "2", "--metrics-port", "0"]) as srv:
        yield srv


def _images(n: int, seed: int = 0, size: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _scrape(srv) -> str:
    """A server's /metrics (started with ``--metrics-port 0``: its serving line has the port)."""
    port = json.loads(next(line for line in srv.log if '"event": "serving"' in line))["metrics_port"]
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()


def _frontend_pids(srv) -> list[int]:
    """The server's front-end processes (its children running vqserve.serve.split.frontend)."""
    def is_frontend(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                return b"vqserve.serve.split.frontend" in fh.read()
        except OSError:  # gone meanwhile
            return False

    return [pid for pid in child_pids(srv.proc.pid) if is_frontend(pid)]


def _count(text: str, prefix: str, having: str = "") -> float:
    """The sum of the samples whose line starts with ``prefix`` (and holds ``having``)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix) and having in line)


def test_tokens_through_two_frontends_are_the_models(split_server):
    """Many connections (spread over both front-ends by the kernel) get the model's tokens
    and pixels, from pixels that crossed to the executor through shared memory."""
    assert len(child_pids(split_server.proc.pid)) >= 2
    reference = SyntheticRuntime("synthetic:0")
    for k in range(6):  # separate channels: SO_REUSEPORT hashes connections over the front-ends
        client = TokenizerClient(split_server.target)
        images = _images(3 + k, seed=k)
        tokens = client.encode(images)
        np.testing.assert_array_equal(tokens, block_tokens(images))
        np.testing.assert_array_equal(client.decode(tokens), reference.decode(tokens))
        client.close()
    info = TokenizerClient(split_server.target).model_info()
    assert info["backend"] == "synthetic" and info["exact"] and info["codebook_size"] == 64000
    assert "micro_batch=8" in info["execution_plan"]
    assert info["determinism"]["batch_invariant"]


def test_bad_input_gets_the_same_one_line_errors(split_server):
    from vqserve.serve._proto import tokenizer_pb2 as pb
    from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc

    stub = pb_grpc.TokenizerStub(grpc.insecure_channel(split_server.target))
    odd = np.zeros((1, 60, 64, 3), np.uint8)
    with pytest.raises(grpc.RpcError) as err:
        stub.Encode(pb.EncodeRequest(images=pb.Tensor(shape=list(odd.shape), dtype="uint8", data=odd.tobytes())))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "multiples of the downsampling factor 8" in err.value.details()
    out_of_range = np.full((1, 4, 4), 64000, np.uint32)
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(indices=pb.Tensor(shape=[1, 4, 4], dtype="uint32",
                                                       data=out_of_range.tobytes())))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "indices" in err.value.details()
    # and the server keeps serving
    images = _images(2, seed=9)
    np.testing.assert_array_equal(TokenizerClient(split_server.target).encode(images), block_tokens(images))


def test_frontends_never_load_torch(split_server):
    """A front-end checks requests but runs no model: it maps no torch library (each one
    loaded torch before: ~1 s of start-up and ~190 MB of memory per front-end)."""
    frontends = _frontend_pids(split_server)
    assert len(frontends) == 2
    for pid in frontends:
        with open(f"/proc/{pid}/maps") as fh:
            assert "libtorch" not in fh.read(), f"front-end {pid} loaded torch"
    with open(f"/proc/{split_server.proc.pid}/maps") as fh:  # the check can see torch where it is
        assert "libtorch" in fh.read()


def test_oip_encode_through_frontends(split_server):
    from vqserve.bench.load import LoadCase, request_bytes

    images = _images(4, seed=3, size=256)
    method, payload = request_bytes(LoadCase("oip", "raw", 4), images)
    reply = grpc.insecure_channel(split_server.target).unary_unary(method)(payload, timeout=60)
    from vqserve.serve._proto import grpc_predict_v2_pb2 as oip

    answer = oip.ModelInferResponse.FromString(reply)
    tokens = np.frombuffer(answer.raw_output_contents[0], dtype="<u2").reshape(list(answer.outputs[0].shape))
    np.testing.assert_array_equal(tokens, block_tokens(images))


def test_png_requests_decode_in_the_frontends(split_server):
    images = _images(2, seed=5)
    import io

    from PIL import Image

    blobs = []
    for x in images:
        buf = io.BytesIO()
        Image.fromarray(x).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    from vqserve.serve._proto import tokenizer_pb2 as pb
    from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc

    stub = pb_grpc.TokenizerStub(grpc.insecure_channel(split_server.target))
    reply = stub.Encode(pb.EncodeRequest(encoded=pb.EncodedImages(images=blobs)))
    tokens = np.frombuffer(reply.indices.data, dtype=reply.indices.dtype).reshape(list(reply.indices.shape))
    np.testing.assert_array_equal(tokens, block_tokens(images))


def test_metrics_sum_every_frontend_and_the_executor(split_server):
    """Requests are counted once each, whichever front-end took them; batches once, by the
    executor; every family appears once in the exposition."""
    before = _scrape(split_server)
    n = 8
    for k in range(n):
        client = TokenizerClient(split_server.target)
        client.encode(_images(1, seed=100 + k))
        client.close()
    after = _scrape(split_server)
    ok = 'vqserve_requests_total{code="OK",method="Encode"}'
    assert _count(after, ok) - _count(before, ok) == n
    items = 'vqserve_items_total{method="encode"}'
    assert _count(after, items) - _count(before, items) >= n  # padded rows are not counted; each image once
    # one caller at a time: each request crosses to the executor as a group of its own
    group = 'vqserve_group_size_{}{{method="encode"}}'
    assert _count(after, group.format("count")) - _count(before, group.format("count")) == n
    assert _count(after, group.format("sum")) - _count(before, group.format("sum")) == n
    families = [line.split()[2] for line in after.splitlines() if line.startswith("# TYPE")]
    assert len(families) == len(set(families)), "a metric family appears twice"
    assert "vqserve_model_info" in after and 'backend="synthetic"' in after
    assert _count(after, "vqserve_codebook_window_tokens") > 0


def test_calls_in_flight_in_a_killed_frontend_stop_counting_as_in_flight():
    """A front-end killed with calls in flight (kill -9: it never decrements its gauge) is
    replaced, and /metrics stops counting its calls as in flight (its multiprocess files
    are marked dead), so an autoscaler reading the gauge does not see phantom load."""
    import threading

    with ServeProcess(["--model", "synthetic:1000000", "--frontends", "1", "--micro-batch", "1",
                       "--metrics-port", "0"]) as srv:
        def in_flight() -> float:
            return _count(_scrape(srv), "vqserve_requests_in_flight")

        failures = []

        def slow_call(seed: int) -> None:  # 2.25 s of device time per 384x384 image, a call at a time:
            try:  # none can finish before the kill, however loaded the machine
                TokenizerClient(srv.target, timeout=120).encode(_images(1, seed=seed, size=384))
            except Exception as exc:  # noqa: BLE001 - the kill fails it: that is the point
                failures.append(exc)

        callers = [threading.Thread(target=slow_call, args=(k,)) for k in range(3)]
        for c in callers:
            c.start()
        assert wait_until(lambda: in_flight() >= 2, 30), "the calls never showed as in flight"
        os.kill(_frontend_pids(srv)[0], signal.SIGKILL)
        for c in callers:
            c.join(60)
        assert len(failures) == 3  # each caller heard that its front-end went away
        assert wait_until(lambda: sum('"frontend_serving"' in line for line in srv.log) >= 2, 180)
        assert wait_until(lambda: in_flight() == 0, 30), f"in flight {in_flight()} after the kill"
        images = _images(1, seed=9, size=64)  # the replacement serves
        np.testing.assert_array_equal(TokenizerClient(srv.target).encode(images), block_tokens(images))


def test_overload_across_frontends_gets_resource_exhausted_then_recovers():
    """More calls than the queue holds, through 2 front-ends (each caller its own
    connection, which the kernel spreads over them): the excess gets RESOURCE_EXHAUSTED at
    once, counted as such in /metrics, the rest their tokens, and the server serves again
    once the queue drains."""
    import threading

    with ServeProcess(["--model", "synthetic:500000", "--frontends", "2", "--micro-batch", "1",
                       "--max-batch-size", "1", "--max-queue", "2", "--metrics-port", "0"]) as srv:
        images = [_images(1, seed=k, size=256) for k in range(10)]  # 0.5 s of device time each
        results: list = [None] * len(images)
        connected = threading.Barrier(len(images))  # every caller connected, then all send at once

        def call(k: int) -> None:
            from vqserve.serve._proto import tokenizer_pb2 as pb
            from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc
            from vqserve.serve.clients import tensor_array, tensor_msg

            channel = grpc.insecure_channel(srv.target, options=[("grpc.use_local_subchannel_pool", 1)])
            try:
                grpc.channel_ready_future(channel).result(timeout=60)
                connected.wait(60)
                reply = pb_grpc.TokenizerStub(channel).Encode(pb.EncodeRequest(images=tensor_msg(images[k])),
                                                              timeout=120)
                results[k] = tensor_array(reply.indices)
            except grpc.RpcError as exc:
                results[k] = exc
            finally:
                channel.close()

        callers = [threading.Thread(target=call, args=(k,)) for k in range(len(images))]
        for c in callers:
            c.start()
        for c in callers:
            c.join(120)
        refused = [r for r in results if isinstance(r, grpc.RpcError)]
        served = [k for k, r in enumerate(results) if isinstance(r, np.ndarray)]
        assert refused and {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused
        assert len(served) >= 2
        for k in served:
            np.testing.assert_array_equal(results[k], block_tokens(images[k]))
        assert _count(_scrape(srv), "vqserve_errors_total", 'code="RESOURCE_EXHAUSTED"') == len(refused)
        again = _images(1, seed=99, size=64)
        np.testing.assert_array_equal(TokenizerClient(srv.target).encode(again), block_tokens(again))


def test_deadline_passes_while_the_device_is_busy():
    """A request whose deadline passes in the executor's queue gets DEADLINE_EXCEEDED."""
    with ServeProcess(["--model", "synthetic:400000", "--frontends", "1", "--micro-batch", "1"]) as srv:
        slow = TokenizerClient(srv.target, timeout=120)
        import threading

        busy = threading.Thread(target=lambda: slow.encode(_images(1, seed=1, size=256)))
        busy.start()  # 0.4 s of device time, one call at a time
        time.sleep(0.05)
        from vqserve.serve._proto import tokenizer_pb2 as pb
        from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc

        stub = pb_grpc.TokenizerStub(grpc.insecure_channel(srv.target))
        images = _images(1, seed=2, size=256)
        with pytest.raises(grpc.RpcError) as err:
            stub.Encode(pb.EncodeRequest(images=pb.Tensor(shape=list(images.shape), dtype="uint8",
                                                          data=images.tobytes())), timeout=0.1)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        busy.join()


def test_auth_is_checked_in_every_frontend(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with ServeProcess(["--model", "synthetic:0", "--frontends", "2", "--auth-token-file", str(token)]) as srv:
        for _ in range(4):
            with pytest.raises(grpc.RpcError) as err:
                TokenizerClient(srv.target).encode(_images(1))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        images = _images(2)
        tokens = TokenizerClient(srv.target, token="s3cret").encode(images)
        np.testing.assert_array_equal(tokens, block_tokens(images))


def test_sigterm_drains_and_leaves_no_process():
    srv = ServeProcess(["--model", "synthetic:200000", "--frontends", "2", "--micro-batch", "1"])
    children = child_pids(srv.proc.pid)
    assert len(children) >= 2
    import threading

    answers: list = []
    images = _images(1, seed=7, size=256)
    worker = threading.Thread(target=lambda: answers.append(TokenizerClient(srv.target, timeout=60).encode(images)))
    worker.start()
    time.sleep(0.1)  # the request is in the executor (0.2 s of device time)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    worker.join(60)
    assert answers and np.array_equal(answers[0], block_tokens(images)), "the in-flight request was lost"
    assert wait_until(lambda: not any(alive(p) for p in children)), "a front-end outlived the server"


def test_kill_9_of_the_server_ends_its_frontends():
    srv = ServeProcess(["--model", "synthetic:0", "--frontends", "2"])
    children = child_pids(srv.proc.pid)
    assert children
    srv.proc.kill()
    srv.proc.wait(30)
    assert wait_until(lambda: not any(alive(p) for p in children)), "orphaned front-ends"


def _health_everywhere(target: str, asks: int = 6) -> set[str]:
    """What health says over ``asks`` fresh connections (the kernel spreads them over the
    front-ends, each of which answers for itself)."""
    from vqserve.serve.clients import check_health

    return {check_health(target, "", 30) for _ in range(asks)}


def test_a_stopped_executor_turns_health_not_serving_until_it_continues():
    """Regression: with the device executor stopped (SIGSTOP, as a wedged GPU or a deadlocked
    executor looks) every call ended in DEADLINE_EXCEEDED while health answered SERVING for
    as long as it was stopped, so probes kept sending traffic into it. Now every front-end
    says NOT_SERVING once the executor has not answered for --stall-timeout, `vqserve
    health` exits 1, and all say SERVING again once it continues."""
    with ServeProcess(["--model", "synthetic:200", "--frontends", "2", "--stall-timeout", "1"]) as srv:
        assert _health_everywhere(srv.target) == {"SERVING"}
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: _health_everywhere(srv.target) == {"NOT_SERVING"}, 120), \
                "health still says SERVING with the executor stopped"
            cli = subprocess.run([sys.executable, "-m", "vqserve", "health", "--server", srv.target, "--timeout", "30"],
                                 capture_output=True, text=True, timeout=120)
            assert cli.returncode == 1 and "NOT_SERVING" in cli.stdout, (cli.stdout, cli.stderr)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert wait_until(lambda: _health_everywhere(srv.target) == {"SERVING"}, 120), \
            "health did not come back after SIGCONT"
        images = _images(2, seed=12)
        np.testing.assert_array_equal(TokenizerClient(srv.target).encode(images), block_tokens(images))
        assert any('"event": "stalled"' in line and "has not answered" in line for line in srv.log)
        assert any('"event": "progressing"' in line for line in srv.log)


def test_a_dead_frontend_is_replaced():
    with ServeProcess(["--model", "synthetic:0", "--frontends", "2"]) as srv:
        os.kill(_frontend_pids(srv)[0], signal.SIGKILL)
        assert wait_until(lambda: any('"frontend_restart"' in line for line in srv.log))
        assert wait_until(lambda: sum('"frontend_serving"' in line for line in srv.log) >= 3, 180)
        images = _images(3, seed=11)
        for _ in range(4):
            np.testing.assert_array_equal(TokenizerClient(srv.target).encode(images), block_tokens(images))


@pytest.mark.parametrize("frontends", ["2", "0"])
def test_a_tls_pair_that_does_not_load_is_one_line_before_any_process(tmp_path, frontends):
    """A TLS pair that does not load fails before any port or process starts, in one line
    that names the flags (it once started the front-ends, which each failed to bind and
    said "port could not be bound": the wrong cause, after a page of tracebacks)."""
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    done = subprocess.run([sys.executable, "-m", "vqserve", "serve", "--model", "synthetic:0", "--frontends", frontends,
                           "--port", "0", "--metrics-port", "-1", "--host", "127.0.0.1",
                           "--tls-cert", str(bad), "--tls-key", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vqserve serve: error: --tls-cert"), done.stderr
    assert str(bad) in lines[0]


def test_tls_pair_check_names_each_way_a_pair_fails(cert, tmp_path):
    from vqserve.serve.preflight import check_tls_pair

    cert_path, key_path = cert
    check_tls_pair(str(cert_path), str(key_path))  # the good pair loads
    check_tls_pair(None, None)  # no TLS
    other = tmp_path / "other-key.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other), "2048"], check=True, capture_output=True)
    with pytest.raises(ValueError, match="--tls-key .*: not a PEM certificate chain and its private key"):
        check_tls_pair(str(cert_path), str(other))  # a key, not this certificate's
    encrypted = tmp_path / "encrypted-key.pem"
    subprocess.run(["openssl", "rsa", "-in", str(key_path), "-aes256", "-passout", "pass:secret", "-out", str(encrypted)],
                   check=True, capture_output=True)
    with pytest.raises(ValueError, match="is encrypted"):  # refused, never a prompt on the terminal
        check_tls_pair(str(cert_path), str(encrypted))
    with pytest.raises(ValueError, match="No such file"):
        check_tls_pair(str(tmp_path / "missing.pem"), str(key_path))
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        check_tls_pair(str(cert_path), None)


def test_a_frontend_that_never_served_is_not_restarted(tmp_path):
    """Front-ends that end before serving are a start-up failure, reported once: the pool
    does not start others meanwhile (one it started while the server was stopping printed a
    traceback after the server's last line, and outlived its metrics folder)."""
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.split.pool import FrontendPool

    pool = FrontendPool(ServerConfig(model="synthetic:0"), 2, 0, str(tmp_path / "no-executor"), str(tmp_path))
    pool.settings = "not the settings"  # each front-end fails at once reading them
    pool.start()
    try:
        assert wait_until(lambda: all(p.poll() is not None for p in pool.procs), 60)
        time.sleep(1.0)  # five rounds of the watcher
        assert pool.restarts == 0 and all(p.poll() is not None for p in pool.procs)
        with pytest.raises(ChildProcessError, match="before serving"):
            pool.failed_at_start()
    finally:
        pool.stop(0)
