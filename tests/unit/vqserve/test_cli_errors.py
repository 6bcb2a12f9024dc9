"""Every failure a user can cause is one line naming the problem and the fix: exit 2 for
usage errors, 1 for failures, 130 for Ctrl-C; `--debug` / VQSERVE_DEBUG=1 add the traceback.

Each case first reproduced a traceback (or a wrong exit status) on the code before it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from vqserve.cli import describe_error, main
from vqserve.commands.common import CliError, UsageError

pytestmark = pytest.mark.timeout(180)

VQSERVE = str(Path(sys.executable).parent / "vqserve")
# Fixed ports for the "in use" cases (this suite's range is 18300-18319).
GRPC_BUSY, METRICS_BUSY, RACE_BUSY = 18310, 18311, 18312


@pytest.fixture(autouse=True)
def _restore_vqserve_logging():
    """In-process `vqserve serve` points the vqserve logger at this test's captured stderr;
    put it back so later tests do not log to a closed stream."""
    logger = logging.getLogger("vqserve")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@contextlib.contextmanager
def listening(port: int):
    """Hold ``port`` the way another server would (IPv4 wildcard, listening)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            pytest.skip(f"port {port} is taken by something else on this machine")
        sock.listen()
        yield


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real console script: what a user sees on stderr, C-core logs and warnings included."""
    full_env = {**os.environ, "PYTHONWARNINGS": "default", **(env or {})}
    full_env.pop("VQSERVE_DEBUG", None)
    return subprocess.run([VQSERVE, *args], capture_output=True, text=True, timeout=120,
                          env=full_env)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    return lines[0]


# ---- serve: ports -----------------------------------------------------------------------
def test_grpc_port_in_use_is_one_line_and_exit_1():
    # before: 31 lines of gRPC log and traceback ending in RuntimeError
    with listening(GRPC_BUSY):
        proc = run_cli("serve", "--port", str(GRPC_BUSY), "--metrics-port", "-1")
    assert proc.returncode == 1
    assert one_line(proc.stderr) == (
        f"vqserve serve: error: gRPC port {GRPC_BUSY} on [::] is already in use; pick another "
        "with --port (or VQSERVE_PORT)")


def test_metrics_port_in_use_is_one_line_and_exit_1():
    # before: a traceback, then "Event loop is closed" and a never-awaited coroutine
    with listening(METRICS_BUSY):
        proc = run_cli("serve", "--port", "0", "--metrics-port", str(METRICS_BUSY))
    assert proc.returncode == 1
    line = one_line(proc.stderr)
    assert line.startswith(f"vqserve serve: error: metrics port {METRICS_BUSY} on [::] is "
                           "already in use; pick another with --metrics-port (or "
                           "VQSERVE_METRICS_PORT)"), line
    assert "--metrics-port -1" in line


@pytest.fixture
def unraisable(monkeypatch):
    """Collect what would print as "Exception ignored in ..." (e.g. a gRPC server's __del__
    scheduling its shutdown on a closed loop)."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: seen.append(info))
    return seen


def test_metrics_port_taken_after_grpc_started_leaves_nothing_behind(monkeypatch, capsys, unraisable):
    """The race the pre-check cannot see: gRPC is up when the metrics bind fails. The server
    must be stopped before the loop closes (no "Event loop is closed", no un-awaited
    AioServer.shutdown)."""
    from vqserve.serve import preflight

    monkeypatch.setattr(preflight, "check_port_free", lambda *a: None)
    with listening(RACE_BUSY), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main(["serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", str(RACE_BUSY)])
        gc.collect()
    assert rc == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(
        f"vqserve serve: error: metrics port {RACE_BUSY} on 127.0.0.1 is already in use")
    assert not unraisable, [str(u.exc_value) for u in unraisable]
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_grpc_bind_failure_after_the_check_is_still_one_error(monkeypatch, capsys, unraisable):
    from vqserve.serve import preflight

    monkeypatch.setattr(preflight, "check_port_free", lambda *a: None)
    with listening(RACE_BUSY):
        rc = main(["serve", "--host", "0.0.0.0", "--port", str(RACE_BUSY), "--metrics-port", "-1"])
        gc.collect()
    assert rc == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"vqserve serve: error: gRPC port {RACE_BUSY} on 0.0.0.0 could not be bound")
    assert last.endswith("check --host and --port (or VQSERVE_PORT)")
    assert not unraisable


