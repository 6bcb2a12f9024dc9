"""Choose the execution plan by measuring it: ``vqserve serve --plan auto`` and ``vqserve plan``.

A plan is a dtype plus an :class:`~vqserve.export.execution.ExecutionPlan` (micro-batch per
image size, parallel calls, intra-op threads). What is fastest depends on the hardware (bf16
is 3x faster than fp32 on a CPU with AMX and slower than fp32 without it) and on the image
size (batching pays at 64x64 on a CPU and not at 256x256), so the planner does not guess:

1. **probe** the device: CPU instruction sets from ``/proc/cpuinfo`` (AVX2, AVX-512 BF16 /
   FP16, AMX), CUDA capability;
2. **measure**, for each dtype the model can run in (a checkpoint: fp32, bf16, fp16, the
   quantizer always fp32; an exported artifact: its own dtype), on calibration images:
   token agreement with fp32 (photo tiles when scikit-image is installed, else synthetic
   images), batch invariance (:mod:`vqserve.export.determinism`), and images/s as the
   server runs it — one call per core with one thread each, at each micro-batch, at each
   calibration size (64 and 256 by default) — plus one call at a time with every core's
   threads inside it;
3. **choose** the dtype with the best throughput (geometric mean over the sizes) among
   those whose agreement is at least ``min_agreement`` and whose tokens do not depend on
   the batch (fp32 always qualifies, so there is always a choice), and for it the smallest
   micro-batch per size within 5 % of the fastest, and the faster of workers-vs-threads.
   For each method (encode, decode) where a call of one image gave the result of the same
   image inside a full micro-batch, a lone image runs unpadded
   (``ExecutionPlan.lone_unpadded``): a lone request then costs one image, not a micro-batch.

The result is cached on disk (:func:`cache_dir`), keyed by everything that could change it:
the hardware probe, torch / onnxruntime / vqserve versions, the model's hash, backend,
device, pinned dtype and the constraints. A restart reads the cache in milliseconds; a new
machine, model or version measures again (tens of seconds for the default tokenizer on a
2-core CPU).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from vqserve.export.determinism import check_invariance, synthetic_images
from vqserve.export.execution import (
    ExecutionPlan,
    PlannedRuntime,
    apply_intra_op_threads,
    default_model_workers,
    label_of,
)
from vqserve.machine import available_cores, cpu_info

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
DTYPES = ("fp32", "bf16", "fp16")
CALIBRATION_SIDES = (64, 256)
MICRO_BATCHES = (1, 2, 4, 8)
PLANNER_VERSION = 6        # bump when the measurement or the choice rule changes
MAX_CALL_PIXELS = 4 << 20  # candidates above this many pixels per call are not tried


def probe_device(device: str) -> dict:
    """What the hardware offers, read, not assumed."""
    model, flags = cpu_info()
    info: dict = {"device": device, "cores": available_cores(), "cpu": model}
    info["cpu_flags"] = {f: f in flags for f in CPU_FLAGS}
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        info["cuda_capability"] = ".".join(map(str, torch.cuda.get_device_capability(index)))
        info["cuda_name"] = torch.cuda.get_device_name(index)
    return info


@dataclass
class Candidate:
    """One way to run the model, and what it measured."""

    dtype: str
    side: int
    micro_batch: int
    workers: int
    threads: int = 1
    images_per_s: float = 0.0
    backend: str = "eager"

    def plan(self) -> ExecutionPlan:
        return ExecutionPlan(micro_batch=self.micro_batch, workers=self.workers, intra_op_threads=self.threads)


@dataclass
class DtypeResult:
    """Exactness of one way to run the model - a dtype on a backend (every candidate of that
    pair shares it)."""

    dtype: str
    agreement: float = 0.0        # share of tokens equal to fp32's on the calibration images
    batch_invariant: bool = False
    lone_invariant: list = field(default_factory=list)  # methods whose call of one equals a full call
    threads_invariant: bool = False  # the one-call-with-all-threads variant, checked too
    eligible: bool = False
    why_not: str = ""
    score: float = 0.0            # geometric mean over sizes of the best images/s
    backend: str = "eager"        # eager, or the format exported in-process (onnx, torchscript, pt2)
    artifact: str | None = None   # where that export lies (in the plan cache)

    @property
    def label(self) -> str:
        return label_of(self.backend, self.dtype)


def row_label(row: dict) -> str:
    """:func:`label_of` for a measured row (a ``DtypeResult`` or ``Candidate`` as a dict)."""
    return label_of(row["backend"], row["dtype"])


def images_per_second(encode, images: np.ndarray, seconds: float) -> float:
    """``encode(images)`` back to back for ``seconds`` after one warm-up call at this shape."""
    encode(images)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        encode(images)
        n += len(images)
    return n / (time.perf_counter() - t0)


def calibration_images(side: int = 128) -> tuple[np.ndarray, str]:
    """Every ``side`` tile of the validation photographs of scikit-image where it is
    installed (18 tiles at 128), else 8 synthetic images: agreement with fp32 is a property
    of photographs, so they come first."""
    try:
        from vqserve.export.parity import validation_photos

        tiles, info = validation_photos(side)
        return tiles, f"{len(tiles)} photo tiles {side}x{side} (skimage {', '.join(info['photos'])})"
    except (ImportError, ValueError):
        return synthetic_images(8, side, seed=1), f"8 synthetic images {side}x{side}"


def _exactness(raw, dtype: str, reference: np.ndarray | None, photos: np.ndarray, side_small: int,
               workers: int, min_agreement: float, max_micro: int = 8,
               backend: str = "eager") -> tuple[DtypeResult, np.ndarray]:
    res = DtypeResult(dtype, backend=backend)
    runtime = PlannedRuntime(raw, ExecutionPlan(1, workers))
    try:
        tokens = runtime.encode(photos)
    finally:
        runtime.close()
    res.agreement = 1.0 if reference is None else float(np.mean(tokens == reference))
    small = synthetic_images(6, side_small, seed=2)
    cert = check_invariance(raw, ExecutionPlan(4, workers), small, "calibration", batch_sizes=(1, 2, 5),
                            compositions=1)
    res.batch_invariant = cert.batch_invariant and cert.decode_batch_invariant
    cert = check_invariance(raw, ExecutionPlan(max_micro, workers, lone_unpadded=("decode", "encode")),
                            synthetic_images(max_micro, side_small, seed=4), "calibration",
                            batch_sizes=(1, 3, max_micro), compositions=1)
    res.lone_invariant = [m for m, ok in (("decode", cert.decode_batch_invariant), ("encode", cert.batch_invariant))
                          if ok]
    if workers > 1:
        cert = check_invariance(raw, ExecutionPlan(1, 1, workers), small, "calibration",
                                batch_sizes=(1, 5), compositions=1)
        res.threads_invariant = cert.batch_invariant and cert.decode_batch_invariant
    if res.agreement < min_agreement:
        res.why_not = f"agreement {res.agreement:.4%} < {min_agreement:.2%}"
    elif not res.batch_invariant:
        res.why_not = "tokens depend on the batch"
    res.eligible = not res.why_not
    return res, tokens


def _speeds(raw, dtype: str, sides: tuple[int, ...], micro_batches: tuple[int, ...], workers: int,
            seconds: float, say, backend: str = "eager") -> list[Candidate]:
    """Images/s per (size, micro-batch) with ``workers`` single-threaded calls, and per size
    with one call using ``workers`` torch threads (not for ONNX Runtime, whose sessions run
    one thread each: vqserve.export.runtimes). Micro-batches stop growing once one is slower
    than the best so far by 3% (throughput is unimodal in the micro-batch)."""
    rows: list[Candidate] = []
    for side in sides:
        images = synthetic_images(4, side, seed=3)
        best = 0.0
        for micro in micro_batches:
            if micro * side * side > MAX_CALL_PIXELS:
                break
            cand = Candidate(dtype, side, micro, workers, backend=backend)
            rows.append(_timed(raw, cand, images, seconds))
            say(f"{label_of(backend, dtype)} {side}x{side} micro-batch {micro} x {workers} workers: {cand.images_per_s:.1f} img/s")
            if cand.images_per_s < 0.97 * best:
                break
            best = max(best, cand.images_per_s)
        if workers > 1 and backend != "onnx":  # onnxruntime sessions keep the thread count they were opened with
            cand = Candidate(dtype, side, 1, 1, threads=workers, backend=backend)
            rows.append(_timed(raw, cand, images, seconds))
            say(f"{label_of(backend, dtype)} {side}x{side} micro-batch 1 x 1 worker x {workers} threads: {cand.images_per_s:.1f} img/s")
    return rows


def _timed(raw, cand: Candidate, images: np.ndarray, seconds: float) -> Candidate:
    runtime = PlannedRuntime(raw, cand.plan())
    try:
        batch = np.resize(images, (cand.micro_batch * cand.workers * 2, *images.shape[1:]))
        cand.images_per_s = images_per_second(runtime.encode, batch, seconds)
    finally:
        runtime.close()
        apply_intra_op_threads(1)  # the next candidate starts from one thread again
    return cand


MICRO_TOLERANCE = 0.05  # the smallest micro-batch within 5 % of the fastest wins: less padding, less memory


def _choose(rows: list[Candidate], results: dict[str, DtypeResult], sides: tuple[int, ...],
            workers: int) -> tuple[DtypeResult, ExecutionPlan]:
    def best(res: DtypeResult, side: int, threads: int | None = None) -> Candidate | None:
        pool = [c for c in rows if (c.backend, c.dtype, c.side) == (res.backend, res.dtype, side)
                and (threads is None or c.threads == threads)]
        if not pool:
            return None
        top = max(c.images_per_s for c in pool)
        return min((c for c in pool if c.images_per_s >= (1 - MICRO_TOLERANCE) * top), key=lambda c: c.micro_batch)

    for res in results.values():
        tops = [best(res, s) for s in sides]
        res.score = math.exp(sum(math.log(max(c.images_per_s, 1e-9)) for c in tops) / len(tops)) if all(tops) else 0
    eligible = [r for r in results.values() if r.eligible]
    choice = max(eligible, key=lambda r: r.score)
    parallel = [best(choice, s, 1) for s in sides]
    threaded = [best(choice, s, workers) for s in sides] if workers > 1 else []
    use_threads = (choice.threads_invariant and threaded and all(threaded)
                   and sum(math.log(t.images_per_s / p.images_per_s) for t, p in zip(threaded, parallel, strict=True)) > 0)
    if use_threads:
        return choice, ExecutionPlan(1, 1, workers)
    by_pixels = tuple((s * s, c.micro_batch) for s, c in zip(sides, parallel, strict=True))
    return choice, ExecutionPlan(micro_batch=parallel[-1].micro_batch, workers=workers,
                                       micro_batch_by_pixels=by_pixels, lone_unpadded=tuple(choice.lone_invariant))


def default_backends(device: str) -> tuple[str, ...]:
    """The backends ``--plan auto`` tries for a checkpoint: eager, plus ONNX Runtime where it
    can run on ``device`` (it encoded 1.13-1.30x faster than eager fp32 at batch 1 on a 2-core
    Xeon, docs/BENCHMARKS.md). TorchScript and torch.export measured within 4 % of eager there:
    ``backends=`` adds them."""
    try:
        import onnxruntime
    except ImportError:  # pragma: no cover - a dependency
        return ("eager",)
    if device.startswith("cuda") and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return ("eager",)
    return ("eager", "onnx")


EXPORT_BACKENDS = ("onnx", "torchscript", "pt2")


def _export_dtypes(fmt: str, device: str, pinned: str | None) -> list[str]:
    """The dtypes worth exporting ``fmt`` in here: fp32 on a CPU (onnxruntime's CPU provider
    runs an fp16 graph in fp32 with casts; bf16 eager already measures the bf16 kernels),
    every supported one on CUDA; only the pinned one when ``--dtype`` is given."""
    from vqserve.export.exporter import check_combination

    wanted = [pinned] if pinned else (["fp32"] if device == "cpu" else list(DTYPES))
    ok = []
    for dtype in wanted:
        try:
            check_combination(fmt, dtype, device)
        except ValueError:
            continue
        ok.append(dtype)
    return ok


def artifact_dir(artifacts: Path, model_hash: str, fmt: str, dtype: str, device: str) -> Path:
    """Where the plan keeps its export of one model in one format: named by everything that
    makes the export differ, so a new model or version exports again beside the old one."""
    import torch

    import vqserve

    key = json.dumps([model_hash, fmt, dtype, device, torch.__version__, vqserve.__version__])
    return artifacts / f"{fmt}-{dtype}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _export_candidate(model, model_hash: str, fmt: str, dtype: str, device: str, artifacts: Path, say) -> Path:
    """The export of ``model`` the plan measures: reused when an earlier plan wrote it (its
    files are checked against its manifest when it loads), else exported now with the usual
    parity and invariance checks (``vqserve export``)."""
    from vqserve.export.exporter import export_model

    out = artifact_dir(artifacts, model_hash, fmt, dtype, device)
    if (out / "manifest.json").is_file():
        return out
    say(f"exporting {fmt} {dtype} to {out} to measure it")
    artifacts.mkdir(parents=True, exist_ok=True)
    export_model(model, fmt, dtype, out, device=device, log=lambda msg: say(f"{fmt} {dtype}: {msg}"))
    return out


def measure(model, device: str = "cpu", backend: str = "auto", dtype: str | None = None,
            min_agreement: float = 0.995, sides: tuple[int, ...] = CALIBRATION_SIDES,
            micro_batches: tuple[int, ...] = MICRO_BATCHES, seconds: float = 0.6,
            workers: int | None = None, log: Callable[[str], None] | None = None,
            backends: tuple[str, ...] | None = None, artifacts: str | os.PathLike | None = None,
            model_hash: str | None = None) -> dict:
    """Measure every candidate and choose. ``dtype`` pins the dtype (or an artifact's own);
    ``workers`` (default one per core on CPU, one on CUDA) is the parallel calls to try.
    ``backends``: for a checkpoint served with ``backend`` auto, the formats to export
    in-process into ``artifacts`` (default: the plan cache's ``artifacts/``) and measure
    beside eager (default :func:`default_backends`); ``model_hash``: the model's, when the
    caller has it already (it names the exports). Returns a JSON-able dict with ``dtype``,
    ``backend``, ``artifact``, ``plan``, ``dtypes``, ``candidates``, ``device``."""
    from vqserve.export.runtime import load_runtime, model_hash_of

    say = log or (lambda msg: None)
    t0 = time.perf_counter()
    workers = workers or default_model_workers(device)
    is_artifact = (Path(str(model)) / "manifest.json").is_file()
    # (dtype, export format or None for the model as given): the model as given comes first,
    # and its first dtype that runs (fp32 unless pinned) is the reference the others are measured against
    paths = [(want, None) for want in ((dtype,) if dtype else ((None,) if is_artifact else DTYPES))]
    if not is_artifact and backend == "auto":
        paths += [(want, fmt) for fmt in (backends or default_backends(device)) if fmt in EXPORT_BACKENDS
                  for want in _export_dtypes(fmt, device, dtype)]
        model_hash = model_hash or model_hash_of(model)
    photos, source = calibration_images()
    reference = None
    results: dict[str, DtypeResult] = {}
    rows: list[Candidate] = []
    for want, fmt in paths:
        artifact = None
        try:
            if fmt is None:
                raw = load_runtime(model, backend=backend, dtype=want, device=device)
            else:
                artifact = str(_export_candidate(model, model_hash, fmt, want, device,
                                                 Path(artifacts) if artifacts else cache_dir() / "artifacts", say))
                raw = load_runtime(artifact, device=device)
        except Exception as exc:  # noqa: BLE001 - a path that cannot load or export is refused, not fatal
            refused = DtypeResult(want or "as exported", backend=fmt or "eager",
                                  why_not=f"cannot run: {' '.join(str(exc).split())[:300]}")
            say(f"{refused.label}: {refused.why_not}")
            results[refused.label] = refused
            continue
        is_reference = fmt is None and reference is None
        res, tokens = _exactness(raw, raw.info.dtype, None if is_reference else reference, photos, min(sides),
                                 workers, min_agreement, max(micro_batches), backend=raw.info.backend)
        reference = tokens if is_reference else reference
        res.artifact = artifact
        say(f"{res.label}: agreement with {dtype or 'fp32'} {res.agreement:.4%}, "
            f"{'batch-invariant' if res.batch_invariant else 'NOT batch-invariant'}")
        results[res.label] = res
        rows += _speeds(raw, res.dtype, tuple(sides), tuple(micro_batches), workers, seconds, say, res.backend)
        if hasattr(raw, "close"):
            raw.close()
    if not any(r.eligible for r in results.values()):
        raise RuntimeError("no dtype met the constraints: " +
                           "; ".join(f"{r.label}: {r.why_not}" for r in results.values()))
    chosen, plan = _choose(rows, results, tuple(sides), workers)
    return {"planner_version": PLANNER_VERSION, "device": probe_device(device), "dtype": chosen.dtype,
            "backend": chosen.backend, "artifact": chosen.artifact,
            "plan": plan.to_dict(), "min_agreement": min_agreement, "sides": list(sides),
            "calibration": source, "dtypes": [asdict(r) for r in results.values()],
            "candidates": [asdict(c) for c in rows], "measure_s": round(time.perf_counter() - t0, 2)}


# ---- the on-disk cache ------------------------------------------------------------------
def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """``explicit``, else ``$VQSERVE_PLAN_CACHE``, else ``$XDG_CACHE_HOME/vqserve/plans``
    (``~/.cache/vqserve/plans``)."""
    if explicit:
        return Path(explicit)
    if os.environ.get("VQSERVE_PLAN_CACHE"):
        return Path(os.environ["VQSERVE_PLAN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vqserve" / "plans"


def cache_key(model, device: str, backend: str, dtype: str | None, min_agreement: float,
              sides: tuple[int, ...] = CALIBRATION_SIDES, micro_batches: tuple[int, ...] = MICRO_BATCHES,
              workers: int | None = None, backends: tuple[str, ...] | None = None) -> dict:
    """Everything a measured plan depends on; its sha256 names the cache file."""
    import torch

    import vqserve
    from vqserve.export.runtime import model_hash_of

    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:  # pragma: no cover - a dependency, but a plan does not need it
        ort = None
    return {"planner_version": PLANNER_VERSION, "vqserve": vqserve.__version__, "torch": torch.__version__,
            "onnxruntime": ort, "hardware": probe_device(device), "model_hash": model_hash_of(model),
            "backend": backend, "dtype": dtype, "min_agreement": min_agreement, "sides": list(sides),
            "micro_batches": list(micro_batches), "workers": workers or default_model_workers(device),
            "backends": list(backends or default_backends(device))}


def _key_file(directory: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return directory / f"plan-{digest[:24]}.json"


def read_cached(directory: Path, key: dict) -> dict | None:
    """The cached result for ``key``, or None (absent, unreadable, or for another key)."""
    path = _key_file(directory, key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or "plan" not in data:
        return None
    if data.get("artifact") and not (Path(data["artifact"]) / "manifest.json").is_file():
        return None  # its export was removed: measure (and export) again
    return data


def write_cached(directory: Path, key: dict, result: dict) -> Path | None:
    """Store atomically (write beside, rename); a cache that cannot be written is skipped:
    the plan still serves, the next start measures again."""
    path = _key_file(directory, key)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({**result, "key": key}, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


@dataclass
class PlanChoice:
    """What ``--plan auto`` decided and where it came from (``measured`` or ``cache``)."""

    dtype: str
    plan: ExecutionPlan
    source: str
    cache_file: str | None
    result: dict
    model_hash: str = ""  # the model's, as its cache key read it ("" : read again when needed)

    @property
    def backend(self) -> str:
        return self.result["backend"]

    @property
    def artifact(self) -> str | None:
        """The in-process export chosen (in the plan cache), or None: serve the model as given."""
        return self.result.get("artifact")

    def why(self) -> str:
        """One line for the log: the choice and the figures behind it."""
        parts = []
        for r in self.result.get("dtypes", []):
            state = f"{r['score']:.1f} img/s" if r["eligible"] else f"refused: {r['why_not']}"
            parts.append(f"{row_label(r)} {state}")
        return (f"{label_of(self.backend, self.dtype)} {self.plan.describe()} ({self.source}; " + ", ".join(parts) +
                f"; agreement >= {self.result.get('min_agreement', 0):.2%})")

    def load(self, model, backend: str = "auto", dtype: str | None = None, device: str = "cpu",
             expect_hash: str | None = None):
        """The runtime this plan measured. For an in-process export, the export is checked to
        come from ``model`` (its manifest's source hash) and reports ``model``'s hash, so
        ``--expect-hash`` and clients see the same model whichever backend runs it."""
        from vqserve.export.runtime import load_runtime, model_hash_of

        if not self.artifact:
            return load_runtime(model, backend=backend, dtype=dtype or self.dtype, device=device,
                                expect_hash=expect_hash)
        from vqserve.export.manifest import read_manifest

        want = self.model_hash or model_hash_of(model)
        if read_manifest(self.artifact)["source"]["sha256"] != want:
            raise ValueError(f"the plan cache's export {self.artifact} was not made from {model} "
                             f"(hash {want[:12]}); remove it or run with --plan-cache elsewhere")
        runtime = load_runtime(self.artifact, device=device)
        runtime.info = dataclasses.replace(runtime.info, model_hash=want,
                                           extra={**runtime.info.extra, "plan_artifact": self.artifact})
        return runtime


def choose_plan(model, device: str = "cpu", backend: str = "auto", dtype: str | None = None,
                min_agreement: float = 0.995, cache: str | os.PathLike | None = None,
                log: Callable[[str], None] | None = None, expect_hash: str | None = None,
                refresh: bool = False, **measure_kw) -> PlanChoice:
    """The plan for serving ``model`` here: from the cache when this hardware, versions and
    model were measured before (unless ``refresh``), else measured now and cached.
    ``expect_hash``: refuse a model whose hash (the cache key's, read from the files)
    differs, before anything of it runs. ``PlanChoice.load`` opens what was chosen."""
    from vqserve.export.runtime import check_expected_hash

    directory = cache_dir(cache)
    key = cache_key(model, device, backend, dtype, min_agreement,
                    tuple(measure_kw.get("sides", CALIBRATION_SIDES)),
                    tuple(measure_kw.get("micro_batches", MICRO_BATCHES)), measure_kw.get("workers"),
                    measure_kw.get("backends"))
    check_expected_hash(expect_hash, key["model_hash"], model)
    cached = None if refresh else read_cached(directory, key)
    if cached is not None:
        return PlanChoice(cached["dtype"], ExecutionPlan.from_dict(cached["plan"]), "cache",
                          str(_key_file(directory, key)), cached, key["model_hash"])
    result = measure(model, device, backend, dtype, min_agreement, log=log, artifacts=directory / "artifacts",
                     model_hash=key["model_hash"], **measure_kw)
    written = write_cached(directory, key, result)
    return PlanChoice(result["dtype"], ExecutionPlan.from_dict(result["plan"]), "measured",
                      str(written) if written else None, result, key["model_hash"])
