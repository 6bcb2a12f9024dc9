"""What ``vqserve bench gpu`` measures, one function per figure.

Each function loads what it needs and returns plain rows, so the run (``run``) can guard
every section on its own: tokens against CPU fp32 and batch invariance (:func:`token_rows`),
fp32 noise told apart into ties (:func:`noise_row`), in-process images/s as the server runs
the model (:func:`throughput`), CUDA graphs against eager (:func:`graphs_rows`), the plan
``vqserve plan`` measures (:func:`measured_plan`), ``vqserve bench tokenize`` in a child
(:func:`tokenize_row`) and the encoder's FLOPs (:func:`encoder_gflop`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vqserve.bench.inputs import PHOTOS
from vqserve.core.lifetime import ending_with_this_thread
from vqserve.core.machine import available_cores
from vqserve.export.runtimes.cuda_graphs import graphs_equal_eager
from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime, plan_for
from vqserve.export.runtimes.loader import load_runtime
from vqserve.model import ties
from vqserve.model.photos import load_builtin_photo


def load(model: str, dtype: str, device: str, tf32: bool = False):
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
    many = np.ascontiguousarray(np.resize(photos, (micro, *photos.shape[1:])))
    full = PlannedRuntime(runtime, ExecutionPlan(micro, 1)).encode(many)
    bucketed = PlannedRuntime(runtime, ExecutionPlan(micro, 1, bucketed=("encode",)))
    for size in (1, 2, 3, 5, 9, 17, 33):
        got = np.concatenate([bucketed.encode(many[i:i + size]) for i in range(0, micro, size)])
        if not np.array_equal(got, full):
            return False
    return True


def throughput(runtime, photos: np.ndarray, batch: int, seconds: float, callers: int | None = None,
               method: str = "encode") -> float:
    """Images/s of ``runtime`` run as the server runs it: by the device's default plan with
    calls of ``batch`` (``PlannedRuntime``, one intra-op thread), as many callers as the plan
    has workers, each with one call in flight; the in-process ceiling a served figure is
    divided by. ``method="decode"`` times decoding the tokens of ``photos`` instead."""
    import threading

    planned = PlannedRuntime(runtime, plan_for(runtime.info.device, micro_batch=batch))
    x = np.ascontiguousarray(np.resize(photos, (batch, *photos.shape[1:])))
    if method == "decode":
        x = np.ascontiguousarray(planned.encode(x))
    call = getattr(planned, method)
    call(x)  # warm-up: kernels chosen, memory allocated
    counts = [0] * (callers or planned.plan.workers)
    stop_at = time.perf_counter() + seconds

    def caller(k: int) -> None:
        while time.perf_counter() < stop_at:
            call(x)
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