def test_check_port_free():
    from vqserve.serve.preflight import PortInUseError, check_port_free

    check_port_free("gRPC", "[::]", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_port_free("gRPC", "127.0.0.1", free)  # closed again: free
    with listening(RACE_BUSY), pytest.raises(PortInUseError) as info:
        check_port_free("metrics", "0.0.0.0", RACE_BUSY)
    assert info.value.role == "metrics" and info.value.port == RACE_BUSY and info.value.in_use
    with pytest.raises(PortInUseError, match="not one of this machine's") as info:
        check_port_free("gRPC", "192.0.2.1", RACE_BUSY)  # TEST-NET-1: never local
    assert not info.value.in_use


# ---- serve: model and limits ------------------------------------------------------------
def test_serve_missing_model_is_one_line_before_binding(tmp_path, capsys, monkeypatch):
    # before: four JSON log lines (listening, load_failed, draining, stopped), then the error
    missing = tmp_path / "nope"
    rc = main(["serve", "--model", str(missing), "--port", "0", "--metrics-port", "-1"])
    assert rc == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"vqserve serve: error: --model {missing}: no such file or directory")
    assert "`default`" in line and "VQSERVE_MODEL" in line
    monkeypatch.setenv("VQSERVE_MODEL", str(missing))
    assert main(["serve", "--port", "0", "--metrics-port", "-1"]) == 2
    assert str(missing) in one_line(capsys.readouterr().err)


NO_GPU = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize("device, fragment", [
    ("tpu", "device must be auto, cpu or cuda[:N], got 'tpu'"),
    ("cuda:x", "device must be auto, cpu or cuda[:N], got 'cuda:x'"),
    pytest.param("cuda", "device 'cuda' requested but no CUDA GPU is available here", marks=NO_GPU),
])
def test_serve_device_it_cannot_use_is_one_line_before_starting(device, fragment, monkeypatch, capsys):
    # before: the executor's and a front-end's "listening" lines, load_failed, two
    # "draining" and two "stopped" lines, then the error, 1.5 s later
    from vqserve.serve import launcher as server

    def never(config):
        raise AssertionError("the server started")

    monkeypatch.setattr(server, "serve_until_signal", never)
    assert main(["serve", "--device", device, "--port", "0", "--metrics-port", "-1"]) == 2
    assert one_line(capsys.readouterr().err) == f"vqserve serve: error: {fragment}"
    # the stand-in plans for the device it is given, so it is refused the same way
    assert main(["serve", "--model", "synthetic:0", "--device", device, "--port", "0", "--metrics-port", "-1"]) == 2
    assert one_line(capsys.readouterr().err) == f"vqserve serve: error: {fragment}"
    # and a device it can use starts the server (stood in for here by the refusal above)
    assert main(["serve", "--model", "synthetic:0", "--device", "cpu", "--port", "0", "--metrics-port", "-1"]) == 1
    assert "AssertionError: the server started" in one_line(capsys.readouterr().err)


