"""``vqserve bench first-start``: what a node serves in the first minute of its first start.

A GPU node's first start has no cached plan: it serves the safe plan at once and measures
the fast one beside the traffic (serve/engine/planning.py), then switches. On an H200 exact
fp32 served half its measured plan's speed for over 45 s that way (issue 54), and stopping
the server mid-measurement printed a traceback. This starts ``vqserve serve --plan auto``
with an EMPTY plan cache under closed-loop load from client processes (bench/load.py),
measures consecutive windows from SERVING, notes when the plan switched, stops it with
SIGTERM (its stderr must hold no "Traceback" / "Exception ignored"), then starts it again on
the cache it filled - the measured plan at once - and measures one window of that: each
first-start window is read against it (target: >= 0.8 from the first minute).

    vqserve bench first-start --model default --device cuda --json first-start.json
    vqserve bench first-start --model runs/tiny --device cpu --seconds 60 --window 10
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from vqserve.bench.client_procs import parse_cases, run_load
from vqserve.bench.inputs import bench_model, bench_photos
from vqserve.bench.servers import log_events, start_server

TARGET = 0.8           # each first-minute window against the measured plan's rate
STOP_NOISE = ("Traceback", "Exception ignored")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vqserve bench first-start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default | checkpoint dir | tiny (random weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="the served dtype (default: exact fp32)")
    p.add_argument("--frontends", default="auto", help="serve --frontends (auto: the GPU node's layout)")
    p.add_argument("--case", default="v1:raw:1", help="protocol:payload:images per call (bench/load.py)")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--procs", type=int, default=8, help="client processes")
    p.add_argument("--callers", type=int, default=8, help="callers per client process")
    p.add_argument("--seconds", type=float, default=60.0, help="measured from SERVING on the first start")
    p.add_argument("--window", type=float, default=10.0, help="seconds per measured window")
    p.add_argument("--warmup", type=float, default=1.0,
                   help="seconds of calls before each window (the client processes start before it)")
    p.add_argument("--json", help="write the figures to this file")
    return p


def _stop(proc, lines: list[str]) -> dict:
    """SIGTERM, the exit status, and whether the server's stderr holds a traceback."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(120)
    except Exception:  # noqa: BLE001 - a server that does not stop is killed, and says so
        proc.kill()
        code = proc.wait()
    time.sleep(0.5)  # the log pump reads the last lines
    noise = [line.strip()[:300] for line in lines if any(n in line for n in STOP_NOISE)]
    return {"exit_code": code, "stop_noise": noise}


def first_start(args) -> dict:
    case = parse_cases(args.case)[0]
    photos = bench_photos(args.size)
    serve = argparse.Namespace(backend="auto", dtype=args.dtype, device=args.device)
    result: dict = {"model": args.model, "device": args.device, "dtype": args.dtype or "fp32",
                    "case": case.label, "clients": args.procs * args.callers, "windows": []}
    with tempfile.TemporaryDirectory(prefix="vqserve-first-start-") as work:
        cache = str(Path(work) / "plans")
        model = bench_model(args.model, Path(work))
        flags = ["--plan", "auto", "--plan-cache", cache, "--frontends", str(args.frontends)]
        lines: list[str] = []
        t0 = time.monotonic()
        proc, port = start_server(model, serve, 64, None, extra=flags, log=lines)
        result["serving_after_s"] = round(time.monotonic() - t0, 2)
        serving = time.monotonic()
        try:
            while time.monotonic() - serving < args.seconds:
                at = time.monotonic() - serving
                # the clients' processes start 1 s + --warmup before each window (bench/load.py)
                row = run_load(f"127.0.0.1:{port}", case, photos, args.procs, args.callers, args.window,
                               args.warmup, proc.pid, getattr(proc, "metrics_port", None))
                switched = bool(log_events(lines, "plan_switched", "plan_not_measured"))
                result["windows"].append({"from_s": round(at + 1.0 + args.warmup, 1), "throughput": row["throughput"],
                                          "p99_ms": row["p99_ms"], "errors": len(row["errors"]),
                                          "plan_settled": switched})
                print(f"  first start {at + 1.0 + args.warmup:5.1f} s: {row['throughput']:7.0f} img/s, p99 {row['p99_ms']:.0f} ms"
                      + ("" if switched else "  (measuring the plan)"), flush=True)
        finally:
            result["events"] = [{k: e.get(k) for k in ("event", "msg")}
                                for e in log_events(lines, "plan_measuring", "plan", "plan_switched",
                                                    "plan_not_measured")]
            result["first_stop"] = _stop(proc, lines)
        lines = []
        proc, port = start_server(model, serve, 64, None, extra=flags, log=lines)  # the cache it filled
        try:
            row = run_load(f"127.0.0.1:{port}", case, photos, args.procs, args.callers, args.window,
                           args.warmup, proc.pid, getattr(proc, "metrics_port", None))
            serving = (log_events(lines, "serving") or [{}])[-1]
            result["measured_plan"] = {"throughput": row["throughput"], "p99_ms": row["p99_ms"],
                                       "plan": serving.get("plan"), "source": serving.get("plan_source")}
        finally:
            result["second_stop"] = _stop(proc, lines)
    steady = result["measured_plan"]["throughput"]
    first_minute = [w for w in result["windows"] if w["from_s"] < 60.0]
    result["ratios"] = [round(w["throughput"] / steady, 3) if steady else None for w in result["windows"]]
    worst = min((w["throughput"] for w in first_minute), default=0.0)
    result["target"] = {"target": f"every first-minute window >= {TARGET} x the measured plan",
                        "value": round(worst / steady, 3) if steady else None,
                        "met": bool(steady) and worst >= TARGET * steady}
    result["clean_stops"] = not (result["first_stop"]["stop_noise"] or result["second_stop"]["stop_noise"]) \
        and result["first_stop"]["exit_code"] == result["second_stop"]["exit_code"] == 0
    return result


def summary(result: dict) -> str:
    t = result["target"]
    return (f"first start {result['model']} {result['dtype']} on {result['device']}, {result['case']}, "
            f"{result['clients']} clients: windows {[round(w['throughput']) for w in result['windows']]} img/s, "
            f"measured plan ({result['measured_plan']['source']}) {result['measured_plan']['throughput']:.0f} "
            f"img/s; worst first-minute window "
            f"{t['value']} of it ({'met' if t['met'] else 'MISSED'} >= {TARGET}); stops "
            f"{'clean' if result['clean_stops'] else 'NOT clean: ' + str(result['first_stop']['stop_noise'][:2])}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.seconds <= 0 or args.window <= 0 or args.warmup < 0 or args.procs < 1 or args.callers < 1:
        raise ValueError("--seconds and --window must be positive, --warmup at least 0, --procs and --callers "
                         "at least 1")
    from vqserve.export.runtimes.loader import resolve_device

    args.device = resolve_device(args.device)  # no GPU here: one line, before any server starts
    result = first_start(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(summary(result))
    return 0 if result["clean_stops"] else 1


if __name__ == "__main__":
    sys.exit(main())
