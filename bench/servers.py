"""The servers a benchmark measures, started and read from outside as a user would:
``vqserve serve`` as a subprocess on a free loopback port (ending with the thread that
started it, so a killed benchmark leaves no server), its JSON log and ``/metrics`` page
(which execution plan it serves by, and when its background plan measurement is over),
and TorchServe from archives of the same model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from vqserve.core.lifetime import ending_with_this_thread
from vqserve.core.machine import available_cores
from vqserve.export.torchserve.archives import ARCHIVE_NAMES, build_archives
from vqserve.export.torchserve.server import TorchServe

TORCHSERVE_PORTS = (19000, 19099)
PLAN_WAIT_S = 600.0  # the server's plan budget (120 s by default) plus loading and the switch


def start_server(model: str, args, max_batch_size: int, max_delay_ms: float | None,
                 extra: list[str] | None = None, log: list[str] | None = None,
                 pythonpath: str | None = None):
    """A ``vqserve serve`` subprocess on a free loopback port, metrics on as deployed;
    returns (process, port), the process carrying ``metrics_port``. ``max_delay_ms`` None
    keeps the server's default; ``extra``: more flags (later ones win); ``log``: collects the
    server's stderr lines; ``pythonpath``: run the vqserve installed there instead of this one
    (from that folder: ``python -m`` puts the working directory first on ``sys.path``, so in
    this checkout's root PYTHONPATH alone ran this checkout's code as "before")."""
    if pythonpath and Path(model).exists():
        model = str(Path(model).resolve())  # it runs in another folder
    cmd = [sys.executable, "-m", "vqserve", "serve", "--model", model, "--backend", args.backend,
           *(["--dtype", args.dtype] if args.dtype else []), "--device", args.device,
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
           "--max-batch-size", str(max_batch_size),
           *(["--max-delay-ms", str(max_delay_ms)] if max_delay_ms is not None else []),
           "--max-queue", "4096", "--grace", "5", *(extra or [])]
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                            cwd=pythonpath or None, preexec_fn=ending_with_this_thread())  # a killed bench leaves no server
    port: list[int] = []
    ready = threading.Event()
    log = [] if log is None else log

    proc.executor_socket = None  # where the front-ends reach the device executor (--frontends N)

    def pump():
        for line in proc.stderr:
            log.append(line)
            if '"event": "listening"' in line and '"executor_socket"' in line:
                proc.executor_socket = json.loads(line).get("executor_socket")
            if '"event": "serving"' in line:
                record = json.loads(line)
                proc.metrics_port = record.get("metrics_port")  # for the benches that read /metrics
                port.append(record["port"])
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(300) or not port:
        proc.kill()
        raise RuntimeError("the server did not start:\n" + "".join(log[-20:]))
    return proc, port[0]


def log_events(lines: list[str], *names: str) -> list[dict]:
    """The server's JSON log records (one per line) whose ``event`` is one of ``names``."""
    out = []
    for line in list(lines):  # the pump thread appends meanwhile
        if '"event"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") in names:
            out.append(record)
    return out


def plan_labels(exposition: str) -> dict | None:
    """The labels of ``vqserve_execution_plan`` (the plan every model call runs by now:
    backend, dtype, micro_batch, workers, intra_op_threads, source) in a ``/metrics`` page."""
    for line in exposition.splitlines():
        if line.startswith("vqserve_execution_plan{"):
            return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line[:line.rindex("}")]))
    return None


def fetch_metrics(metrics_port: int | None) -> str | None:
    """The server's ``/metrics`` page on loopback; None where it is off or does not answer."""
    if not metrics_port:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None


def scrape_plan(metrics_port: int) -> dict | None:
    """``plan_labels`` of the server's ``/metrics`` on loopback; None where it does not answer."""
    page = fetch_metrics(metrics_port)
    return None if page is None else plan_labels(page)