@NO_GPU
@pytest.mark.parametrize("argv", [
    ["bench", "gpu", "--json", "{tmp}/gpu.json"],  # its default device is cuda
    ["bench", "gpu", "--model", "synthetic:20", "--json", "{tmp}/gpu.json"],  # before: each server failed
    ["bench", "serve", "--model", "synthetic:200", "--device", "cuda"],  # before: "the server did not start"
    ["bench", "runtimes", "--device", "cuda"],  # before: every runtime skipped, then KeyError: 'batch'
    ["eval", "--model", "{model}", "--images", "{tmp}", "--out", "{tmp}/eval", "--device", "cuda"],
    ["train", "--device", "cuda", "--steps", "1", "--out", "{tmp}/run"],
])
def test_a_gpu_this_machine_lacks_is_one_line(argv, tiny_checkpoint, tmp_path, capsys):
    # before: bench gpu and eval ended in "AssertionError: Torch not compiled with CUDA
    # enabled (unexpected; ...)", exit 1; train said so in words of its own
    argv = [a.format(tmp=tmp_path, model=tiny_checkpoint) for a in argv]
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert line.endswith("error: device 'cuda' requested but no CUDA GPU is available here"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("argv, line", [
    (["health", "--timeout", "0"], "vqserve health: error: --timeout must be a positive number of seconds, got 0"),
    (["health", "--timeout", "-1"], "vqserve health: error: --timeout must be a positive number of seconds, got -1"),
    (["bench", "serve", "--duration", "0"], "vqserve bench: error: --duration must be a positive number of seconds, got 0.0"),
    (["bench", "serve", "--clients", "1,0"], "vqserve bench: error: --clients must be counts of at least 1, got 1,0"),
    (["bench", "serve", "--clients", "a"], "vqserve bench: error: --clients takes comma-separated counts, got 'a'"),
    (["bench", "serve", "--repeats", "0"], "vqserve bench: error: --repeats must be at least 1, got 0"),
    (["bench", "serve", "--client-procs", "1", "--client-callers", "0"],
     "vqserve bench: error: --client-callers must be at least 1, got 0"),
    (["bench", "serve", "--client-procs", "-1"],
     "vqserve bench: error: --client-procs must be 0 (clients in this process) or more, got -1"),
])
def test_counts_and_seconds_that_cannot_work_are_one_line_before_starting(argv, line, capsys):
    # before: health asked with no time and said DEADLINE_EXCEEDED (unreachable); bench serve
    # started servers, then ZeroDivisionError or KeyError (unexpected), or a table of zeros
    assert main(argv) == 2
    assert one_line(capsys.readouterr().err) == line


def test_resolve_device_names_what_it_refuses(monkeypatch):
    from vqserve.model import devices

    assert devices.resolve_device("cpu") == "cpu"
    assert devices.resolve_device("auto") in ("cpu", "cuda")
    for bad in ("gpu", "cuda:", "cuda:-1", "cuda:0,1", "CPU", ""):
        with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
            devices.resolve_device(bad)
    # the index check needs a GPU count: two GPUs stood in for by torch's own queries (none here)
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices.torch.cuda, "device_count", lambda: 2)
    assert devices.resolve_device("cuda:1") == "cuda:1"
    assert devices.resolve_device("auto") == "cuda"
    with pytest.raises(ValueError, match=r"this machine has 2 CUDA GPUs \(cuda:0..cuda:1\)"):
        devices.resolve_device("cuda:2")


@pytest.fixture(scope="module")
def onnx_fp32(tiny_checkpoint, tmp_path_factory) -> str:
    """The tiny tokenizer exported to ONNX in fp32 (its dtype is fixed from here on)."""
    from vqserve.export.exporter import export_model

    out = tmp_path_factory.mktemp("exports") / "onnx-fp32"
    export_model(tiny_checkpoint, "onnx", "fp32", out, parity_size=32, parity_count=1)
    return str(out)


def _wrong_dtype_line(err: str, command: str, artifact: str, dtype: str) -> str:
    line = one_line(err)
    assert line.startswith(f"vqserve {command}: error: --dtype {dtype}: {artifact} holds an fp32 "
                           "onnx export (its dtype is fixed at export time); leave --dtype out"), line
    assert "dtype=None" not in line and "unexpected" not in line and "Traceback" not in err
    return line


def test_serve_dtype_other_than_the_artifacts_is_one_line_before_binding(onnx_fp32, monkeypatch, capsys):
    # before: four JSON log lines (listening, planning, load_failed, ...), then "RuntimeError:
    # no dtype met the constraints: ... or pass dtype=None (unexpected; ...)", exit 1
    proc = run_cli("serve", "--model", onnx_fp32, "--dtype", "bf16", "--port", "0",
                   "--metrics-port", "-1", env={"VQSERVE_PLAN": "auto"})
    assert proc.returncode == 2, proc.stderr
    line = _wrong_dtype_line(proc.stderr, "serve", onnx_fp32, "bf16")
    assert "--format pt2 --dtype bf16" in line  # ONNX cannot run bf16: no advice that fails
    from vqserve.serve import launcher as server

    def never(config):
        raise AssertionError("the server started")

    monkeypatch.setattr(server, "serve_until_signal", never)  # in-process, from VQSERVE_DTYPE
    monkeypatch.setenv("VQSERVE_DTYPE", "fp16")
    assert main(["serve", "--model", onnx_fp32, "--port", "0", "--metrics-port", "-1"]) == 2
    line = _wrong_dtype_line(capsys.readouterr().err, "serve", onnx_fp32, "fp16")
    assert line.endswith("vqserve export --format onnx --dtype fp16")


