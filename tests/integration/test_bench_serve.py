"""`vqserve bench serve`'s comparison modes, run for real on the tiny model for a second or so.

Not performance tests: they check that the in-process-capacity pool runs the runtime in
separate one-thread processes and returns the runtime's own tokens, that the benchmark reads
which execution plan a server ended up on, and that TorchServe-best really starts N workers
with its batch. No timing is asserted.
"""

from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest

from tests.helpers import ROOT
from vqserve.bench import closed_loop, inputs, processes, servers
from vqserve.bench import serving as bench
from vqserve.export.runtimes.loader import load_runtime
from vqserve.serve.config import ServerConfig
from vqserve.serve.launcher import ServerThread

# one TorchServe at a time: its ports come from one range (make test runs two pytest workers)
pytestmark = pytest.mark.xdist_group("torchserve")

SIZE = 32


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return inputs.bench_photos(SIZE)[:4]


@pytest.fixture(scope="module")
def expected(tiny_checkpoint, images, one_thread) -> np.ndarray:
    """The runtime's own tokens, one image per call on one thread, as the workers run it."""
    runtime = load_runtime(tiny_checkpoint, backend="eager", device="cpu")
    return np.stack([runtime.encode(x[None])[0] for x in images])


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"backend": "eager", "dtype": None, "device": "cpu", "method": "encode",
                                 "max_batch_size": 8, "max_delay_ms": 5.0, "threads": 1, **kw})


def test_capacity_pool_runs_one_thread_per_process_and_returns_the_runtimes_tokens(
        tiny_checkpoint, images, expected):
    pool = closed_loop.CapacityPool(tiny_checkpoint, _args(), images, workers=2)
    try:
        assert len(set(pool.pids)) == 2 and set(pool.threads.values()) == {1}
        for c in range(len(images)):  # straight answers, whichever worker takes them
            pool.submit(c, c)
        answers = dict(pool.answer() for _ in images)
        for c in range(len(images)):
            np.testing.assert_array_equal(answers[c], expected[c])
        # 5 clients over 4 images: client 4 sends image 0 again; a window that is over
        # before the warm-up answers come back (duration 0) still times one call per client
        for level, duration, warmup in ((1, 0.5, 0.1), (5, 0.5, 0.1), (3, 0.0, 0.0)):
            row = closed_loop.bench_capacity(pool, expected, level, duration=duration, warmup=warmup)
            assert row["mode"] == "in-process-capacity" and row["level"] == level
            assert row["requests"] >= level and row["throughput"] > 0
            assert 0 < row["p50_ms"] <= row["p99_ms"]
            assert row["agreement"] == 1.0
        memory = processes.pids_memory(pool.pids)
        assert len(memory["processes"]) >= 2 and memory["peak_mb"] > 0
    finally:
        pool.stop()
    assert all(not p.is_alive() for p in pool.procs)


def test_a_failing_capacity_worker_is_reported_with_its_traceback(tmp_path, images):
    with pytest.raises(RuntimeError, match="a capacity worker failed"):
        closed_loop.CapacityPool(str(tmp_path / "no-such-model"), _args(), images, workers=1)


def test_plan_is_read_from_metrics_and_the_log():
    page = ('# HELP vqserve_execution_plan 1 for the plan\n'
            'vqserve_execution_plan{backend="eager",dtype="fp32",intra_op_threads="1",'
            'micro_batch="64:8 256:1",source="measured",workers="2"} 1.0\n')
    assert servers.plan_labels(page) == {"backend": "eager", "dtype": "fp32", "intra_op_threads": "1",
                                       "micro_batch": "64:8 256:1", "source": "measured", "workers": "2"}
    assert servers.plan_labels("vqserve_model_info{a=\"b\"} 1.0\n") is None
    lines = [json.dumps({"event": "serving", "port": 1, "plan_source": "measuring"}) + "\n",
             "not json\n", json.dumps({"event": "plan_switched", "msg": "now serving by ..."}) + "\n"]
    assert [e["event"] for e in servers.log_events(lines, "serving", "plan_switched")] == \
        ["serving", "plan_switched"]


def test_workers_take_a_count_or_cores():
    from vqserve.core.machine import available_cores

    assert servers.torchserve_workers("cores") == available_cores()
    assert servers.torchserve_workers("3") == 3
    with pytest.raises(ValueError):
        servers.torchserve_workers("0")


