"""The pieces of the GPU-node layout, each on its own (the shared pixel arena, the wire between
front-ends and executor, the stand-in device's clock, the front-end count), and the
benchmark drivers that load it (``bench gpu``, ``bench serve``'s client processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import ServeProcess, alive, child_pids, wait_until
from vqserve.core.shm import Arena, ArenaFull
from vqserve.export.runtimes.synthetic import SyntheticRuntime, block_tokens
from vqserve.serve.clients.sync import TokenizerClient
from vqserve.serve.split import wire


def _images(n: int, seed: int = 0, size: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


# ---- the pieces ----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40_000)), min_size=1, max_size=60))
def test_arena_blocks_never_overlap_and_all_space_returns(ops):
    arena = Arena(256 * 1024)
    held: list[tuple[int, int]] = []
    for free_one, size in ops:
        if free_one and held:
            offset, n = held.pop(size % len(held))
            arena.free(offset, n)
            continue
        try:
            offset = arena.alloc(size)
        except ArenaFull:
            continue
        for other, m in held:
            assert offset + size <= other or other + m <= offset
        arena.put(offset, np.full(size, len(held) % 251, np.uint8))
        held.append((offset, size))
    for offset, n in held:
        arena.free(offset, n)
    assert arena.used == 0
    assert arena.alloc(arena.size) == 0  # free runs merged back into one
    arena.close()


def test_arena_is_shared_through_its_descriptor():
    import socket

    owner = Arena(1 << 20)
    a, b = socket.socketpair()
    owner.send_to(a, b'{"x": 1}')
    header, fd = Arena.receive(b)
    peer = Arena.attach(fd, owner.size)
    offset = owner.alloc(1000)
    owner.put(offset, np.arange(250, dtype=np.uint32))
    np.testing.assert_array_equal(peer.view(offset, (250,), np.uint32), np.arange(250))
    assert header == b'{"x": 1}'
    with pytest.raises(ValueError):
        peer.view(owner.size - 8, (4,), np.uint32)  # outside: refused, never read
    for x in (peer, owner):
        x.close()
    a.close()
    b.close()


def test_wire_errors_come_back_as_the_same_exceptions():
    from vqserve.serve.api.codec import BadInput
    from vqserve.serve.engine.batcher import DeadlineExpired, QueueFull

    for exc in (BadInput("images.shape", "must be [B,H,W,3]"), QueueFull("full"), DeadlineExpired("late"),
                ValueError("bad")):
        status, message = wire.status_of(exc)
        again = wire.error_of(status, message)
        assert type(again) is type(exc) and str(again) == str(exc)
    header = wire.pack_request(7, wire.ENCODE, np.uint8, (2, 64, 64, 3), 12.5, 4096, 8192, 100)
    request = wire.unpack_request(header)
    assert request["shape"] == (2, 64, 64, 3) and request["deadline"] == 12.5 and request["dtype"] == "uint8"


def test_synthetic_device_time_is_accounted_per_pixel():
    """N µs per 256x256 image, proportional to pixels, on one clock per device name."""
    runtime = SyntheticRuntime("synthetic:100", device="synthetic:test-accounting")
    runtime.encode(_images(4, size=256))
    runtime.encode(_images(2, size=128))
    assert runtime.device.busy_s == pytest.approx(100e-6 * (4 + 2 * 0.25))
    assert runtime.capacity == pytest.approx(10_000)
    with pytest.raises(ValueError, match="synthetic:N"):
        SyntheticRuntime("synthetic:fast")


def test_bench_gpu_runs_its_whole_table_without_a_gpu(tmp_path):
    """`vqserve bench gpu` on the stand-in device: every section runs and lands in the JSON."""
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "-m", "vqserve", "bench", "gpu", "--model", "synthetic:20", "--device", "cpu",
                           "--batches", "8", "--seconds", "0.5", "--procs", "1", "--callers", "2",
                           "--client-kind", "asyncio,blocking",
                           "--cases", "v1:raw:2,v1:jpeg:2", "--layouts", "single=--frontends 0;split=--frontends 1",
                           "--tokenize-seconds", "0", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    served = result["served"]
    assert {r["layout"] for r in served} == {"single", "split"}
    # each case with each kind of caller, side by side
    assert {(r["layout"], r["case"], r["caller_kind"]) for r in served} == {
        (layout, case, kind) for layout in ("single", "split") for case in ("v1 raw x2", "v1 jpeg x2")
        for kind in ("asyncio", "blocking")}
    assert all(not r.get("errors") and r["calls"] > 0 for r in served), served
    # read from each server's /metrics over the measured window
    assert all(r["images_per_call"] is not None and 1 <= r["images_per_call"] <= 8 for r in served), served
    assert all((r["requests_per_group"] is None) == (r["layout"] == "single") for r in served), served
    assert all(r["requests_per_group"] >= 1 for r in served if r["layout"] == "split"), served
    # a model call lasts at least its images' 20 µs of device time each; the two model slots
    # (the stand-in's plan) keep at most two calls running (with slack for the window's edges)
    assert all(r["ms_per_call"] >= 0.020 * r["images_per_call"] for r in served), served
    assert all(0 < r["calls_busy"] <= 3 and r["queue_wait_ms"] >= 0 for r in served), served
    assert "req/group" in done.stdout and "ms/call" in done.stdout and "blocking" in done.stdout
    assert "served" in done.stdout and "/in-proc" in done.stdout


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_killed_bench_serve_leaves_no_server_or_client_behind():
    """Regression: kill -9 of `vqserve bench serve` mid-measurement left its `vqserve serve`
    (with its front-end) serving forever and its client processes calling it, as `bench
    gpu` killed at a device's time limit would. The server now ends with the thread that
    started it (`lifetime.ending_with_this_thread`) and every helper process with its parent."""
    proc = subprocess.Popen([sys.executable, "-m", "vqserve", "bench", "serve", "--model", "synthetic:200",
                             "--size", "32", "--client-procs", "1", "--client-callers", "2",
                             "--client-kind", "blocking", "--duration", "600", "--repeats", "1",
                             "--cases", "v1:raw:1", "--layouts", "default=", "--floor"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    below: list[int] = []

    def measuring() -> bool:  # the server, its front-end and a client process all running
        below[:] = child_pids(proc.pid)
        lines = [_cmdline(p) for p in below]
        return (any("vqserve serve" in c for c in lines) and any("vqserve.serve.split.frontend" in c for c in lines)
                and sum("spawn_main" in c for c in lines) >= 2)  # the echo server or a client, and a client
    try:
        assert wait_until(measuring, 300), [_cmdline(p) for p in below]
        proc.kill()
        proc.wait()
        assert wait_until(lambda: not any(alive(p) for p in below)), \
            [_cmdline(p) for p in below if alive(p)]
    finally:
        proc.kill()
        for pid in filter(alive, below):  # a failing run leaves nothing behind either
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("kind", ["asyncio", "blocking"])
def test_load_callers_count_only_the_calls_they_made_in_the_window(kind):
    """Either kind of caller, against a real gRPC server (the echo server the benches use as
    gRPC's floor): each caller keeps one call in flight, the calls counted are those made in
    the window, and the first reply comes back whole."""
    from vqserve.bench.load import LoadCase, run_load, start_echo

    echo, port = start_echo(100)
    try:
        row = run_load(f"127.0.0.1:{port}", LoadCase("v1", "raw", 2), _images(1, size=32), 1, 3, 1.0, 0.2,
                       server_pid=echo.pid, kind=kind)
    finally:
        echo.kill()
    assert not row["errors"] and row["calls"] >= 1, row  # any count: no timing limit (the machine may be at load 10)
    assert row["caller_kind"] == kind and row["callers"] == 3
    assert row["throughput"] == pytest.approx(row["calls"] * 2 / 1.0)
    assert row["first_reply"] == b"\0" * 100
    assert row["p50_ms"] <= row["p99_ms"]


def test_load_caller_kinds_refuse_an_unknown_kind_in_one_line():
    import argparse

    from vqserve.bench.load import caller_kinds, run_load

    assert caller_kinds("asyncio, blocking") == ("asyncio", "blocking")
    for bad in ("threads", "asyncio,green", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="asyncio or blocking"):
            caller_kinds(bad)
    with pytest.raises(ValueError, match="callers are one of"):
        run_load("127.0.0.1:1", None, None, 1, 1, 0.1, 0.0, kind="threads")


def test_frontends_flag_defaults_by_device_and_refuses_nonsense():
    from vqserve.commands.serve import resolve_frontends
    from vqserve.serve.split.pool import default_frontends

    assert resolve_frontends("auto", "default", "cpu") == 0  # the CPU is the model's: one process
    assert resolve_frontends("auto", "synthetic:10", "cpu") >= 1  # a (stand-in) accelerator
    assert default_frontends("cuda", 16) == 8 and default_frontends("cuda:1", 4) == 2
    assert default_frontends("synthetic:0", 2) == 1 and default_frontends("cuda", 1) == 1
    assert default_frontends("cuda", 64) == 8 and default_frontends("cpu", 64) == 0
    assert resolve_frontends(3, "default", "cpu") == 3
    done = subprocess.run([sys.executable, "-m", "vqserve", "serve", "--model", "synthetic:0", "--frontends", "many"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--frontends" in done.stderr and "expected a number of processes or auto" in done.stderr


@pytest.mark.parametrize(("frontends", "warned"), [(2, True), (1, False)])
def test_more_frontends_than_cores_serve_but_say_what_they_cost(frontends, warned):
    """The server runs on one core (its affinity, which it counts): 2 front-ends serve, with
    a warning naming both numbers (100 front-ends on 2 cores once took minutes to start,
    silently); 1 front-end gets no warning."""
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mask)})  # the server inherits one core
    try:
        srv = ServeProcess(["--model", "synthetic:0", "--frontends", str(frontends)])
    finally:
        os.sched_setaffinity(0, mask)
    with srv:
        images = _images(2, seed=5)
        np.testing.assert_array_equal(TokenizerClient(srv.target).encode(images), block_tokens(images))
        warnings = [json.loads(line) for line in srv.log if '"frontends_exceed_cores"' in line]
        listening = json.loads(next(line for line in srv.log if '"event": "listening"' in line))
    assert [(w["level"], w["frontends"], w["cores"]) for w in warnings] == ([("warning", 2, 1)] if warned else [])
    assert (listening["frontends"], listening["cores"]) == (frontends, 1)  # the cores it sized by, in its log


def test_a_real_model_behind_frontends_gives_its_in_process_tokens(tiny_checkpoint, photos):
    """The eager runtime reading pixels in place from a front-end's arena: the same tokens
    and pixels as the runtime called directly (what the layout must never change)."""
    from vqserve.export.runtimes.loader import load_runtime

    runtime = load_runtime(tiny_checkpoint)
    images = np.ascontiguousarray(photos[:3])
    with ServeProcess(["--model", tiny_checkpoint, "--frontends", "1"]) as srv:
        client = TokenizerClient(srv.target)
        tokens = client.encode(images)
        np.testing.assert_array_equal(tokens, runtime.encode(images))
        np.testing.assert_array_equal(client.decode(tokens), runtime.decode(tokens))


def test_load_requests_hold_the_images_they_count():
    """A call of 16 built from 8 photographs holds 16 images (the photographs repeated): the
    load generator's images/s counts what was sent (it once sent 8 and counted 16)."""
    from vqserve.bench.load import LoadCase, request_bytes
    from vqserve.serve._proto import tokenizer_pb2 as pb

    photos = _images(8, seed=4)
    _method, payload = request_bytes(LoadCase("v1", "raw", 16), photos)
    sent = pb.EncodeRequest.FromString(payload).images
    assert list(sent.shape) == [16, 64, 64, 3]
    pixels = np.frombuffer(sent.data, np.uint8).reshape(16, 64, 64, 3)
    np.testing.assert_array_equal(pixels[8:], photos)


def test_bench_gpu_noise_tells_ties_from_corruption(tiny_checkpoint, monkeypatch):
    """`vqserve bench gpu`'s fp32 noise row: the same fp32 tokens give no difference; a token
    moved by the device (here a stand-in that changes one) is counted, and not as a tie."""
    import torch

    from vqserve.bench.gpu import measure

    assert measure.noise_row(tiny_checkpoint, "cpu", 3, 32) == {
        "tiles": 3, "tokens": 3 * 4 * 4, "differing": 0, "images_differing": 0, "ties": 0, "not_ties": 0,
        "rate": 0.0}
    real_load = measure.load

    class OneTokenMoved:
        def __init__(self, runtime):
            self.runtime, self.info, self.tokenizer = runtime, runtime.info, runtime.tokenizer

        def encode(self, images):
            out = self.runtime.encode(images).copy()
            out.flat[0] = (int(out.flat[0]) + 1) % self.info.codebook_size
            return out

    monkeypatch.setattr(measure, "load", lambda model, dtype, device, tf32=False: (
        OneTokenMoved(real_load(model, dtype, "cpu")) if device == "gpu-stand-in" else real_load(model, dtype, device)))
    threads = torch.get_num_threads()
    row = measure.noise_row(tiny_checkpoint, "gpu-stand-in", 3, 32)  # calls of one image: one moved in each
    assert row["differing"] == 3 and row["images_differing"] == 3
    assert row["ties"] == 0 and row["not_ties"] == 3
    assert torch.get_num_threads() == threads  # the float64 pass put the process's thread count back


def test_bench_gpu_measures_the_plan_it_serves_as_planned(tiny_checkpoint, tmp_path):
    """`vqserve bench gpu --planned` serves each dtype by the plan `vqserve plan` measures
    on the machine (what --plan auto serves): the child's plan file, read back."""
    from vqserve.bench.gpu.measure import measured_plan
    from vqserve.export.runtimes.execution import ExecutionPlan

    choice = measured_plan(tiny_checkpoint, "cpu", "fp32", str(tmp_path), 600.0)
    assert "error" not in choice, choice
    assert Path(choice["file"]).is_file() and choice["line"] == ExecutionPlan.from_dict(choice["plan"]).describe()
    broken = measured_plan(str(tmp_path / "no-such-model"), "cpu", "fp32", str(tmp_path), 600.0)
    assert "file" not in broken and broken["error"]