def test_runtime_and_tokenize_refuse_another_dtype_in_one_line(onnx_fp32, tmp_path, capsys):
    from PIL import Image

    from vqserve.export.runtimes.artifacts import OnnxRuntime

    with pytest.raises(ValueError, match=r"^--dtype fp16: .* holds an fp32 onnx export") as exc:
        OnnxRuntime(onnx_fp32, dtype="fp16")
    assert "dtype=None" not in str(exc.value)
    OnnxRuntime(onnx_fp32, dtype="fp32")  # its own dtype, or None, still loads
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (32, 32)).save(images / "a.png")
    assert main(["tokenize", "--model", onnx_fp32, "--dtype", "bf16", "--plan", "default",
                 "--out", str(tmp_path / "tokens"), str(images)]) == 2
    _wrong_dtype_line(capsys.readouterr().err, "tokenize", onnx_fp32, "bf16")


def test_max_pixels_flag_env_and_message_size(monkeypatch, capsys):
    from vqserve.cli import build_parser
    from vqserve.commands.serve import config_from_args

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(["serve", *argv]))

    assert cfg().max_pixels == 1024 * 1024
    assert cfg("--max-pixels", "4096x3072").max_pixels == 4096 * 3072
    assert cfg("--max-pixels", "2000000").max_pixels == 2_000_000
    monkeypatch.setenv("VQSERVE_MAX_PIXELS", "3000x3000")
    assert cfg().max_pixels == 9_000_000
    assert cfg("--max-pixels", "100").max_pixels == 100  # the flag wins
    monkeypatch.delenv("VQSERVE_MAX_PIXELS")
    # a limit no gRPC message could carry is refused, naming the flag that fixes it
    with pytest.raises(UsageError, match="raise --max-message-mb .* to 184"):
        cfg("--max-pixels", "8000x8000")
    assert cfg("--max-pixels", "8000x8000", "--max-message-mb", "184").max_pixels == 64_000_000
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--max-pixels", "big"])
    assert exc.value.code == 2
    assert "expected a pixel count or WxH" in one_line(capsys.readouterr().err)


def test_max_pixels_reaches_the_served_limit(tiny_checkpoint):
    """Without the flag a 12-megapixel photo had no remedy: the limit was hard-coded."""
    from vqserve.serve.api.codec import BadInput
    from vqserve.serve.clients.sync import TokenizerClient
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    config = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1",
                          port=0, metrics_port=-1, max_pixels=64 * 64, grace_s=1)
    with ServerThread(config) as srv, TokenizerClient(srv.target, timeout=60) as client:
        assert client.model_info()["max_pixels"] == 64 * 64
        engine = srv.server.state.engine
        engine.check_images(np.zeros((1, 64, 64, 3), np.uint8))
        with pytest.raises(BadInput, match="exceeds the limit 4096"):
            engine.check_images(np.zeros((1, 64, 72, 3), np.uint8))


# ---- the mapping in main() ----------------------------------------------------------------
def _unreadable_image(tmp_path):
    from PIL import Image, UnidentifiedImageError

    path = tmp_path / "notes.png"
    path.write_text("not an image")
    try:
        Image.open(path)
    except UnidentifiedImageError as exc:
        return exc
    raise AssertionError("Pillow opened a text file")


@pytest.mark.parametrize("make, status, fragment", [
    (lambda tmp: _unreadable_image(tmp), 2, "not an image Pillow can read; pass image files"),
    (lambda tmp: ValueError("--size must be positive"), 2, "--size must be positive"),
    (lambda tmp: FileNotFoundError(2, "No such file or directory", "x.png"), 2,
     "x.png: no such file or directory"),
    (lambda tmp: UsageError("bad flag; use --x"), 2, "bad flag; use --x"),
    (lambda tmp: CliError("disk full; free space"), 1, "disk full; free space"),
    (lambda tmp: PermissionError(13, "Permission denied", "/root/x"), 1, "/root/x: permission denied"),
    (lambda tmp: ModuleNotFoundError("No module named 'skimage'", name="skimage"), 1,
     "optional module 'skimage' is not installed"),
    (lambda tmp: RuntimeError("boom\n  second line"), 1,
     "RuntimeError: boom second line (unexpected; run with --debug for the traceback)"),
])
def test_exceptions_become_one_line_and_a_status(make, status, fragment, tmp_path, monkeypatch, capsys):
    from vqserve.commands import info

    exc = make(tmp_path)
    assert describe_error(exc) == (status, describe_error(exc)[1])

    def boom(args):
        raise exc

    monkeypatch.setattr(info, "run", boom)
    monkeypatch.delenv("VQSERVE_DEBUG", raising=False)
    assert main(["info"]) == status
    line = one_line(capsys.readouterr().err)
    assert line.startswith("vqserve info: error: ") and fragment in line, line


