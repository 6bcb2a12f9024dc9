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
   (``bench/load.py``): v1 and OIP, raw and JPEG (q90), 1 and 16 images per call, for the
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
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from vqserve.bench.inputs import bench_photos
from vqserve.bench.load import (
    CALL_COLUMNS,
    call_columns,
    caller_kinds,
    compare_layouts,
    mean_text,
    parse_cases,
    parse_layouts,
)
from vqserve.bench.profiling import ProfileRequest, brief
from vqserve.core.lifetime import ending_with_this_thread
from vqserve.core.machine import available_cores
from vqserve.export.runtimes.loader import resolve_device
from vqserve.export.runtimes.synthetic import is_synthetic


def _log(msg: str) -> None:
    print(msg, flush=True)


def load(model: str, dtype: str, device: str, tf32: bool = False):
    from vqserve.export.runtimes.loader import load_runtime

    runtime = load_runtime(model, dtype=dtype, device=device)
    if tf32 and device.startswith("cuda"):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return runtime


def reset_tf32(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def token_rows(model: str, device: str, photos: np.ndarray, dtypes: list[str]) -> list[dict]:
    """Agreement with CPU fp32, and batch invariance, per precision on ``device``."""
    reference = load(model, "fp32", "cpu").encode(photos)
    rows = []
    for label, dtype, tf32 in [("fp32", "fp32", False), *([("tf32", "fp32", True)] if device.startswith("cuda") else []),
                               *[(d, d, False) for d in dtypes if d != "fp32"]]:
        try:
            runtime = load(model, dtype, device, tf32)
        except (ValueError, RuntimeError) as exc:
            rows.append({"precision": label, "error": str(exc)})
            continue
        together = runtime.encode(photos)
        alone = np.concatenate([runtime.encode(photos[i:i + 1]) for i in range(len(photos))])
        rows.append({"precision": label, "agree_cpu_fp32": float(np.mean(together == reference)),
                     "photos_identical": int(sum(np.array_equal(t, r) for t, r in zip(together, reference, strict=True))),
                     "photos": len(photos), "batch_invariant": bool(np.array_equal(together, alone)),
                     "buckets_equal": buckets_equal(runtime, photos)})
        reset_tf32(device)
        del runtime
    return rows


def photo_tiles(count: int, size: int, seed: int = 0) -> np.ndarray:
    """``count`` distinct ``size`` x ``size`` crops of the whole photographs (random places,
    scales and mirror images, seeded): many images' tokens from the few photographs."""
    from PIL import Image

    from vqserve.bench.inputs import PHOTOS
    from vqserve.model.photos import load_builtin_photo

    rng = np.random.default_rng(seed)
    photos = [load_builtin_photo(name) for name in PHOTOS]
    out = np.empty((count, size, size, 3), np.uint8)
    for i in range(count):
        img = photos[i % len(photos)]
        h, w = img.shape[:2]
        side = int(rng.integers(min(size, h, w) // 2, min(h, w) + 1))
        y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        tile = np.asarray(Image.fromarray(img[y:y + side, x:x + side]).resize((size, size), Image.BICUBIC))
        out[i] = tile[:, ::-1] if rng.integers(2) else tile
    return out


def noise_row(model: str, device: str, tiles: int, size: int) -> dict:
    """The device's fp32 tokens against CPU fp32 on ``tiles`` distinct photo crops: how many
    differ, and how many of those are fp32 ties (both codes within ``model/ties.DELTA`` of
    the boundary between them on float64 latents: what ``vqserve verify`` accepts)."""
    from vqserve.export.runtimes.execution import PlannedRuntime, plan_for
    from vqserve.model import ties

    images = photo_tiles(tiles, size)
    cpu = PlannedRuntime(load(model, "fp32", "cpu"), plan_for("cpu"))
    reference = cpu.encode(images)
    cpu.close()
    runtime = load(model, "fp32", device)
    got = PlannedRuntime(runtime, plan_for(device)).encode(images)
    moved = got != reference
    differ = np.nonzero(moved.reshape(len(images), -1).any(axis=1))[0]
    tie_count = other = 0
    tokenizer = getattr(runtime, "tokenizer", None)
    if len(differ) and tokenizer is not None:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(available_cores())  # the float64 reference: every core (the plan set 1)
        try:
            z64 = ties.fp64_latents(tokenizer, images[differ])
        finally:
            torch.set_num_threads(threads)  # process-wide: put back what the process ran with
        found, rest = ties.classify(tokenizer.quantizer, z64, reference[differ], got[differ])
        tie_count, other = len(found), len(rest)
    return {"tiles": tiles, "tokens": int(reference.size), "differing": int(moved.sum()),
            "images_differing": int(len(differ)), "ties": tie_count, "not_ties": other,
            "rate": float(moved.mean())}


def buckets_equal(runtime, photos: np.ndarray, micro: int = 64) -> bool:
    """Whether short calls padded to their power-of-two bucket (1, 2, 4, ...) give every
    photograph the tokens it gets in a full call of ``micro``: what ``--plan auto`` measures
    before a plan takes buckets (``ExecutionPlan.bucketed``)."""
    from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime

    many = np.ascontiguousarray(np.resize(photos, (micro, *photos.shape[1:])))
    full = PlannedRuntime(runtime, ExecutionPlan(micro, 1)).encode(many)
    bucketed = PlannedRuntime(runtime, ExecutionPlan(micro, 1, bucketed=("encode",)))
    for size in (1, 2, 3, 5, 9, 17, 33):
        got = np.concatenate([bucketed.encode(many[i:i + size]) for i in range(0, micro, size)])
        if not np.array_equal(got, full):
            return False
    return True


def throughput(runtime, photos: np.ndarray, batch: int, seconds: float, callers: int | None = None) -> float:
    """Images/s of ``runtime`` run as the server runs it: by the device's default plan with
    calls of ``batch`` (``PlannedRuntime``, one intra-op thread), as many callers as the plan
    has workers, each with one call in flight; the in-process ceiling a served figure is
    divided by."""
    import threading

    from vqserve.export.runtimes.execution import PlannedRuntime, plan_for

    planned = PlannedRuntime(runtime, plan_for(runtime.info.device, micro_batch=batch))
    x = np.ascontiguousarray(np.resize(photos, (batch, *photos.shape[1:])))
    planned.encode(x)  # warm-up: kernels chosen, memory allocated
    counts = [0] * (callers or planned.plan.workers)
    stop_at = time.perf_counter() + seconds

    def caller(k: int) -> None:
        while time.perf_counter() < stop_at:
            planned.encode(x)
            counts[k] += batch

    t0 = time.perf_counter()
    callers = [threading.Thread(target=caller, args=(k,)) for k in range(len(counts))]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    rate = sum(counts) / (time.perf_counter() - t0)
    planned.close()
    return rate


def graphs_rows(runtimes: dict, photos: np.ndarray, best: dict[str, tuple[int, float]]) -> list[dict]:
    """Per dtype (``runtimes``: each dtype's eager runtime): CUDA-graph replay against eager,
    tokens (and pixels) and images/s at 1 image per call and at the dtype's best batch
    (``export/runtimes/cuda_graphs.py``)."""
    from vqserve.export.runtimes.cuda_graphs import graphs_equal_eager

    rows = []
    for dtype, runtime in runtimes.items():
        try:
            sizes = tuple(sorted({1, 8, best.get(dtype, (8, 0))[0]}))
            rows.append({"dtype": dtype, **graphs_equal_eager(runtime, photos, batch_sizes=sizes, rounds=2, seconds=0.75)})
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the rest of the run
            rows.append({"dtype": dtype, "error": f"{type(exc).__name__}: {exc}"[:500]})
    return rows


def measured_plan(model: str, device: str, dtype: str, folder: str, timeout: float) -> dict:
    """``vqserve plan --dtype DTYPE --out FILE`` in a child: the plan ``--plan auto`` would
    serve on this machine (``file``, ``plan``, ``line``), or ``error``."""
    out = Path(folder) / f"plan-{dtype}.json"
    cmd = [sys.executable, "-m", "vqserve", "plan", "--model", model, "--device", device, "--dtype", dtype,
           "--out", str(out), "--plan-cache", str(Path(folder) / "cache")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=ending_with_this_thread())  # ends if this run is killed
    except subprocess.TimeoutExpired:
        return {"error": f"vqserve plan did not finish in {timeout:.0f} s"}
    if done.returncode != 0 or not out.is_file():
        return {"error": (done.stdout + done.stderr)[-500:]}
    from vqserve.export.runtimes.execution import ExecutionPlan

    data = json.loads(out.read_text())
    return {"file": str(out), "plan": data["plan"], "measure_s": data.get("measure_s"),
            "line": ExecutionPlan.from_dict(data["plan"]).describe()}


def encoder_gflop(model: str, device: str, size: int) -> float | None:
    """GFLOP per image of the encoder at ``size``, counted by torch (None if it cannot)."""
    try:
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        runtime = load(model, "fp32", device)
        tokenizer = getattr(runtime, "tokenizer", None)
        if tokenizer is None:
            return None
        x = torch.zeros(1, size, size, 3, dtype=torch.uint8, device=device)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            tokenizer.encode(x)
        return counter.get_total_flops() / 1e9
    except Exception:  # noqa: BLE001 - a figure we can do without
        return None


def tokenize_row(model: str, device: str, dtype: str, timeout: float, count: int = 8000,
                 batch_size: int = 32, before: bool = False, graphs: bool = True) -> dict:
    """``vqserve bench tokenize`` in a child, within ``timeout`` seconds: ``count`` images,
    several seconds of device work, so the steady rate shows beside the run's start-up."""
    asked = {"dtype": dtype, "cuda_graphs": graphs}  # what a failed run was asked; a run reports its own
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tokenize.json"
        cmd = [sys.executable, "-m", "vqserve", "bench", "tokenize", "--model", model, "--device", device,
               "--dtype", dtype, "--rounds", "1", "--count", str(count), "--batch-size", str(batch_size),
               "--loader-rows", "0", "--json", str(out), "--before" if before else "--no-before",
               *([] if graphs else ["--no-cuda-graphs"])]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  preexec_fn=ending_with_this_thread())  # ends if this run is killed
        except subprocess.TimeoutExpired:
            return {**asked, "error": f"did not finish in {timeout:.0f} s"}
        if out.is_file():
            return {**asked, **json.loads(out.read_text())}
        if done.returncode == 0 and "{" in done.stdout:  # an older bench tokenize prints its JSON
            try:
                return {**asked, **json.loads(done.stdout[done.stdout.index("{"):])}
            except ValueError:
                pass
        return {**asked, "error": (done.stdout + done.stderr)[-800:]}


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
    p.add_argument("--cases", default="v1:raw:1,v1:raw:16,oip:raw:16,v1:jpeg:16",
                   help="protocol:payload:images per call, comma-separated")
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
    from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime, plan_for

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


def call_against_in_process(row: dict) -> float | None:
    """A served model call's mean time over one lone in-process call of its micro-batch
    (``call/in``): about 1 with ``busy`` under 1 is a device left idle between calls; well
    above 1 is calls slowed by the serving around them (or two calls sharing the device)."""
    if row.get("ms_per_call") is None or not row.get("in_process_call_ms"):
        return None
    return row["ms_per_call"] / row["in_process_call_ms"]


def report(result: dict) -> str:
    """One table: served / in-process at the dtype's best batch, per layout and case."""
    lines = [f"\n== vqserve bench gpu: {result['model']} on {result.get('gpu', result['device'])}, "
             f"{result['size']}², {result['cpu_cores']} CPUs, {result['seconds']:.0f} s =="]
    for row in result.get("tokens", []):
        if "error" in row:
            lines.append(f"tokens {row['precision']:<5} error: {row['error']}")
            continue
        lines.append(f"tokens {row['precision']:<5} {100 * row['agree_cpu_fp32']:8.3f} % equal to CPU fp32, "
                     f"{row['photos_identical']}/{row['photos']} photos identical, batch-invariant "
                     f"{'yes' if row['batch_invariant'] else 'NO'}, buckets equal to calls of 64 "
                     f"{ {True: 'yes', False: 'NO'}.get(row.get('buckets_equal'), '?') }")
    noise = result.get("noise")
    if noise:
        lines.append(f"fp32 noise: {noise['differing']} of {noise['tokens']:,} tokens differ from CPU fp32 "
                     f"({noise['rate']:.1e}) in {noise['images_differing']} of {noise['tiles']} photo crops; "
                     f"{noise['ties']} fp32 ties, {noise['not_ties']} not")
    for row in result.get("cuda_graphs", []):
        if "error" in row:
            lines.append(f"cuda graphs {row['dtype']}: error {row['error'][-200:]}")
            continue
        speeds = ", ".join(f"batch {r['batch']} x{r['ratio']:.2f}" for r in row.get("rows", []))
        lines.append(f"cuda graphs {row['dtype']}: tokens {'= eager' if row.get('tokens_equal') else 'DIFFER'}"
                     f", pixels {({True: '= eager', False: 'DIFFER'}).get(row.get('pixels_equal'), '-')}"
                     f"; graphs / eager img/s: {speeds}")
    best = {}
    for row in result.get("in_process", []):
        if row["dtype"] not in best or row["throughput"] > best[row["dtype"]]["throughput"]:
            best[row["dtype"]] = row
    for dtype, row in best.items():
        tf = f", {row['tflops']:.1f} TFLOP/s" if row.get("tflops") else ""
        lines.append(f"in-process {dtype}: best {row['throughput']:.0f} img/s at batch {row['batch']}{tf}")
    for row in result.get("plans", []):
        lines.append(f"plan {row['dtype']} (vqserve plan, served as 'planned'): "
                     f"{row.get('line') or 'error ' + str(row.get('error'))[-200:]}")
    lines.append(f"{'served':<8}{'layout':<16}{'case':<16}{'callers':<10}{'img/s':>9}{'/in-proc':>10}{'p99 ms':>9}{'CPU µs/img':>12}"
                 f"{CALL_COLUMNS}{'call/in':>9}")
    for row in result.get("served", []):
        if "error" in row:
            lines.append(f"{row['dtype']:<8}{row['layout']:<16}error: {row['error'][-200:]}")
            continue
        ratio = row["throughput"] / best[row["dtype"]]["throughput"] if row["dtype"] in best else float("nan")
        same = {True: "  tokens = in-process", False: "  TOKENS DIFFER"}.get(row.get("tokens_equal_in_process"), "")
        lines.append(f"{row['dtype']:<8}{row['layout']:<16}{row['case']:<16}{row.get('caller_kind', '-'):<10}"
                     f"{row['throughput']:9.0f}{ratio:10.2f}"
                     f"{row['p99_ms']:9.1f}{row['server_cpu_us_per_image'] or 0:12.0f}"
                     f"{call_columns(row)}{mean_text(call_against_in_process(row), 2):>9}{same}")
    for row in result.get("served", []):
        profile = row.get("profile")
        if not profile:
            continue
        alone = profile.get("executor_alone") or {}
        vs_in = (f" ({alone['throughput'] / best[row['dtype']]['throughput']:.2f} of in-process)"
                 if alone.get("throughput") and row["dtype"] in best else "")
        lines.append(f"profiled {row['dtype']} {row['layout']} {row['case']}: "
                     + (f"the executor alone (no gRPC) {alone['throughput']:.0f} img/s{vs_in}; " if alone else "")
                     + brief(profile))
    for row in result.get("tokenize", []):
        if "error" in row:
            lines.append(f"tokenize {row['dtype']}{' (CUDA graphs)' if row.get('cuda_graphs') else ''}: error {row['error'][-300:]}")
            continue
        before = row.get("before") or {}
        lines.append(f"tokenize {row['dtype']}{' (CUDA graphs)' if row.get('cuda_graphs') else ''}: end to end {row['end_to_end_images_per_s']:.0f} img/s, raw "
                     f"{row['raw_images_per_s']:.0f}, ratio {row['ratio_median']:.2f}; decode capacity "
                     f"{row.get('decode_capacity_images_per_s', 0):.0f} img/s, e2e / min(raw, decode) "
                     f"{row.get('ratio_to_bound_median', 0):.2f} ({row.get('bottleneck')}-bound); steady "
                     f"{_figure(row.get('steady_images_per_s'), '.0f')} img/s "
                     f"({_figure(row.get('steady_ratio_to_bound_median'), '.2f')} of the bound), first tokens "
                     f"after {_figure(row.get('first_tokens_s'), '.1f')} s; main process "
                     f"{row.get('main_cpu_us_per_image', 0):.0f} µs CPU/img"
                     + (f"; before (serial engine) {before.get('end_to_end_images_per_s', 0):.0f} img/s"
                        if before else ""))
    verdicts = targets(result)
    if verdicts:
        lines.append("targets:")
        lines += [f"  {'met   ' if v['met'] else 'MISSED'} {v['target']}: {v['measured']}" for v in verdicts]
    for row in result.get("failed", []):
        lines.append(f"FAILED {row['section']}: {row['error'][-300:]}")
    return "\n".join(lines)


# the GPU node's targets: served / in-process at the dtype's best batch (exact fp32 and bf16),
# JPEG / raw requests, p99 of 1-image calls at 64 clients (the first H200 measurement, 97-138 ms)
SERVED_TARGETS = {"fp32": 0.9, "bf16": 0.8}
JPEG_TARGET = 0.7
P99_MS_TARGET = 138.0


def targets(result: dict) -> list[dict]:
    """Each target the run measured: ``target`` (what is asked), ``measured`` (the figure and
    where it came from: the best layout for a served ratio) and ``met`` (bool). Computed
    from the JSON alone, so a stored run can be read again the same way."""
    out: list[dict] = []

    def add(target: str, value: float | None, met: bool | None, where: str = "", spec: str = ".2f") -> None:
        if met is not None:
            out.append({"target": target, "value": value, "met": met,
                        "measured": (format(value, spec) if isinstance(value, float) else str(value))
                        + (f" ({where})" if where else "")})

    for row in result.get("tokens", []):
        if "error" in row:
            continue
        if row["precision"] == "fp32":
            add("fp32 tokens identical to CPU fp32", row["agree_cpu_fp32"], row["agree_cpu_fp32"] == 1.0,
                f"{row['photos_identical']}/{row['photos']} photos", ".6f")
        elif row["precision"] in ("bf16", "fp16"):
            add(f"{row['precision']} tokens batch-invariant", row["batch_invariant"], bool(row["batch_invariant"]))
    best_in = {}
    for row in result.get("in_process", []):
        best_in[row["dtype"]] = max(best_in.get(row["dtype"], 0.0), row["throughput"])
    served = [r for r in result.get("served", []) if "error" not in r]
    by_point: dict[tuple, list[dict]] = {}
    for row in served:
        by_point.setdefault((row["dtype"], row["case"], row.get("caller_kind")), []).append(row)
    for (dtype, case, kind), rows in by_point.items():
        top = max(rows, key=lambda r: r["throughput"])
        want = SERVED_TARGETS.get(dtype)
        if want is not None and best_in.get(dtype) and case.endswith(("x1", "x16")) and "jpeg" not in case:
            ratio = top["throughput"] / best_in[dtype]
            add(f"{dtype} {case} served / in-process >= {want}", ratio, ratio >= want,
                f"{top['layout']}, {top['throughput']:.0f} of {best_in[dtype]:.0f} img/s", ".3f")
        if case.endswith(" x1"):
            clients = top.get("procs", 0) * (top.get("callers") or top.get("threads") or 0)
            add(f"{dtype} {case} p99 at {clients} clients <= {P99_MS_TARGET:.0f} ms", top["p99_ms"],
                top["p99_ms"] <= P99_MS_TARGET, top["layout"], ".0f")
        if "jpeg" in case.split():
            raw = by_point.get((dtype, case.replace("jpeg", "raw"), kind))
            if raw:
                ratio = top["throughput"] / max(r["throughput"] for r in raw)
                add(f"{dtype} {case} / raw >= {JPEG_TARGET}", ratio, ratio >= JPEG_TARGET, top["layout"], ".3f")
    changed = [f"{r['dtype']} {r['layout']} {r['case']}" for r in served if r.get("tokens_equal_in_process") is False]
    checked = [r for r in served if r.get("tokens_equal_in_process") is not None]
    if checked:
        add("served tokens = the same plan in-process", f"{len(checked) - len(changed)}/{len(checked)} rows",
            not changed, ", ".join(changed[:3]))
    return out


def _figure(value, spec: str) -> str:
    """A figure, or "-" where a run too short to show it left none (None or NaN)."""
    return "-" if value is None or value != value else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