@pytest.mark.slow
def test_bench_serve_compares_the_server_with_the_capacity_pool(tiny_checkpoint, tmp_path, capsys,
                                                                 monkeypatch):
    """One short run: served-v1 on the fixed default plan beside in-process-capacity."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "bench.json"
    rc = bench.main(["--model", tiny_checkpoint, "--backend", "eager", "--device", "cpu", "--size", str(SIZE),
                     "--clients", "1,4", "--duration", "0.5", "--warmup", "0.2", "--prime", "0.3",
                     "--repeats", "1", "--protocols", "v1", "--no-no-batching-mode", "--capacity-mode",
                     "--capacity-workers", "2", "--server-plan", "default", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "served-v1 / in-process-capacity (2 processes x 1 thread) at 4 clients: " in text
    assert "vqserve: benchmarked on its execution plan source=default (" in text
    result = json.loads(out.read_text())
    assert [(r["mode"], r["level"]) for r in result["best"]] == [
        (m, level) for m in ("in-process", "in-process-capacity", "served-v1") for level in (1, 4)]
    for row in result["best"]:
        if row["mode"] != "in-process":
            assert row["agreement"] == 1.0, row
    assert result["capacity"] == {"workers": 2, "threads": [1]}
    assert result["plans"]["vqserve"]["source"] == "default"
    assert result["plans"]["vqserve"]["plan"]["backend"] == "eager"
    assert len(result["memory"]["in-process-capacity"]["processes"]) >= 2


def test_every_served_client_times_a_call_even_when_its_warm_up_outlasts_the_window(
        tiny_checkpoint, images, expected, one_thread):
    """A measurement window over before the clients' first (warm-up) answers arrive - a
    loaded machine, a slow server - still times one call per client instead of reporting
    none (TorchServe-best on a busy 2-core machine answered its warm-up after a 0.7 s
    window, and the row said 0 requests)."""
    config = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1", port=0,
                          metrics_port=-1, max_batch_size=8, max_delay_ms=5, grace_s=5)
    with ServerThread(config) as srv:
        row = closed_loop.bench_served("v1", srv.target, "encode", images, expected, 3, 0.0, 0.0, "served-v1")
    assert row["requests"] >= 3 and row["throughput"] > 0 and row["agreement"] == 1.0


@pytest.mark.slow
def test_torchserve_best_starts_n_workers_with_its_batch(tiny_checkpoint, tmp_path, images, expected):
    """TorchServe registered with 2 workers and batch 8 (what --torchserve-workers and
    --torchserve-batch set): both workers are up, and its answers are the runtime's."""
    if shutil.which("java") is None:
        pytest.skip("java is not on PATH: TorchServe's frontend is a Java program")
    lines: list[str] = []
    ts = servers.start_torchserve(tiny_checkpoint, _args(), tmp_path, lines.append, workers=2,
                                batch_size=8, name="run-best")
    try:
        described = ts.describe("vqserve-encode")
        assert described["batchSize"] == 8
        assert [w["status"] for w in described["workers"]] == ["READY", "READY"]
        assert "TorchServe (run-best): 2/2 worker(s) ready, batch 8, delay 5 ms" in lines
        row = closed_loop.bench_served("torchserve", f"127.0.0.1:{ts.grpc}", "encode", images, expected,
                                       4, 0.5, 0.2, "torchserve-best")
        assert row["requests"] >= 4 and row["agreement"] == 1.0
    finally:
        ts.stop()


def test_the_baseline_server_runs_the_install_it_names(tmp_path, monkeypatch):
    """Regression: ``--baseline-pythonpath DIR`` set PYTHONPATH alone, and ``python -m``
    puts the working directory first on ``sys.path``, so a benchmark run from this
    checkout's root served this checkout's code as "before" (found when both rows of a
    comparison logged the same plan line). Here DIR holds a stand-in ``vqserve`` that says
    which it is, and the benchmark runs from the checkout's root."""
    stub = tmp_path / "before" / "vqserve"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "__main__.py").write_text(
        "import json, sys, time\n"
        "print(json.dumps({'event': 'stand-in', 'argv': sys.argv[1:]}), file=sys.stderr, flush=True)\n"
        "print(json.dumps({'event': 'serving', 'port': 1, 'metrics_port': None}), file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n")
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.chdir(ROOT)
    args = argparse.Namespace(backend="eager", dtype=None, device="cpu")
    log: list[str] = []
    proc, _ = servers.start_server(str(model), args, 8, None, log=log, pythonpath=str(tmp_path / "before"))
    try:
        started = servers.log_events(log, "stand-in")
        assert started, "the baseline ran another vqserve than the one in its folder:\n" + "".join(log[-5:])
        assert started[0]["argv"][started[0]["argv"].index("--model") + 1] == str(model.resolve())
    finally:
        proc.kill()
        proc.wait()


def test_with_client_processes_each_layout_is_also_served_by_the_baseline_install(tmp_path, monkeypatch):
    """``--baseline-pythonpath DIR --client-procs P``: every layout NAME is also NAME-before,
    started from DIR (here a stand-in ``vqserve`` that says which it is and exits, so that
    layout's row is its error, carrying the stand-in's line), and the ratio lines pair each
    point with its -before partner."""
    from vqserve.bench.load import before_ratios, compare_layouts, parse_cases, with_baseline

    stub = tmp_path / "before" / "vqserve"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "__main__.py").write_text("import sys\nprint('stand-in vqserve', sys.argv[1:3], file=sys.stderr)\n"
                                      "sys.exit(3)\n")
    monkeypatch.chdir(ROOT)
    layouts, paths = with_baseline({"split": ["--frontends", "2"]}, str(tmp_path / "before"))
    assert layouts == {"split": ["--frontends", "2"], "split-before": ["--frontends", "2"]}
    assert paths == {"split-before": str(tmp_path / "before")}
    assert with_baseline({"split": []}, None) == ({"split": []}, {})
    only_before = {"split-before": layouts["split-before"]}
    rows = compare_layouts("synthetic:4", only_before, parse_cases("v1:raw:1"), np.zeros((1, 16, 16, 3), np.uint8),
                           1, 1, 0.1, rounds=1, log=lambda m: None, pythonpaths=paths)
    assert [r["layout"] for r in rows] == ["split-before"] and "stand-in vqserve" in rows[0]["error"]

    measured = [{"layout": "split", "case": "v1 raw x8", "caller_kind": "asyncio", "throughput": 300.0},
                {"layout": "split-before", "case": "v1 raw x8", "caller_kind": "asyncio", "throughput": 250.0},
                {"layout": "single", "case": "v1 raw x8", "caller_kind": "asyncio", "throughput": 90.0},
                {"layout": "single-before", "error": "did not start"}]
    lines = before_ratios(measured)
    assert len(lines) == 1 and lines[0].startswith("split / split-before") and "1.200 (300 / 250 img/s)" in lines[0]