def test_ctrl_c_exits_130(monkeypatch, capsys):
    from vqserve.commands import info

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(info, "run", interrupted)
    assert main(["info"]) == 130
    assert one_line(capsys.readouterr().err) == "interrupted"


@pytest.mark.parametrize("argv, env", [
    (["--debug", "info"], {}),
    (["info", "--debug"], {}),
    (["info"], {"VQSERVE_DEBUG": "1"}),
])
def test_debug_adds_the_traceback(argv, env, monkeypatch, capsys):
    from vqserve.commands import info

    def boom(args):
        raise RuntimeError("kaput")

    monkeypatch.setattr(info, "run", boom)
    monkeypatch.delenv("VQSERVE_DEBUG", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(argv) == 1  # the same status as without --debug
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in boom" in err
    assert err.strip().splitlines()[-1].startswith("vqserve info: error: RuntimeError: kaput")


@pytest.mark.parametrize("argv, fragment", [
    (["serve", "--bogus"], "vqserve serve: error: unrecognized arguments: --bogus; see `vqserve serve --help`"),
    (["export", "--out", "x"], "the following arguments are required: --format; see `vqserve export --help`"),
    (["nosuch"], "invalid choice: 'nosuch'"),
])
def test_bad_command_lines_are_one_line_exit_2(argv, fragment, capsys):
    # before: the whole usage block, then the error
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert fragment in one_line(capsys.readouterr().err)


# ---- export --opset ------------------------------------------------------------------------
def test_export_refuses_an_opset_it_cannot_write(tiny_checkpoint, tmp_path, capsys):
    # before: two tracebacks from the opset converter, exit 0, and an opset-18 model on disk
    out = tmp_path / "onnx12"
    assert main(["export", "--model", tiny_checkpoint, "--format", "onnx", "--opset", "12",
                 "--out", str(out), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--opset 12 cannot be exported" in line and "--opset 18" in line
    assert not out.exists() and not list(tmp_path.iterdir())


def test_export_refuses_opset_for_other_formats(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "ts"
    assert main(["export", "--model", tiny_checkpoint, "--format", "torchscript", "--opset", "18",
                 "--out", str(out), "--quiet"]) == 2
    assert "--opset applies to --format onnx only" in one_line(capsys.readouterr().err)
    assert not out.exists()


def test_opset_range_is_what_the_converter_supports():
    from vqserve.export.formats.onnx import DEFAULT_OPSET, check_opset, opset_range

    low, high = opset_range()
    assert low == DEFAULT_OPSET == 18 and high >= low
    check_opset(low)
    check_opset(high)
    for bad in (low - 1, high + 1):
        with pytest.raises(ValueError, match=f"--opset {bad} cannot be exported"):
            check_opset(bad)


def test_an_opset_the_exporter_did_not_honour_is_refused_after_export(
        tiny_checkpoint, tmp_path, monkeypatch, capfd):
    """Belt and braces: even if the up-front range let an opset through, the written files
    are checked, and a mismatch writes nothing (quietly: no converter tracebacks)."""
    from vqserve.export.exporter import export_model
    from vqserve.export.formats import onnx as onnx_export

    monkeypatch.setattr(onnx_export, "opset_range", lambda: (1, 99))
    out = tmp_path / "onnx12"
    with pytest.raises(ValueError, match="requested but the exporter wrote encode.onnx in opset 18"):
        export_model(tiny_checkpoint, "onnx", "fp32", out, opset=12, parity_size=32, parity_count=1)
    assert not out.exists() and not list(tmp_path.iterdir())
    assert "Traceback" not in capfd.readouterr().err
