"""``vqserve bench gpu``: every GPU figure the project reports, from one command.

GPU time is scarce, so one run measures, side by side on the same device:

1. **tokens** of whole photographs on the GPU in fp32 (TF32 off), with TF32, in bf16 and fp16,
   each against CPU fp32; whether each dtype's tokens are batch-invariant (every image
   alone vs in one call of all) and equal in power-of-two buckets to calls of 64; and the
   **fp32 noise** on ``--noise-tiles`` photo crops: how many device tokens differ from CPU
   fp32, and whether each is an fp32 tie (``model/ties.py``, on float64 latents);
2. **in-process** images/s per dtype and batch: the runtime run by the server's plan (CUDA
   graphs included), the ceiling; and **CUDA graphs** (each call shape's eager kernels
   replayed from a graph, pinned uploads: the CUDA default) against eager: tokens, pixels
   and images/s at 1 image per call and larger;
3. **served** images/s of ``vqserve serve --device cuda`` with clients in several processes
   (``bench/load.py``): v1 and OIP, raw and JPEG (q90), 1 and 16 images per call, and
   decode (2c: in-process decode; served decode with raw pixel or PNG replies), for the
   front-end/executor layout (``--frontends auto``; ``--layouts`` adds others, e.g. one
   process), and that layout with ``--no-cuda-graphs``, each dtype served at
   its best in-process batch, and (``--planned``) by the plan ``vqserve plan`` measures on
   the machine, which is what ``--plan auto`` serves;
4. **tokenize** end to end vs the raw runtime (``vqserve bench tokenize``), with CUDA graphs
   and with ``--no-cuda-graphs``;
5. achieved **TFLOP/s** (the encoder's FLOPs per image, counted once, times images/s).

It prints one table and writes ``--json``, section by section; a section that fails is
recorded (``failed``) and the run goes on, and then exits 1. Runs on any CUDA machine;
``--device cpu``, with the real model or ``--model synthetic:N``, exercises the same code
without one (that is how it is tested).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from vqserve.bench.gpu.measure import (
    encoder_gflop,
    graphs_rows,
    load,
    measured_plan,
    noise_row,
    throughput,
    token_rows,
    tokenize_row,
)
from vqserve.bench.gpu.report import report
from vqserve.bench.gpu.targets import targets
from vqserve.bench.inputs import bench_photos
from vqserve.bench.load import caller_kinds, compare_layouts, parse_cases, parse_layouts
from vqserve.bench.profiling import ProfileRequest
from vqserve.core.machine import available_cores
from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime, plan_for
from vqserve.export.runtimes.loader import resolve_device
from vqserve.export.runtimes.synthetic import is_synthetic


def _log(msg: str) -> None:
    print(msg, flush=True)

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vqserve bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="fp32,bf16", help="served and timed precisions (tokens: also fp16, tf32)")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--batches", default="8,32,64", help="in-process batch sizes")
    p.add_argument("--seconds", type=float, default=2.5, help="per measurement")
    p.add_argument("--procs", type=int, default=8, help="client processes")
    p.add_argument("--callers", "--threads", dest="callers", type=int, default=8,
                   help="callers per client process, each with one call in flight")
    p.add_argument("--client-kind", type=caller_kinds, default=("asyncio",),
                   help="the callers, comma-separated to measure each: coroutines on one event loop per "
                        "process (asyncio) or a thread each with a blocking stub (blocking)")
    p.add_argument("--cases", default="v1:raw:1,v1:raw:16,oip:raw:16,v1:jpeg:16,"
                                      "v1:decode:1,v1:decode:16,oip:decode:16,v1:decode-png:16,oip:decode-png:16",
                   help="protocol:payload:images per call, comma-separated; payload raw or jpeg (encode: "
                        "pixels or JPEG files in), decode or decode-png (decode: raw pixels or PNGs back)")
    p.add_argument("--layouts", default="split=--frontends auto;split-eager=--frontends auto --no-cuda-graphs",
                   help="server layouts: NAME=serve flags, ';'-separated, each after --plan default "
                        "--micro-batch BEST (e.g. add 'single=--frontends 0' for one process; left out by "
                        "default to keep the whole run within 6 minutes)")
    p.add_argument("--tokenize-seconds", type=float, default=120.0, help="0 skips tokenize")
    p.add_argument("--tokenize-count", type=int, default=6000, help="images per tokenize run")
    p.add_argument("--tokenize-batch", type=int, default=32, help="tokenize --batch-size")
    p.add_argument("--tokenize-before", action="store_true",
                   help="also time tokenize's serial engine (doubles the tokenize time)")
    p.add_argument("--tokenize-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA, also tokenize with --no-cuda-graphs (eager kernel launches)")
    p.add_argument("--planned", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA, also serve each dtype by the plan `vqserve plan` measures here (what "
                        "--plan auto serves), beside the fixed plans")
    p.add_argument("--profile", metavar="CASE", default="v1 raw x1",
                   help="after each layout's served rounds of --profile-dtypes, one more window of this case "
                        "with py-spy sampling every server process (each thread's share of the window on the "
                        "CPU, the top frames: in the JSON row's 'profile', raw files in --profile-dir); '' "
                        "turns it off, and a machine without py-spy skips it")
    p.add_argument("--profile-dtypes", default="bf16", help="the dtypes --profile samples, comma-separated")
    p.add_argument("--profile-dir", default=None, help="py-spy's raw files (default: profile/ beside --json)")
    p.add_argument("--profile-seconds", type=float, default=2.0, help="the profiled window")
    p.add_argument("--skip-tokens", action="store_true", help="skip section 1 (tokens against CPU fp32)")
    p.add_argument("--noise-tiles", type=int, default=256,
                   help="photo crops whose fp32 tokens are compared with CPU fp32, ties told apart (0: skip)")
    p.add_argument("--json", help="write every figure to this file (rewritten as each section ends: a run "
                                  "stopped at a time limit keeps what it measured)")
    p.add_argument("--report", metavar="JSON", default=None,
                   help="measure nothing: print the table and the targets of a stored run (a --json file)")
    return p


class _Sections:
    """The run's sections, each guarded and saved as it ends.

    Why: on a lent GPU this command gets one try within a hard time limit. A section that
    fails (a CUDA error, a server that does not start) is recorded in ``failed`` with its
    error, and the run goes on to the next; and ``--json`` is rewritten after every section
    (``complete`` false until the end), so a run killed at its time limit still returns
    every figure measured before it."""

    def __init__(self, result: dict, json_path: str | None):
        self.result, self.json_path = result, json_path
        result["complete"] = False

    @contextlib.contextmanager
    def section(self, title: str):
        _log(title)
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the rest of the run
            trace = traceback.format_exc()
            _log(trace.rstrip())
            self.result.setdefault("failed", []).append(
                {"section": title, "error": f"{type(exc).__name__}: {exc}"[:500]})
            _log(f"  section failed, going on: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            self.save()

    def save(self) -> None:
        if self.json_path:
            partial = Path(self.json_path).with_name(Path(self.json_path).name + ".partial")
            partial.write_text(json.dumps(self.result, indent=1, default=str))
            partial.replace(self.json_path)  # whole or not at all, even if killed while writing


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        try:
            stored = json.loads(Path(args.report).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--report {args.report}: not a readable bench gpu JSON ({exc})") from None
        print(report(stored))
        return 0
    started = time.perf_counter()
    device = args.device
    synthetic = is_synthetic(args.model)
    # no GPU here: one line now, not an AssertionError from the first section or a server
    # that cannot start in each layout (synthetic:N too: its server plans for this device)
    device = resolve_device(device)
    dtypes = ["fp32"] if synthetic else [d for d in args.dtypes.split(",") if d]  # synthetic:N is exact only
    photos = bench_photos(args.size)
    result: dict = {"model": args.model, "device": device, "size": args.size}
    if device.startswith("cuda"):  # resolved above: a GPU is here (synthetic:N runs beside it too)
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
        result["torch"] = torch.__version__
    result["cpu_cores"] = available_cores()  # what the server sizes itself by (a container's CPU limit)
    _log(f"vqserve bench gpu: {args.model} on {result.get('gpu', device)}, {args.size}x{args.size}, "
         f"{result['cpu_cores']} CPUs")
    run = _Sections(result, args.json)

    if not synthetic and not args.skip_tokens:
        with run.section("1. tokens against CPU fp32"):
            result["tokens"] = token_rows(args.model, device, photos, [*dtypes, "fp16"])
            for row in result["tokens"]:
                _log(f"  {row}")
        if args.noise_tiles > 0 and device.startswith("cuda"):
            with run.section(f"1b. fp32 noise: {args.noise_tiles} photo crops, device against CPU fp32"):
                result["noise"] = noise_row(args.model, device, args.noise_tiles, args.size)
                _log(f"  {result['noise']}")
    gflop = None if synthetic else encoder_gflop(args.model, device, args.size)
    result["encoder_gflop_per_image"] = gflop

    best: dict[str, tuple[int, float]] = {}
    result["in_process"] = []
    runtimes = {}  # each dtype's runtime, loaded once for sections 2, 2b and 3
    for dtype in dtypes:  # a dtype that fails here is left out of sections 2b and 3, not the others
        with run.section(f"2. in-process images/s, {dtype}"):
            runtime = runtimes[dtype] = load(args.model, dtype, device)
            for batch in [int(b) for b in args.batches.split(",")]:
                one = throughput(runtime, photos, batch, args.seconds, callers=1)
                rate = max(one, throughput(runtime, photos, batch, args.seconds))
                result["in_process"].append({"dtype": dtype, "batch": batch, "throughput": rate, "one_caller": one,
                                             "tflops": rate * gflop / 1e3 if gflop else None})
                _log(f"  {dtype} batch {batch}: {rate:.0f} img/s (one caller {one:.0f})"
                     + (f" ({rate * gflop / 1e3:.1f} TFLOP/s)" if gflop else ""))
                if dtype not in best or rate > best[dtype][1]:
                    best[dtype] = (batch, rate)

    if device.startswith("cuda") and not synthetic:
        with run.section("2b. CUDA graphs (replayed eager kernels, pinned uploads) against eager"):
            result["cuda_graphs"] = graphs_rows(runtimes, photos, best)
            for row in result["cuda_graphs"]:
                _log(f"  {row}")

    result["decode_in_process"] = []
    for dtype in [d for d in dtypes if d in runtimes]:
        with run.section(f"2c. in-process decode images/s, {dtype}"):
            for batch in [int(b) for b in args.batches.split(",")]:
                rate = throughput(runtimes[dtype], photos, batch, args.seconds, method="decode")
                result["decode_in_process"].append({"dtype": dtype, "batch": batch, "throughput": rate})
                _log(f"  {dtype} decode batch {batch}: {rate:.0f} img/s")

    cases = parse_cases(args.cases)
    result["served"] = []
    for dtype, (batch, _rate) in best.items():
        with run.section(f"3. served {dtype}, clients in several processes"):
            result["served"] += served_rows(args, dtype, batch, runtimes[dtype], photos, cases, result)

    if args.tokenize_seconds > 0:
        with run.section("4. tokenize end to end vs raw"):
            graphs = [True, False] if device.startswith("cuda") and args.tokenize_eager and not synthetic else [True]
            result["tokenize"] = []
            for dtype in dtypes:
                for g in graphs:
                    result["tokenize"].append(tokenize_row(args.model, device, dtype, args.tokenize_seconds,
                                                           args.tokenize_count, args.tokenize_batch,
                                                           args.tokenize_before, graphs=g))
                    row = result["tokenize"][-1]
                    _log(f"  {({k: v for k, v in row.items() if not isinstance(v, (dict, list))})}")
                    run.save()

    result["seconds"] = time.perf_counter() - started
    result["targets"] = targets(result)
    result["complete"] = True
    run.save()
    print(report(result))
    return 1 if result.get("failed") else 0


def served_rows(args, dtype: str, batch: int, raw, photos: np.ndarray, cases: list, result: dict) -> list[dict]:
    """Section 3 for one dtype: each layout (and, on CUDA, the plan `vqserve plan` measures
    here, recorded in ``result["plans"]``) serving it at its best in-process batch, clients
    in several processes."""
    device, synthetic = args.device, is_synthetic(args.model)
    micro = min(batch, 64)  # each dtype served at its best in-process batch
    many = np.resize(photos, (max(c.images for c in cases), *photos.shape[1:]))
    # the tokens the server must give: this dtype run by the plan it serves with (calls of
    # `micro`); eager bf16 at another batch size may round differently on a GPU
    layouts = parse_layouts(args.layouts, ["--plan", "default", "--micro-batch", str(micro)])
    # each layout's own micro-batch (a layout's flags may set another, e.g. split-m32)
    plans = {name: plan_for(device, micro_batch=layout_micro_batch(flags, micro)) for name, flags in layouts.items()}
    tokens_by_plan = {plan: PlannedRuntime(raw, plan).encode(many) for plan in set(plans.values())}
    expected = {name: tokens_by_plan[plan] for name, plan in plans.items()}
    # a temporary folder holds the plan file the "planned" servers read, until they stop
    with tempfile.TemporaryDirectory(prefix="vqserve-bench-gpu-") as plan_dir:
        if args.planned and device.startswith("cuda") and not synthetic:
            choice = measured_plan(args.model, device, dtype, plan_dir, 240.0)
            result.setdefault("plans", []).append({"dtype": dtype, **choice})
            _log(f"  {dtype} plan: {choice.get('line') or choice.get('error')}")
            if "file" in choice:  # what --plan auto serves: its own plan, tokens by that plan
                layouts["planned"] = ["--plan", choice["file"], "--frontends", "auto"]
                planned = plans["planned"] = ExecutionPlan.from_dict(choice["plan"])
                expected["planned"] = PlannedRuntime(raw, planned).encode(many)
        rows = compare_layouts(args.model, layouts, cases, many, args.procs, args.callers, args.seconds,
                               rounds=1, device=device, dtype=dtype, log=lambda m, d=dtype: _log(f"  {d}{m}"),
                               expected=expected, warmup=1.0, kinds=args.client_kind,
                               profile=profile_request(args, dtype, cases))
    lone_calls = {r["batch"]: r["one_caller"] for r in result.get("in_process", []) if r["dtype"] == dtype}
    out = []
    for row in rows:
        plan = plans.get(row["layout"])
        m = plan.micro_batch_at(args.size * args.size) if plan is not None else None
        # a padded call costs the device a whole micro-batch: beside it, one call of m in-process
        in_call = 1e3 * m / lone_calls[m] if m in lone_calls and not plan.bucketed else None
        out.append({**row, "dtype": dtype, "micro_batch": m, "in_process_call_ms": in_call})
    return out


def profile_request(args, dtype: str, cases: list) -> ProfileRequest | None:
    """``--profile CASE`` for the dtypes of ``--profile-dtypes``: one more window of that case
    on every layout, each server process sampled by py-spy (raw files in ``--profile-dir``,
    beside ``--json`` by default), to say which code held the time where a row falls short."""
    if not args.profile or dtype not in args.profile_dtypes.split(","):
        return None
    if args.profile not in [c.label for c in cases]:
        _log(f"  --profile {args.profile!r} is not one of the cases ({', '.join(c.label for c in cases)}): "
             "nothing profiled")
        return None
    folder = args.profile_dir or (Path(args.json).parent / "profile" if args.json else Path("vqserve-profile"))
    return ProfileRequest(Path(folder) / dtype, args.profile, args.profile_seconds)


def layout_micro_batch(flags: list[str], default: int) -> int:
    """The ``--micro-batch`` a layout's serve flags end with (the last one wins, as in argparse)."""
    value = default
    for i, flag in enumerate(flags):
        if flag == "--micro-batch" and i + 1 < len(flags):
            value = int(flags[i + 1])
        elif flag.startswith("--micro-batch="):
            value = int(flag.partition("=")[2])
    return value


if __name__ == "__main__":
    sys.exit(main())
