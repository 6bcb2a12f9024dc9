"""Serving benchmark (``vqserve bench serve``): what does serving cost over calling the
runtime in-process, does dynamic batching pay, and how does the same tokenizer fare in
TorchServe?

Modes, measured side by side in interleaved rounds (the mode order rotates each round, so
a shared machine's load changes do not favour one mode; each point keeps its best round):

* ``in-process``: the runtime called directly at batch sizes 1, 8, 32;
* ``served-v1`` / ``served-oip``: one real ``vqserve serve`` process on loopback, called by
  1, 8 and 32 concurrent asyncio clients over the native v1 protocol and over OIP v2
  ``ModelInfer`` (same process, same batcher);
* ``served-v1-no-batching``: a second ``vqserve serve`` with ``--max-batch-size 1
  --max-delay-ms 0``;
* ``in-process-plan`` (``--plan-modes``): the runtime run by the execution plan ``vqserve
  serve --plan auto`` chose on this machine (its dtype, micro-batch per size, workers), at
  batch sizes 1, 8, 32: the best in-process path the served numbers are compared with;
* ``served-v1-before`` (``--baseline-pythonpath DIR``): a ``vqserve serve`` from another
  install (e.g. the previous commit, ``pip install --no-deps --target DIR <checkout>``),
  with its own defaults, over v1: "never slower than before";
* ``torchserve`` (``--torchserve``): the same model in TorchServe archives
  (``vqserve.export.torchserve.archives``), one worker, with TorchServe's batching set to the same
  size and delay, called over TorchServe's gRPC ``Predictions`` (``.npy`` bodies);
* ``torchserve-best`` (``--torchserve-workers N|cores``, ``--torchserve-batch B``): a second
  TorchServe from the same archives with N workers and batch B (one worker per core and
  batch 8 is TorchServe at its best on a CPU): TorchServe as its users would tune it;
* ``in-process-capacity`` (``--capacity-mode``): the same runtime in one process per usable
  core (``--capacity-workers``), each on one torch thread and one call at a time, fed one
  image per request from a shared queue by the same closed-loop client levels: the
  machine's raw capacity with no serving in between, what a server could reach at best.

``vqserve serve`` chooses its execution plan itself (``--plan auto``: the cached plan, else
the safe plan while a faster one is measured in the background, then a switch). The
benchmark measures the server by the plan it ends up on: it waits until ``/metrics``
(``vqserve_execution_plan{source=...}``) and the server's ``plan_switched`` /
``plan_not_measured`` log lines say the measurement is over, and prints which plan it was
(``--server-plan default`` measures the fixed default plan instead).

Every client sends one image per request, back to back, over its own gRPC channel; the
images are whole scikit-image photographs resized to ``--size``. Throughput is each
client's calls that started inside the window over the time they took, summed over
clients; p50/p99 are per request. Memory is the peak RSS
(``VmHWM``) of each server's process tree: ``vqserve serve`` is one process; TorchServe is
its Java frontend plus its Python workers; in-process-capacity is its worker processes.

    python -m vqserve.bench.serving --model default --size 128 --duration 10 --torchserve
    python -m vqserve.bench.serving --size 256 --capacity-mode --torchserve --torchserve-workers cores --torchserve-batch 8
    python -m vqserve.bench.serving --model random --size 64   # default architecture, random weights
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vqserve.bench.closed_loop import (
    CAPACITY,
    CapacityPool,
    bench_capacity,
    bench_in_process,
    bench_served,
    planned_in_process,
)
from vqserve.bench.inputs import bench_model, bench_photos
from vqserve.bench.load import (
    before_ratios,
    caller_kinds,
    capacity_of,
    compare_layouts,
    layouts_table,
    parse_cases,
    parse_layouts,
    with_baseline,
)
from vqserve.bench.processes import pids_memory, tree_memory
from vqserve.bench.profiling import ProfileRequest
from vqserve.bench.servers import settle_plan, start_server, start_torchserve, torchserve_workers
from vqserve.core.machine import available_cores
from vqserve.export.runtimes.execution import warm_allocator


# ---- the run -------------------------------------------------------------------------------
@dataclass
class Served:
    """A running server and how to reach it."""

    mode: str
    protocol: str
    target: str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vqserve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="default | checkpoint dir | artifact dir | random | tiny (random weights)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: fp32, or the artifact's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--method", default="encode", choices=["encode", "decode"])
    p.add_argument("--size", type=int, default=64, help="image height = width (a multiple of the factor)")
    p.add_argument("--clients", default="1,8,32", help="comma-separated concurrent client counts")
    p.add_argument("--protocols", default="v1,oip", help="vqserve protocols to load: v1, oip")
    p.add_argument("--torchserve", action="store_true",
                   help="also serve the model in TorchServe (needs java and vqserve[torchserve])")
    p.add_argument("--torchserve-workers", default="1", metavar="N|cores",
                   help="torchserve-best: TorchServe workers, a count or 'cores' (one per usable core); "
                        "a count other than 1 or a --torchserve-batch starts a second TorchServe, "
                        "torchserve-best, beside --torchserve's 1-worker one (default 1: none)")
    p.add_argument("--torchserve-batch", type=int, default=None,
                   help="torchserve-best: TorchServe's batch size (default: --max-batch-size; 8 is its best on CPU)")
    p.add_argument("--no-batching-mode", action=argparse.BooleanOptionalAction, default=True,
                   help="also run vqserve with batching off (v1)")
    p.add_argument("--capacity-mode", action=argparse.BooleanOptionalAction, default=False,
                   help="also measure in-process-capacity: the runtime in one process per core, one "
                        "thread and one call each, fed by the same clients (the machine's raw capacity)")
    p.add_argument("--capacity-workers", default="cores", metavar="N|cores",
                   help="in-process-capacity's processes (default: one per usable core)")
    p.add_argument("--server-plan", choices=["auto", "default"], default=None,
                   help="the vqserve servers' --plan (default: theirs, auto unless VQSERVE_PLAN says otherwise); "
                        "with auto the benchmark waits until the server serves by its measured or cached "
                        "plan, and prints which plan it measured")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of calls before each window")
    p.add_argument("--prime", type=float, default=5.0,
                   help="seconds of unmeasured load on each server after it starts")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each point keeps its best")
    p.add_argument("--max-batch-size", type=int, default=32, help="both servers' batch size")
    p.add_argument("--max-delay-ms", type=float, default=None,
                   help="vqserve's batch delay (default: the server's own, 0) and TorchServe's (default 5)")
    p.add_argument("--plan-modes", action="store_true",
                   help="also measure in-process-plan: the runtime run by the plan --plan auto chose")
    p.add_argument("--baseline-pythonpath", default=None,
                   help="also serve with the vqserve installed in this directory (served-v1-before; with "
                        "--client-procs, each layout NAME also as NAME-before, measured by the same clients)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for the in-process runtime and every server (0 = torch default)")
    p.add_argument("--json", help="also write the results to this JSON file")
    g = p.add_argument_group("clients in other processes (--client-procs P)")
    g.add_argument("--client-procs", type=int, default=0,
                   help="measure with P client processes instead (bench/load.py): each server layout "
                        "of --layouts, interleaved; served / capacity for --model synthetic:N")
    g.add_argument("--client-callers", "--client-threads", dest="client_callers", type=int, default=8,
                   help="callers per client process, each with one call in flight")
    g.add_argument("--client-kind", type=caller_kinds, default=("asyncio",),
                   help="the callers, comma-separated to measure each, interleaved: asyncio (coroutines on "
                        "one event loop per process, the least client CPU per call: on a small machine the "
                        "clients share the server's cores) or blocking (a thread per caller with a blocking "
                        "stub, as most users' clients are)")
    g.add_argument("--layouts", default="single=--frontends 0;split=--frontends auto",
                   help="NAME=serve flags, ';'-separated: the servers compared")
    g.add_argument("--cases", default="v1:raw:8,v1:raw:1",
                   help="protocol:payload:images per call, comma-separated: v1|oip, and raw|jpeg (encode) "
                        "or decode|decode-png (decode the server's tokens of the images: raw pixel or PNG "
                        "replies), e.g. v1:decode:16,oip:decode-png:16")
    g.add_argument("--floor", action="store_true",
                   help="also measure an echo server (gRPC alone, no model): the ceiling on this machine")
    g.add_argument("--profile", metavar="CASE", default=None,
                   help="after the rounds, one more window of this case (e.g. 'v1 raw x1') on each layout "
                        "with py-spy sampling every server process: each thread's share of the window on "
                        "the CPU and its top frames, in the JSON and in raw files (needs py-spy)")
    g.add_argument("--profile-dir", default="vqserve-profile",
                   help="where --profile writes py-spy's raw files (created if missing)")
    g.add_argument("--profile-seconds", type=float, default=3.0, help="the profiled window")
    return p


def run(args, log=lambda m: print(m, flush=True)) -> dict:
    """Start the servers (and the capacity pool), measure every mode at every level in
    interleaved rounds, stop them; return ``{"rows": every round's rows, "best": the kept
    rows, "memory": ..., "plans": the plan each vqserve server was measured on}``."""
    import torch

    from vqserve.export.runtimes.loader import load_runtime

    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the vqserve servers
    clients = [int(c) for c in args.clients.split(",")]
    protocols = [p for p in args.protocols.split(",") if p]
    unknown = set(protocols) - {"v1", "oip"}
    if unknown:
        raise ValueError(f"--protocols takes v1 and oip, got {sorted(unknown)}")
    ts_workers = torchserve_workers(args.torchserve_workers)
    ts_batch = args.torchserve_batch or args.max_batch_size
    ts_best = (ts_workers, ts_batch) != (1, args.max_batch_size)
    plan_flags = ["--plan", args.server_plan] if args.server_plan else []

    tmp = tempfile.TemporaryDirectory(prefix="vqserve-bench-")
    model = bench_model(args.model, Path(tmp.name))
    runtime = load_runtime(model, backend=args.backend, dtype=args.dtype, device=args.device)
    info = runtime.info
    photos = bench_photos(args.size)
    warm_allocator()  # as every capacity worker does: the in-process rows never depend on chance
    if args.method == "encode":
        inputs = photos
    else:
        inputs = np.stack([runtime.encode(p[None])[0] for p in photos])
    expected = np.stack([getattr(runtime, args.method)(x[None])[0] for x in inputs])
    log(f"model {args.model}: {info.backend}/{info.dtype} on {info.device}, codebook {info.codebook_size}, "
        f"factor {info.factor}; {args.method} {args.size}x{args.size}; {available_cores()} usable CPUs, "
        f"torch threads {torch.get_num_threads()}")

    procs: list[subprocess.Popen] = []
    served: list[Served] = []
    servers: dict[str, tuple[int, bool]] = {}  # name -> (root pid of its tree, count the root)
    torchserves: list = []
    pool: CapacityPool | None = None
    memory: dict[str, dict] = {}
    plans: dict[str, dict] = {}
    rows: list[dict] = []
    try:
        server_log: list[str] = []
        proc, port = start_server(model, args, args.max_batch_size, args.max_delay_ms,
                                  extra=plan_flags, log=server_log)
        procs.append(proc)
        servers["vqserve"] = (proc.pid, True)
        # before the other servers start: they find its plan in the cache, none measures alongside
        plans["vqserve"] = settle_plan("vqserve", proc, server_log, log)
        if args.baseline_pythonpath:
            before_log: list[str] = []
            proc, port_b = start_server(model, args, args.max_batch_size, None, log=before_log,
                                        pythonpath=args.baseline_pythonpath)
            procs.append(proc)
            servers["vqserve-before"] = (proc.pid, True)
            plans["vqserve-before"] = settle_plan("vqserve-before", proc, before_log, log)
            served.append(Served("served-v1-before", "v1", f"127.0.0.1:{port_b}"))
        served += [Served(f"served-{p}", p, f"127.0.0.1:{port}") for p in protocols]
        if args.no_batching_mode:
            off_log: list[str] = []
            proc, port = start_server(model, args, 1, 0.0, extra=plan_flags, log=off_log)
            procs.append(proc)
            servers["vqserve-no-batching"] = (proc.pid, True)
            plans["vqserve-no-batching"] = settle_plan("vqserve-no-batching", proc, off_log, log)
            served.append(Served("served-v1-no-batching", "v1", f"127.0.0.1:{port}"))
        ts_args = argparse.Namespace(**{**vars(args), "max_delay_ms": args.max_delay_ms or 5.0})
        if args.torchserve:
            torchserves.append(start_torchserve(model, ts_args, Path(tmp.name), log))
            # the launcher script only waits on Java: count the frontend and its workers
            servers["torchserve"] = (torchserves[-1].proc.pid, False)
            served.append(Served("torchserve", "torchserve", f"127.0.0.1:{torchserves[-1].grpc}"))
        if ts_best:
            torchserves.append(start_torchserve(model, ts_args, Path(tmp.name), log, workers=ts_workers,
                                                batch_size=ts_batch, name="run-best"))
            servers["torchserve-best"] = (torchserves[-1].proc.pid, False)
            served.append(Served("torchserve-best", "torchserve", f"127.0.0.1:{torchserves[-1].grpc}"))
        if args.capacity_mode:
            workers = torchserve_workers(args.capacity_workers)
            log(f"starting {workers} capacity worker process(es), one torch thread each")
            pool = CapacityPool(model, args, inputs, workers)
            bench_capacity(pool, expected, max(clients), args.prime, 0.0)  # as the servers are primed
        for m in served:  # first calls are slow (JVM JIT, lazy allocations): not measured
            bench_served(m.protocol, m.target, args.method, inputs, expected, max(clients),
                         args.prime, 0.0, m.mode)
        in_process = {"in-process": runtime}
        if args.plan_modes:
            in_process["in-process-plan"] = planned_in_process(model, args)
        modes: list[str | CapacityPool | Served] = [*in_process, *([pool] if pool else []), *served]

        def measure(m, level: int) -> dict:
            if isinstance(m, str):
                row = bench_in_process(in_process[m], inputs, level, args.duration, args.method)
                row["mode"] = m
                return row
            if isinstance(m, CapacityPool):
                return bench_capacity(m, expected, level, args.duration, args.warmup)
            return bench_served(m.protocol, m.target, args.method, inputs, expected,
                                level, args.duration, args.warmup, m.mode)

        for r in range(args.repeats):
            for level in clients:
                k = r % len(modes)
                results = []
                for m in modes[k:] + modes[:k]:
                    row = measure(m, level)
                    row["round"] = r + 1
                    results.append(row)
                rows.extend(results)
                log(f"round {r + 1}/{args.repeats}, {level}: "
                    + ", ".join(f"{x['mode']} {x['throughput']:.1f}/s" for x in results))
        # peaks over the whole run, read before the servers stop
        memory = {name: tree_memory(pid, root) for name, (pid, root) in servers.items()}
        if pool is not None:
            memory[CAPACITY] = pids_memory(pool.pids)
    finally:
        for proc in procs:  # all drain at once, TorchServe meanwhile
            proc.terminate()
        if pool is not None:
            pool.stop()
        for ts in torchserves:
            ts.stop()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["mode"], row["level"])
        if key not in best or row["throughput"] > best[key]["throughput"]:
            best[key] = row
    order = [*in_process, *([CAPACITY] if pool else []), *(m.mode for m in served)]
    kept = [best[(m, level)] for m in order for level in clients]
    result = {"rows": rows, "best": kept, "memory": memory, "model_info": _info_dict(info), "plans": plans}
    if pool is not None:
        result["capacity"] = {"workers": len(pool.procs), "threads": sorted(set(pool.threads.values()))}
    if ts_best:
        result["torchserve_best"] = {"workers": ts_workers, "batch_size": ts_batch}
    return result


def _info_dict(info) -> dict:
    return {"backend": info.backend, "dtype": info.dtype, "device": info.device,
            "quantizer": info.quantizer, "codebook_size": info.codebook_size, "factor": info.factor,
            "model_hash": info.model_hash}


def pick(rows: list[dict], mode: str, level: int) -> dict | None:
    return next((r for r in rows if r["mode"] == mode and r["level"] == level), None)


def client_process_mode(args) -> int:
    """``--client-procs P``: clients in P other processes against each server layout
    (``--layouts``), interleaved; served / capacity for ``synthetic:N``, the server's CPU per
    image over all its processes, and the gRPC floor (an echo server) on the same machine."""
    cases = parse_cases(args.cases)
    layouts = parse_layouts(args.layouts, ["--plan", args.server_plan or "default"])
    layouts, pythonpaths = with_baseline(layouts, args.baseline_pythonpath)
    profile = None
    if args.profile:
        if args.profile not in [c.label for c in cases]:
            raise ValueError(f"--profile {args.profile!r} is not one of --cases: "
                             + ", ".join(repr(c.label) for c in cases))
        profile = ProfileRequest(Path(args.profile_dir), args.profile, args.profile_seconds)
    photos = bench_photos(args.size)
    capacity, cores = capacity_of(args.model), available_cores()
    print(f"bench serve: {args.model}, {args.size}x{args.size}, {args.client_procs} client processes x "
          f"{args.client_callers} callers ({', '.join(args.client_kind)}), {cores} usable CPUs"
          + (f"; device capacity {capacity:.0f} img/s at 256x256" if capacity else ""), flush=True)
    rows = compare_layouts(args.model, layouts, cases, photos, args.client_procs, args.client_callers,
                           args.duration, args.repeats, args.device, args.dtype, floor=args.floor,
                           log=lambda m: print(m, flush=True), kinds=args.client_kind, profile=profile,
                           warmup=args.warmup, pythonpaths=pythonpaths)
    print()
    print(layouts_table(rows, capacity, args.size))
    if pythonpaths:
        print("\nthis install / the one in --baseline-pythonpath, same clients, interleaved rounds (best round each):")
        print("\n".join(before_ratios(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "capacity": capacity, "rows": rows,
                                               "cpus": cores}, indent=1))
    return 0


def check_numbers(args) -> None:
    """The run's counts and seconds, refused in one line before any server starts (before:
    --duration 0 or --clients 0 ended in ZeroDivisionError, --repeats 0 in KeyError, and
    --client-callers 0 printed a table of zeros)."""
    try:
        clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise ValueError(f"--clients takes comma-separated counts, got {args.clients!r}") from None
    rules = [("--duration", args.duration > 0, "a positive number of seconds", args.duration),
             ("--warmup", args.warmup >= 0, "0 or more seconds", args.warmup),
             ("--prime", args.prime >= 0, "0 or more seconds", args.prime),
             ("--repeats", args.repeats >= 1, "at least 1", args.repeats),
             ("--clients", min(clients) >= 1, "counts of at least 1", args.clients),
             ("--client-procs", args.client_procs >= 0, "0 (clients in this process) or more", args.client_procs),
             ("--client-callers", args.client_callers >= 1, "at least 1", args.client_callers),
             ("--profile-seconds", args.profile_seconds > 0, "a positive number of seconds", args.profile_seconds)]
    for flag, ok, want, got in rules:
        if not ok:
            raise ValueError(f"{flag} must be {want}, got {got}")


def main(argv: list[str] | None = None) -> int:
    from vqserve.export.runtimes.loader import resolve_device

    args = build_parser().parse_args(argv)
    check_numbers(args)
    resolve_device(args.device)  # a GPU this machine lacks: one line, before any server starts
    if args.client_procs:
        return client_process_mode(args)
    result = run(args)
    rows = result["best"]
    print(f"\n{'mode':<24}{'batch/clients':>14}{'images/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    for r in rows:
        print(f"{r['mode']:<24}{r['level']:>14}{r['throughput']:>12.1f}{r['p50_ms']:>10.1f}{r['p99_ms']:>10.1f}")
    top = max(int(c) for c in args.clients.split(","))
    base = pick(rows, "in-process", top)
    for mode in ("served-v1", "served-oip"):
        row = pick(rows, mode, top)
        if row:
            print(f"{mode} / in-process at {top} clients: {row['throughput'] / base['throughput']:.2f} "
                  "(target >= 0.90)")
    on, off = pick(rows, "served-v1", top), pick(rows, "served-v1-no-batching", top)
    if on and off:
        print(f"batching on / off at {top} clients: {on['throughput'] / off['throughput']:.2f}")
    cap = pick(rows, CAPACITY, top)
    if on and cap:
        workers = result["capacity"]["workers"]
        print(f"served-v1 / in-process-capacity ({workers} processes x 1 thread) at {top} clients: "
              f"{on['throughput'] / cap['throughput']:.2f} of the machine's raw capacity")
    best = result.get("torchserve_best", {})
    for mode, label in (("torchserve", "TorchServe (1 worker)"),
                        ("torchserve-best", f"TorchServe-best ({best.get('workers')} workers, "
                                            f"batch {best.get('batch_size')})")):
        ts = pick(rows, mode, top)
        if on and ts:
            print(f"vqserve / {label} at {top} clients: throughput {on['throughput'] / ts['throughput']:.2f} "
                  f"(target >= 2), p99 {on['p99_ms'] / ts['p99_ms']:.2f} (target <= 0.5)")
    for name, plan in result["plans"].items():
        print(f"{name} was benchmarked on its execution plan source={plan['source']}")
    for name, mem in result["memory"].items():
        print(f"{name}: peak RSS {mem['peak_mb']:.0f} MiB over {len(mem['processes'])} process(es)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