def settle_plan(name: str, proc: subprocess.Popen, lines: list[str], log=print,
                timeout: float = PLAN_WAIT_S) -> dict:
    """Wait until the server serves by its final execution plan, and say which it is.

    A ``--plan auto`` server without a cached plan serves the safe plan and measures a
    faster one in a background process (up to its ``--plan-budget-s``), then switches: a
    benchmark started meanwhile would time the safe plan, or a switch, under the load of
    the measurement. Done when ``/metrics`` no longer says ``source="measuring"`` and, if it
    did at start, the log has ``plan_switched`` or ``plan_not_measured``. Returns the
    ``vqserve_execution_plan`` labels (or the ``serving`` line's plan) and the plan lines."""
    serving = (log_events(lines, "serving") or [{}])[-1]
    metrics_port = serving.get("metrics_port")
    measuring = str(serving.get("plan_source", "")).startswith("measuring")
    if measuring:
        log(f"{name}: serving the safe plan while it measures a faster one in the background; "
            "waiting for the measurement to end before measuring this server")
    deadline = time.monotonic() + timeout
    while True:
        labels = scrape_plan(metrics_port) if metrics_port else None
        source = (labels or {}).get("source") or str(serving.get("plan_source", "unknown"))
        ended = not measuring or log_events(lines, "plan_switched", "plan_not_measured")
        if ended and not source.startswith("measuring"):
            break
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode} while measuring its plan:\n"
                               + "".join(lines[-20:]))
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} still measuring its plan after {timeout:.0f} s")
        time.sleep(1.0)
    events = [{k: e.get(k) for k in ("event", "msg", "source")}
              for e in log_events(lines, "plan", "plan_switched", "plan_not_measured")]
    plan = labels or {"source": source, **(serving.get("plan") or {})}
    log(f"{name}: benchmarked on its execution plan source={source} ("
        + ", ".join(f"{k} {v}" for k, v in plan.items() if k != "source") + ")")
    for e in events:
        log(f"  {name} log: {e['event']}: {e['msg']}")
    if source.startswith("safe"):
        log(f"  note: {name}'s plan measurement did not finish; this is the safe plan, not the "
            "measured one (`vqserve plan --model ...` fills the cache without a budget)")
    return {"source": source, "plan": plan, "events": events}


def torchserve_workers(value: str) -> int:
    """``--torchserve-workers`` / ``--capacity-workers``: a count, or ``cores`` (the cores
    this process may run on)."""
    n = available_cores() if value == "cores" else int(value)
    if n < 1:
        raise ValueError(f"workers must be 1 or more, or 'cores', got {value!r}")
    return n


def start_torchserve(model: str, args, workdir: Path, log=print, workers: int = 1,
                     batch_size: int | None = None, name: str = "run"):
    """Build the archives from ``model`` (same backend and dtype as ``vqserve serve``) into
    ``workdir/store`` unless there already, start TorchServe on ports in 19000-19099 with
    its own batching set like vqserve's (``batch_size``: another batch), and register the
    archive for ``args.method`` with ``workers`` workers (``initial_workers``; each on
    ``args.threads`` threads). ``name``: its run directory under ``workdir``, so two
    TorchServes can run from one store. Returns the running ``TorchServe``."""
    delay = int(round(args.max_delay_ms))
    batch = batch_size or args.max_batch_size
    store = workdir / "store"
    if not store.exists():
        log(f"building TorchServe archives (batch {args.max_batch_size}, delay {delay} ms)")
        build_archives(model, store, backend=args.backend, dtype=args.dtype,
                       batch_size=args.max_batch_size, max_batch_delay_ms=delay,
                       device=args.device, threads=args.threads or 0)
    (workdir / name).mkdir()
    ts = TorchServe(store, workdir / name, TORCHSERVE_PORTS, threads=args.threads or 0)
    try:
        ts.wait_ready(120)
        ts.register(ARCHIVE_NAMES[args.method], batch, delay, workers=workers,
                    timeout=180 + 30 * workers)
        described = ts.describe(ARCHIVE_NAMES[args.method])
        ready = sum(w.get("status") == "READY" for w in described.get("workers", []))
        log(f"TorchServe ({name}): {ready}/{workers} worker(s) ready, batch {described.get('batchSize')}, "
            f"delay {described.get('maxBatchDelay')} ms")
    except BaseException:
        ts.stop()
        raise
    return ts
