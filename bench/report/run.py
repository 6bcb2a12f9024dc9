"""``vqserve bench all`` (``make bench``): every benchmark of the project in one run, written
as docs/BENCHMARKS.md with PNG plots and a JSON of the raw rows.

1. runtimes per backend and dtype (``vqserve.bench.runtimes.run_bench``);
2. served vs in-process at 1/8/32 clients, native v1 and OIP v2 ``ModelInfer``;
3. dynamic batching on vs off;
4. the same tokenizer in TorchServe (its own batching, same load generator, same images),
   throughput, p50/p99 and peak RSS of each server's process tree.

Each section measures its rows side by side in interleaved rounds (``vqserve.bench.serving``),
so every ratio compares figures taken under the same machine load; the doc states the
machine, the versions and the load average sampled during the run, and says for each
target whether it was met, and by how much it was missed.

    vqserve bench all --out docs            # the full run (default model, 128x128), ~15 min on 2 cores
    vqserve bench all --quick --out /tmp/b  # tiny model, 1 s windows: a smoke run
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from vqserve.bench import inputs as bench_inputs
from vqserve.bench import runtimes as runtime_bench
from vqserve.bench import serving as serve_bench
from vqserve.bench.report.document import (
    ASSETS,
    DOC_NAME,
    JSON_NAME,
    plot_all,
    render,
    with_kept_sections,
)
from vqserve.bench.report.machine import LoadSampler, machine
from vqserve.bench.report.targets import TARGETS, _f, compute_ratios, spread, verdict

# quick: a smoke run for the test (seconds); full: what `make bench` publishes (~15 minutes)
PROFILES = {
    "quick": dict(model="tiny", size=64, duration=1.0, warmup=0.2, prime=0.5, rounds=1,
                  backends="eager,torchscript", dtypes="fp32,bf16", batches="1,8",
                  min_time=0.1, runtime_rounds=1, load_every=1.0),
    "full": dict(model="default", size=128, duration=6.0, warmup=1.0, prime=5.0, rounds=4,
                 backends="eager,torchscript,onnx,pt2", dtypes="fp32,bf16,fp16", batches="1,8",
                 min_time=1.0, runtime_rounds=3, load_every=5.0),
}


def torchserve_unavailable() -> str | None:
    """Why TorchServe cannot run here, or None."""
    if shutil.which("java") is None:
        return "java is not on PATH (TorchServe's frontend is a Java program)"
    for module in ("ts", "model_archiver", "grpc_tools"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install 'vqserve[bench]')"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vqserve bench all", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 64 px, 1 s windows, one round: a smoke run in seconds")
    p.add_argument("--out", default="docs", help=f"writes {DOC_NAME} and {ASSETS}/ here (default docs)")
    p.add_argument("--model", default=None,
                   help="default | tiny | random | checkpoint dir (default: default; --quick: tiny)")
    p.add_argument("--size", type=int, default=None, help="image side (default 128; --quick 64)")
    p.add_argument("--duration", type=float, default=None, help="seconds per point (default 6; --quick 1)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved serving rounds (default 3; --quick 1)")
    p.add_argument("--clients", default="1,8,32", help="concurrent clients (default 1,8,32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads everywhere (default 1)")
    p.add_argument("--max-batch-size", type=int, default=32, help="both servers (default 32)")
    p.add_argument("--max-delay-ms", type=float, default=5.0, help="both servers (default 5)")
    p.add_argument("--torchserve", action=argparse.BooleanOptionalAction, default=None,
                   help="include TorchServe (default: when java and the packages are present)")
    p.add_argument("--runtimes", action=argparse.BooleanOptionalAction, default=True,
                   help="include the runtime table (default on)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prof = dict(PROFILES["quick" if args.quick else "full"])
    for key in ("model", "size", "duration", "rounds"):
        if getattr(args, key) is not None:
            prof[key] = getattr(args, key)
    clients = [int(c) for c in args.clients.split(",")]
    skipped = torchserve_unavailable()
    use_ts = args.torchserve if args.torchserve is not None else skipped is None
    if args.torchserve is False:
        skipped = "left out with --no-torchserve"
    elif use_ts and skipped:
        raise ValueError(f"--torchserve: {skipped}")
    out = Path(args.out)
    assets = out / ASSETS

    import tempfile

    import torch

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    started = time.monotonic()
    command = "vqserve bench all " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict = {"command": command.strip(), "started_utc": _dt.datetime.now(_dt.timezone.utc)
                    .isoformat(timespec="seconds"), "machine": machine()}
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="vqserve-bench-all-") as tmp, \
            LoadSampler(prof["load_every"]) as load:
        model = bench_inputs.bench_model(prof["model"], Path(tmp))
        photos = bench_inputs.bench_photos(prof["size"])
        runtime_rows: list[dict] = []
        runtime_raw: list[dict] = []
        if args.runtimes:
            log("== runtimes per backend and dtype")
            rargs = SimpleNamespace(model=model, backends=prof["backends"], dtypes=prof["dtypes"],
                                    batches=prof["batches"], size=prof["size"], device="cpu",
                                    threads=args.threads, min_time=prof["min_time"], min_repeats=2,
                                    artifacts=None, rounds=prof["runtime_rounds"])
            runtime_rows = runtime_bench.run_bench(rargs, log, images=photos, raw=runtime_raw)
        phases = {"runtimes": time.monotonic() - started}
        log("== serving: in-process, vqserve v1/OIP, batching off" + (", TorchServe" if use_ts else ""))
        sargs = serve_bench.build_parser().parse_args([
            "--model", model, "--device", "cpu", "--size", str(prof["size"]),
            "--clients", args.clients, "--duration", str(prof["duration"]),
            "--warmup", str(prof["warmup"]), "--prime", str(prof["prime"]),
            "--repeats", str(prof["rounds"]), "--max-batch-size", str(args.max_batch_size),
            "--max-delay-ms", str(args.max_delay_ms), "--threads", str(args.threads),
            *(["--torchserve"] if use_ts else [])])
        serving = serve_bench.run(sargs, log)
        phases["serving"] = time.monotonic() - started - phases["runtimes"]
    result.update(
        wall_s=time.monotonic() - started, phases_s=phases, load=load.summary(),
        runtimes=runtime_rows, runtime_rounds=runtime_raw,
        noise={"serving": spread(serving["rows"], ("mode", "level"), "throughput"),
               "runtimes": spread(runtime_raw, ("backend", "dtype", "batch"), "encode_img_s")},
        serving=serving, torchserve_skipped=None if use_ts else skipped,
        settings={"model": prof["model"], "size": prof["size"], "clients": clients,
                  "duration": prof["duration"], "warmup": prof["warmup"], "prime": prof["prime"],
                  "rounds": prof["rounds"], "threads": args.threads,
                  "max_batch_size": args.max_batch_size, "max_delay_ms": args.max_delay_ms,
                  "photos": list(bench_inputs.PHOTOS), "backends": prof["backends"],
                  "dtypes": prof["dtypes"], "batches": prof["batches"],
                  "min_time": prof["min_time"], "runtime_rounds": prof["runtime_rounds"]})
    result["ratios"] = compute_ratios(serving["best"], serving["memory"], max(clients))
    result["verdicts"] = [verdict(k, result["ratios"][k]) for k in TARGETS]
    result["plots"] = plot_all(result, assets)
    (assets / JSON_NAME).write_text(json.dumps(result, indent=2) + "\n")
    (out / DOC_NAME).write_text(with_kept_sections(render(result), out / DOC_NAME))
    log(f"wrote {out / DOC_NAME}, {assets}/ ({', '.join(result['plots'])}, {JSON_NAME}) "
        f"in {result['wall_s'] / 60:.1f} minutes")
    for v in result["verdicts"]:
        log(f"  {v['what']}: {_f(v['value'])} (target {v['target']}): {v['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
