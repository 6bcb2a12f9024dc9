"""Choose the execution plan by measuring it: ``vqserve plan``, and ``vqserve serve`` /
``vqserve tokenize`` with ``--plan auto`` (the default) or ``--plan FILE``.

A plan is a backend and dtype plus an :class:`~vqserve.export.runtimes.execution.ExecutionPlan`
(micro-batch per image size, parallel calls, intra-op threads). What is fastest depends on
the hardware and the image size, so the planner does not guess - but it never trades
tokens for speed unless asked:

1. **probe** the device: CPU instruction sets from ``/proc/cpuinfo``, CUDA capability;
2. **check exactness**: the reference is the model in eager fp32 (or the ``--dtype`` the
   user pinned). Every other path - the model exported in-process to ONNX Runtime (and, on
   request, TorchScript / torch.export) - qualifies only if its tokens *and* the pixels it
   decodes equal the reference's on every calibration photograph, and its tokens do not
   depend on the batch. So any plan the planner may pick by default gives the tokens of the
   model in fp32. Lower precision is a choice the user makes: ``--dtype bf16|fp16``, or
   ``--dtype auto`` (bf16/fp16 too, where they agree with fp32 on ``min_agreement`` of the
   tokens); the result says ``exact`` true or false;
3. **time** every way to run each qualifying path - each micro-batch with one single-threaded
   call per core, and one call with every core's threads - in interleaved rounds (each round
   times every candidate once), and keep each candidate's median speed *relative to the safe
   plan in the same round*: a busy machine slows whole rounds, not one candidate;
4. **choose**: the reference path and micro-batch 1 unless something more complex is faster
   by more than 5 % and more than the spread of the rounds (where they cannot be told apart,
   the simpler wins); for each method (encode, decode) where a call of one image gave the
   result of the same image inside a full micro-batch, lone images run unpadded; the chosen
   plan then passes the server's own start-up check, or loses those shortcuts.

The measurement stops between two model calls when asked (``should_stop``; a signal, or its
time budget): nothing half-measured is cached. A finished one is cached on disk
(:func:`cache_dir`), keyed by the hardware probe, torch / onnxruntime / vqserve versions,
the model's hash, backend, device, dtype rule and sizes, and can be written as a plan file
(:meth:`PlanChoice.to_file`) that a fleet of machines of one kind shares
(:meth:`PlanChoice.from_file`, checked by :func:`check_reproduces` where it loads).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from vqserve.core.machine import available_cores, cpu_info
from vqserve.export.runtimes.determinism import check_invariance, synthetic_images
from vqserve.export.runtimes.execution import (
    ExecutionPlan,
    PlannedRuntime,
    apply_intra_op_threads,
    default_model_workers,
    label_of,
)

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
DTYPES = ("fp32", "bf16", "fp16")
CALIBRATION_SIDES = (64, 256)
MICRO_BATCHES = (1, 2, 4, 8)  # tried on a CPU
# tried on CUDA: a GPU keeps gaining to 32-64 images per call (H200 bf16 at 256x256: 2,989 img/s
# at 8, 4,370 at 32, 4,339 at 64), and with candidates to 8 alone --plan auto chose 8 there
GPU_MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PLANNER_VERSION = 9        # bump when the measurement or the choice rule changes
ROUNDS = 3                 # interleaved timing rounds: every candidate once per round
STALE_EXPORT_S = 3600      # a staging folder of an export this old was left by a killed process
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
    """One way to run the model at one image size, and what it measured: images/s per
    interleaved round, and its median speed relative to the safe plan in the same round."""

    dtype: str
    side: int
    micro_batch: int
    workers: int
    threads: int = 1
    images_per_s: float = 0.0     # median over rounds
    backend: str = "eager"
    ratio: float = 0.0            # median over rounds of images/s / the safe plan's, same round
    spread: float = 0.0           # half the range of that ratio over the rounds
    rounds: list = field(default_factory=list)

    def plan(self) -> ExecutionPlan:
        return ExecutionPlan(micro_batch=self.micro_batch, workers=self.workers, intra_op_threads=self.threads)

    @property
    def label(self) -> str:
        """The path it runs (:func:`label_of`), the key of that path's runtime."""
        return label_of(self.backend, self.dtype)

    @property
    def complexity(self) -> tuple:
        """Simpler first: parallel calls before one threaded call, smaller micro-batches first."""
        return (self.threads > 1, self.micro_batch)


@dataclass
class DtypeResult:
    """Exactness of one way to run the model - a dtype on a backend (every candidate of that
    pair shares it)."""

    dtype: str
    agreement: float = 0.0        # share of tokens equal to the reference's on the calibration images
    pixels_equal: bool = False    # decoding the reference's tokens gave the reference's pixels, all of them
    batch_invariant: bool = False
    lone_invariant: list = field(default_factory=list)  # methods whose call of one equals a full call
    bucket_invariant: list = field(default_factory=list)  # methods whose every power-of-two call does
    threads_invariant: bool = False  # the one-call-with-all-threads variant, checked too
    eligible: bool = False
    why_not: str = ""
    score: float = 0.0            # geometric mean over sizes of the best speed, relative to the safe plan
    backend: str = "eager"        # eager, or the format exported in-process (onnx, torchscript, pt2)
    artifact: str | None = None   # where that export lies (in the plan cache)
    exact: bool = False           # its tokens are the model's fp32 eager tokens

    @property
    def label(self) -> str:
        return label_of(self.backend, self.dtype)


class PlanCancelled(Exception):
    """The measurement was stopped (a signal, or its time budget ran out) between two model
    calls. Nothing of it is cached: the next start measures again."""


def row_label(row: dict) -> str:
    """:func:`label_of` for a measured row (a ``DtypeResult`` or ``Candidate`` as a dict)."""
    return label_of(row["backend"], row["dtype"])


def images_per_second(encode, images: np.ndarray, seconds: float,
                      check: Callable[[], None] | None = None, warm_up: bool = True) -> float:
    """``encode(images)`` back to back for ``seconds`` (at least once) after one warm-up call
    at this shape; ``check()`` runs between calls (it raises to stop)."""
    check = check or (lambda: None)
    if warm_up:
        encode(images)
    n, t0 = 0, time.perf_counter()
    while not n or time.perf_counter() - t0 < seconds:
        check()
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


def exactness_rule(dtype: str | None) -> str:
    """How a path qualifies. ``identical`` (no dtype, or a pinned one): its tokens and decoded
    pixels equal the reference's (eager in that dtype, fp32 by default) on every calibration
    image, so choosing it changes no output. ``agreement`` (``--dtype auto``): its tokens
    agree with fp32's on at least ``min_agreement`` of the positions."""
    return "agreement" if dtype == "auto" else "identical"


def _encode_then_decode(raw, photos: np.ndarray, decode_these: np.ndarray | None = None,
                        workers: int = 1) -> tuple[np.ndarray, np.ndarray | None]:
    """``raw``'s tokens of ``photos``, and the pixels it decodes from ``decode_these``
    (default: those tokens), one image per call: how paths are compared with the reference.
    Pixels are None for an encode-only model (``RuntimeInfo.decodes`` False)."""
    runtime = PlannedRuntime(raw, ExecutionPlan(1, workers))
    try:
        tokens = runtime.encode(photos)
        if not getattr(raw.info, "decodes", True):
            return tokens, None
        return tokens, runtime.decode(tokens if decode_these is None else decode_these)
    finally:
        runtime.close()


def _exactness(raw, reference: tuple[np.ndarray, np.ndarray] | None, photos: np.ndarray, side_small: int,
               workers: int, rule: str, min_agreement: float, max_micro: int,
               check, side_large: int | None = None) -> tuple[DtypeResult, tuple[np.ndarray, np.ndarray]]:
    """Agreement with the reference (tokens, then pixels decoded from the reference's tokens)
    and batch invariance; ``reference`` None: this runtime is the reference, and its tokens and
    pixels (returned) become it. Buckets are granted only where calls of every bucket agree at
    ``side_small`` and at ``side_large`` too: a GPU chooses its kernels per shape (on an H100,
    bf16 buckets agreed at 256x256 and not at 64x64), so one size does not speak for another."""
    res = DtypeResult(raw.info.dtype, backend=raw.info.backend)
    ref_tokens, ref_pixels = reference or (None, None)
    tokens, pixels = _encode_then_decode(raw, photos, ref_tokens, workers)
    res.agreement = 1.0 if ref_tokens is None else float(np.mean(tokens == ref_tokens))
    res.pixels_equal = ref_pixels is None or bool(np.array_equal(pixels, ref_pixels))
    check()
    small = synthetic_images(6, side_small, seed=2)
    cert = check_invariance(raw, ExecutionPlan(4, workers), small, "calibration", batch_sizes=(1, 2, 5),
                            compositions=1)
    res.batch_invariant = cert.invariant
    check()
    cert = check_invariance(raw, ExecutionPlan(max_micro, workers, lone_unpadded=("decode", "encode")),
                            synthetic_images(max_micro, side_small, seed=4), "calibration",
                            batch_sizes=(1, 3, max_micro), compositions=1)
    res.lone_invariant = [m for m, ok in (("decode", cert.decode_batch_invariant), ("encode", cert.batch_invariant))
                          if ok]
    if max_micro > 2:  # short calls padded to 1, 2, 4, ...: each bucket below the micro-batch once
        check()
        sizes = tuple(sorted({1, *(b + 1 for b in _powers_below(max_micro)), max_micro}))
        found = ("decode", "encode")
        for side in dict.fromkeys(s for s in (side_small, side_large) if s):  # small first: it is cheap
            if not found:
                break
            check()
            cert = check_invariance(raw, ExecutionPlan(max_micro, workers, bucketed=found),
                                    synthetic_images(max_micro, side, seed=5), "calibration",
                                    batch_sizes=sizes, compositions=1)
            found = tuple(m for m, ok in (("decode", cert.decode_batch_invariant),
                                          ("encode", cert.batch_invariant)) if ok and m in found)
        res.bucket_invariant = list(found)
    if workers > 1:
        check()
        cert = check_invariance(raw, ExecutionPlan(1, 1, workers), small, "calibration",
                                batch_sizes=(1, 5), compositions=1)
        res.threads_invariant = cert.invariant
    if rule == "identical" and res.agreement < 1.0:
        res.why_not = f"tokens differ from the reference on {1 - res.agreement:.4%} of positions"
    elif rule == "identical" and not res.pixels_equal:
        res.why_not = "decoded pixels differ from the reference's"
    elif rule == "agreement" and res.agreement < min_agreement:
        res.why_not = f"agreement {res.agreement:.4%} < {min_agreement:.2%}"
    elif not res.batch_invariant:
        res.why_not = "tokens depend on the batch"
    res.eligible = not res.why_not
    return res, (tokens, pixels)


def _candidates(res: DtypeResult, sides: tuple[int, ...], micro_batches: tuple[int, ...],
                workers: int) -> list[Candidate]:
    """The ways to run one path: each micro-batch with ``workers`` single-threaded calls, and
    one call with ``workers`` torch threads (not for ONNX Runtime, whose sessions run one
    thread each: vqserve.export.runtimes.artifacts)."""
    out = [Candidate(res.dtype, side, micro, workers, backend=res.backend)
           for side in sides for micro in micro_batches if micro * side * side <= MAX_CALL_PIXELS]
    if workers > 1 and res.backend != "onnx" and res.threads_invariant:
        out += [Candidate(res.dtype, side, 1, 1, threads=workers, backend=res.backend) for side in sides]
    return out


def _time_interleaved(raws: dict[str, object], rows: list[Candidate], safe: dict[int, Candidate], rounds: int,
                      seconds: float, say, check) -> None:
    """Time every candidate once per round, all of them in each round (a busy machine slows a
    whole round, not one candidate), and keep per candidate the median over rounds of its speed
    relative to the safe plan's in the same round, and the spread of that ratio."""
    images = {side: synthetic_images(4, side, seed=3) for side in {c.side for c in rows}}
    runners, batches, seen = {}, {}, {}
    try:
        for c in rows:  # one full call per worker a measurement; warmed up once, before the rounds
            runners[id(c)] = PlannedRuntime(raws[c.label], c.plan())
            batches[id(c)] = np.resize(images[c.side], (c.micro_batch * c.workers, *images[c.side].shape[1:]))
            check()
            apply_intra_op_threads(c.threads)
            runners[id(c)].encode(batches[id(c)])
            apply_intra_op_threads(1)
        for r in range(rounds):
            speeds = {}
            for c in rows:
                check()
                apply_intra_op_threads(c.threads)
                speeds[id(c)] = images_per_second(runners[id(c)].encode, batches[id(c)], seconds, check,
                                                  warm_up=False)
                apply_intra_op_threads(1)
            for c in rows:
                c.rounds.append(round(speeds[id(c)] / speeds[id(safe[c.side])], 4))
                seen.setdefault(id(c), []).append(speeds[id(c)])
            say(f"timing round {r + 1}/{rounds} done ({len(rows)} candidates)")
        for c in rows:
            c.ratio = float(np.median(c.rounds))
            c.spread = float((max(c.rounds) - min(c.rounds)) / 2)
            c.images_per_s = float(np.median(seen[id(c)]))
    finally:
        for runner in runners.values():
            runner.close()
        apply_intra_op_threads(1)


MICRO_TOLERANCE = 0.05  # a more complex candidate must beat a simpler one by more than this (and the spread)


def _noise(c: Candidate) -> float:
    """How far a candidate's rounds scattered, relative to its median ratio."""
    return c.spread / c.ratio if c.ratio > 0 else 0.0


def _better(new_ratio: float, new_noise: float, old_ratio: float, old_noise: float) -> bool:
    """Whether a more complex choice beats a simpler one: by more than 5 % and more than the
    two relative spreads together; where the measurements cannot tell them apart, the simpler
    wins."""
    return new_ratio > old_ratio * (1 + max(MICRO_TOLERANCE, new_noise + old_noise))


def _best_at(rows: list[Candidate], res: DtypeResult, side: int, threads: bool | None = None) -> Candidate | None:
    pool = sorted((c for c in rows if (c.backend, c.dtype, c.side) == (res.backend, res.dtype, side)
                   and (threads is None or (c.threads > 1) == threads)), key=lambda c: c.complexity)
    best = None
    for c in pool:
        if best is None or _better(c.ratio, _noise(c), best.ratio, _noise(best)):
            best = c
    return best


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values)) if values else 0.0


def _choose(rows: list[Candidate], results: dict[str, DtypeResult], sides: tuple[int, ...],
            workers: int) -> tuple[DtypeResult, ExecutionPlan]:
    """The path (in measuring order: the reference first) and plan: a later path or a more
    complex plan replaces an earlier, simpler one only where it is measurably faster."""
    noise = {}
    for res in results.values():
        tops = [_best_at(rows, res, s, threads=False) for s in sides]
        res.score = _geomean([c.ratio for c in tops]) if all(tops) else 0.0
        noise[res.label] = max((_noise(c) for c in tops if c), default=0.0)
    choice = None
    for res in (r for r in results.values() if r.eligible and r.score):
        if choice is None or _better(res.score, noise[res.label], choice.score, noise[choice.label]):
            choice = res
    parallel = [_best_at(rows, choice, s, threads=False) for s in sides]
    threaded = [_best_at(rows, choice, s, threads=True) for s in sides]
    if all(threaded) and _better(_geomean([c.ratio for c in threaded]), max(_noise(c) for c in threaded),
                                 _geomean([c.ratio for c in parallel]), max(_noise(c) for c in parallel)):
        return choice, ExecutionPlan(1, 1, workers)
    by_pixels = tuple((s * s, c.micro_batch) for s, c in zip(sides, parallel, strict=True))
    return choice, ExecutionPlan(micro_batch=parallel[-1].micro_batch, workers=workers,
                                 micro_batch_by_pixels=by_pixels, lone_unpadded=tuple(choice.lone_invariant),
                                 bucketed=tuple(choice.bucket_invariant))


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


def _export_dtypes(fmt: str, device: str, dtype: str | None) -> list[str]:
    """The dtypes worth exporting ``fmt`` in: the reference's (fp32 by default, or the pinned
    one); with ``--dtype auto``, fp32 on a CPU (onnxruntime's CPU provider runs an fp16 graph
    in fp32 with casts; bf16 eager already measures the bf16 kernels) and every supported one
    on CUDA."""
    from vqserve.export.exporter import check_combination

    if dtype == "auto":
        wanted = ["fp32"] if device == "cpu" else list(DTYPES)
    else:
        wanted = [dtype or "fp32"]
    ok = []
    for want in wanted:
        try:
            check_combination(fmt, want, device)
        except ValueError:
            continue
        ok.append(want)
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
    for stale in artifacts.glob(f".{out.name}.tmp-*"):  # a killed measurement's half export (ours)
        if time.time() - stale.stat().st_mtime > STALE_EXPORT_S:
            shutil.rmtree(stale, ignore_errors=True)
    say(f"exporting {fmt} {dtype} to {out} to measure it")
    artifacts.mkdir(parents=True, exist_ok=True)
    export_model(model, fmt, dtype, out, device=device, log=lambda msg: say(f"{fmt} {dtype}: {msg}"))
    return out


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        return None


def micro_batches_for(device: str) -> tuple[int, ...]:
    """The micro-batches ``--plan auto`` tries on ``device`` by default."""
    return GPU_MICRO_BATCHES if str(device).startswith("cuda") else MICRO_BATCHES


def measure(model, device: str = "cpu", backend: str = "auto", dtype: str | None = None,
            min_agreement: float = 0.995, sides: tuple[int, ...] = CALIBRATION_SIDES,
            micro_batches: tuple[int, ...] | None = None, seconds: float = 0.3,
            workers: int | None = None, log: Callable[[str], None] | None = None,
            backends: tuple[str, ...] | None = None, artifacts: str | os.PathLike | None = None,
            model_hash: str | None = None, rounds: int = ROUNDS,
            should_stop: Callable[[], bool] | None = None) -> dict:
    """Measure every candidate and choose.

    ``dtype``: None (exact by default) measures fp32 eager - the reference - and the other
    backends in fp32, and only a path whose tokens and decoded pixels equal the reference's on
    the calibration photographs may be chosen; a pinned dtype does the same in that dtype;
    ``"auto"`` also measures bf16 and fp16 and accepts ``min_agreement`` of fp32's tokens.
    An artifact directory is measured as it is (its own dtype). ``workers`` (default one per
    core on CPU, one on CUDA) is the parallel calls to try. ``backends``: for a checkpoint with
    ``backend`` auto, the formats to export in-process into ``artifacts`` (default: the plan
    cache's ``artifacts/``) and measure beside eager (default :func:`default_backends`);
    ``model_hash``: the model's, when the caller has it already (it names the exports).
    ``should_stop()`` is asked between model calls: True raises :class:`PlanCancelled`.
    Returns a JSON-able dict with ``dtype``, ``backend``, ``artifact``, ``exact``, ``plan``,
    ``dtypes``, ``candidates``, ``device``, ``load_average``."""
    from vqserve.export.runtimes.loader import load_runtime, model_hash_of
    from vqserve.export.runtimes.synthetic import is_synthetic

    say = log or (lambda msg: None)

    def check() -> None:
        if should_stop is not None and should_stop():
            raise PlanCancelled("the measurement was stopped before it finished; nothing was cached")

    t0 = time.perf_counter()
    load_before = load_average()
    workers = workers or default_model_workers(device)
    micro_batches = tuple(micro_batches or micro_batches_for(device))
    rule = exactness_rule(dtype)
    is_artifact = (Path(str(model)) / "manifest.json").is_file()
    # (dtype, export format or None for the model as given): the model as given comes first,
    # and its first dtype is the reference the others are measured against
    if is_artifact:
        paths = [(None, None)]
    elif dtype == "auto":
        paths = [(want, None) for want in DTYPES]
    else:
        paths = [(dtype or "fp32", None)]
    if not is_artifact and backend == "auto" and not is_synthetic(model):  # the stand-in has no exports
        paths += [(want, fmt) for fmt in (backends or default_backends(device)) if fmt in EXPORT_BACKENDS
                  for want in _export_dtypes(fmt, device, dtype)]
        model_hash = model_hash or model_hash_of(model)
    photos, source = calibration_images()
    reference = None
    results: dict[str, DtypeResult] = {}
    raws: dict[str, object] = {}
    try:
        for want, fmt in paths:
            check()
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
            # buckets at the largest size too on an accelerator (kernels chosen per shape there;
            # there it costs a fraction of a second, on a 2-core CPU some 40 s of the 90 s budget)
            large = None if str(device).startswith("cpu") else max(sides)
            res, outputs = _exactness(raw, reference, photos, min(sides), workers, rule, min_agreement,
                                      max(micro_batches), check, side_large=large)
            if reference is None:
                reference = outputs
            res.artifact = artifact
            # eager fp32 is the reference unless another dtype is pinned; an artifact says itself
            res.exact = (raw.info.exact if is_artifact else
                         res.dtype == "fp32" and res.agreement == 1.0 and dtype in (None, "fp32", "auto"))
            pixels = ("no decoder" if not getattr(raw.info, "decodes", True) else
                      f"decoded pixels {'equal' if res.pixels_equal else 'DIFFERENT'}")
            say(f"{res.label}: tokens {res.agreement:.4%} equal to the reference, {pixels}, "
                f"{'batch-invariant' if res.batch_invariant else 'NOT batch-invariant'}"
                + (f": refused ({res.why_not})" if res.why_not else ""))
            results[res.label] = res
            if res.eligible:
                raws[res.label] = raw
            elif hasattr(raw, "close"):
                raw.close()
        if not any(r.eligible for r in results.values()):
            raise RuntimeError("no dtype met the constraints: " +
                               "; ".join(f"{r.label}: {r.why_not}" for r in results.values()))
        eligible = [r for r in results.values() if r.eligible]
        micro = tuple(sorted({1, *micro_batches}))  # micro-batch 1 is the yardstick, asked for or not
        rows = [c for r in eligible for c in _candidates(r, tuple(sides), micro, workers)]
        first = eligible[0]  # the reference where it qualifies: its simplest way is the safe plan
        safe = {side: min((c for c in rows if (c.backend, c.dtype, c.side) == (first.backend, first.dtype, side)),
                          key=lambda c: c.complexity) for side in sides}
        say(f"timing {len(rows)} candidates in {rounds} interleaved rounds of {seconds:g} s each")
        _time_interleaved(raws, rows, safe, rounds, seconds, say, check)
        chosen, plan = _choose(rows, results, tuple(sides), workers)
        check()
        plan = _certified(raws[chosen.label], plan, say)
        if str(device).startswith("cuda") and chosen.backend == "eager":
            # the chosen kernels replayed from CUDA graphs: the same tokens (checked where the plan
            # is loaded, export/runtimes/cuda_graphs.py), less Python per call than the eager timing above
            plan = dataclasses.replace(plan, cuda_graphs=True)
    finally:
        for raw in raws.values():
            if hasattr(raw, "close"):
                raw.close()
    return {"planner_version": PLANNER_VERSION, "device": probe_device(device), "dtype": chosen.dtype,
            "backend": chosen.backend, "artifact": chosen.artifact, "exact": chosen.exact, "rule": rule,
            "plan": plan.to_dict(), "min_agreement": min_agreement if rule == "agreement" else None,
            "sides": list(sides), "calibration": source, "rounds": rounds, "seconds": seconds,
            "dtypes": [asdict(r) for r in results.values()],
            "candidates": [asdict(c) for c in rows], "measure_s": round(time.perf_counter() - t0, 2),
            "load_average": {"before": load_before, "after": load_average()}}


def _powers_below(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``: the buckets of a bucketed plan at micro-batch ``n``."""
    return [1 << k for k in range(max(0, n - 1).bit_length()) if 1 << k < n]


def _certified(raw, plan: ExecutionPlan, say) -> ExecutionPlan:
    """The plan as the server's own start-up check sees it: a plan that fails that check (a
    lone call that moved a decoded pixel there although the calibration found it equal)
    loses the unpadded lone calls of the method that failed (decode pixels, or encode
    tokens), then all of them, and failing still, falls back to micro-batch 1."""
    from vqserve.export.runtimes.determinism import start_up_check

    attempt, tried = plan, set()
    while True:
        cert = start_up_check(raw, attempt)
        if cert.invariant:
            return attempt
        tried.add(attempt)
        failed = {"encode"} if not cert.batch_invariant else set()
        failed |= {"decode"} if not cert.decode_batch_invariant else set()
        candidates = (dataclasses.replace(attempt, bucketed=tuple(set(attempt.bucketed) - failed)),
                      dataclasses.replace(attempt, lone_unpadded=tuple(set(attempt.lone_unpadded) - failed),
                                          bucketed=tuple(set(attempt.bucketed) - failed)),
                      dataclasses.replace(attempt, lone_unpadded=(), bucketed=()), ExecutionPlan(1, plan.workers))
        simpler = next((c for c in candidates if c not in tried), None)
        say(f"plan {attempt.describe()} failed the start-up check ({cert.summary()}); "
            + (f"trying {simpler.describe()}" if simpler else "keeping micro-batch 1"))
        if simpler is None:
            return ExecutionPlan(1, plan.workers)
        attempt = simpler


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
              sides: tuple[int, ...] = CALIBRATION_SIDES, micro_batches: tuple[int, ...] | None = None,
              workers: int | None = None, backends: tuple[str, ...] | None = None) -> dict:
    """Everything a measured plan depends on; its sha256 names the cache file."""
    micro_batches = micro_batches or micro_batches_for(device)
    import torch

    import vqserve
    from vqserve.export.runtimes.loader import model_hash_of

    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:  # pragma: no cover - a dependency, but a plan does not need it
        ort = None
    return {"planner_version": PLANNER_VERSION, "vqserve": vqserve.__version__, "torch": torch.__version__,
            "onnxruntime": ort, "hardware": probe_device(device), "model_hash": model_hash_of(model),
            "backend": backend, "dtype": dtype, "min_agreement": min_agreement if dtype == "auto" else None,
            "sides": list(sides),
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


def _write_json(path: Path, data: dict) -> Path:
    """Write ``data`` beside ``path`` and rename it into place: readers see the old file or
    the whole new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def check_plan_out(path: str | os.PathLike) -> None:
    """``vqserve plan --out PATH``, refused in one line before anything is measured when the
    write would fail (a folder) or replace a file of the user's that is not a plan file; an
    earlier plan file there is replaced, as re-planning is for."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--out {path} is a folder; give a file path, e.g. {path / 'plan.json'}")
    if not path.exists():
        return
    data = None
    try:
        if path.stat().st_size < 16 << 20:  # a plan file is kilobytes: a big file is not one, unread
            data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    if not isinstance(data, dict) or data.get("format") != PLAN_FILE_FORMAT:
        raise ValueError(f"--out {path} exists and is not a vqserve plan file: refusing to replace it "
                         "(a plan file there would be); choose another path")


def write_cached(directory: Path, key: dict, result: dict) -> Path | None:
    """Store atomically; a cache that cannot be written is skipped: the plan still serves,
    the next start measures again."""
    try:
        return _write_json(_key_file(directory, key), {**result, "key": key})
    except OSError:
        return None


PLAN_FILE_FORMAT = "vqserve-plan"


class PlanFileError(ValueError):
    """A plan file this machine or model cannot use (one line: what and why)."""


@dataclass
class PlanChoice:
    """What the planner decided and where it came from: ``measured``, ``cache`` or ``file``."""

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

    @property
    def exact(self) -> bool:
        """The chosen path gives the model's fp32 eager tokens (measured equal)."""
        return bool(self.result.get("exact"))

    def why(self) -> str:
        """One line for the log: the choice and the figures behind it."""
        parts = []
        for r in self.result.get("dtypes", []):
            state = f"x{r['score']:.2f}" if r["eligible"] else f"refused: {r['why_not']}"
            parts.append(f"{row_label(r)} {state}")
        rule = ("tokens and pixels identical to the reference" if self.result.get("rule", "identical") == "identical"
                else f"agreement >= {self.result.get('min_agreement') or 0:.2%}")
        return (f"{label_of(self.backend, self.dtype)} {self.plan.describe()} ({self.source}; "
                + ", ".join(parts) + f"; speeds relative to the safe plan; {rule})")

    def to_dict(self) -> dict:
        """The decision as JSON-able data: a plan file's body, and what a Ray driver ships to
        its actors (:meth:`from_dict`)."""
        return {"format": PLAN_FILE_FORMAT, "model_hash": self.model_hash, "source": self.source,
                **{k: v for k, v in self.result.items() if k not in ("key", "source")}}

    @classmethod
    def from_dict(cls, data: dict) -> PlanChoice:
        return cls(data["dtype"], ExecutionPlan.from_dict(data["plan"]), data.get("source", "file"), None,
                   data, data.get("model_hash", ""))

    def to_file(self, path: str | os.PathLike) -> Path:
        """Write the decision as a plan file (``vqserve plan --out``), atomically."""
        return _write_json(Path(path), {**self.to_dict(), "source": "file"})

    @classmethod
    def from_file(cls, path: str | os.PathLike, model, device: str, dtype: str | None = None) -> PlanChoice:
        """A plan file written by ``vqserve plan --out``, for ``model`` on ``device``. Refused
        (:class:`PlanFileError`, one line) when it is not a plan file, was measured for another
        model (hash), another kind of device, or another dtype than ``--dtype`` pins. Whether
        this machine reproduces its tokens is checked when it loads (:func:`check_reproduces`)."""
        from vqserve.export.runtimes.loader import model_hash_of

        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise PlanFileError(f"--plan {path}: cannot read it ({exc.strerror or exc})") from None
        except ValueError:
            raise PlanFileError(f"--plan {path}: not JSON; write one with `vqserve plan --out FILE`") from None
        if not isinstance(data, dict) or data.get("format") != PLAN_FILE_FORMAT or "plan" not in data:
            raise PlanFileError(f"--plan {path}: not a vqserve plan file; write one with `vqserve plan --out FILE`")
        if int(data.get("planner_version", 0)) > PLANNER_VERSION:
            raise PlanFileError(f"--plan {path}: written by a newer vqserve (planner version "
                                f"{data['planner_version']}, this one reads up to {PLANNER_VERSION})")
        want = model_hash_of(model)
        if data.get("model_hash") != want:
            raise PlanFileError(f"--plan {path} was measured for model {str(data.get('model_hash'))[:12]}, "
                                f"not {model} ({want[:12]}); measure this model with "
                                f"`vqserve plan --model {model} --out FILE`")
        planned_on = str(data.get("device", {}).get("device", "cpu")).split(":")[0]
        if planned_on != device.split(":")[0]:
            raise PlanFileError(f"--plan {path} was measured on {planned_on}, this server runs on {device}; "
                                "measure a plan per kind of device")
        if dtype is not None and dtype != "auto" and data.get("dtype") != dtype:
            raise PlanFileError(f"--plan {path} runs {data.get('dtype')}, not --dtype {dtype}")
        return dataclasses.replace(cls.from_dict({**data, "source": "file"}), cache_file=str(path))

    def load(self, model, backend: str = "auto", device: str = "cpu", expect_hash: str | None = None,
             artifacts: str | os.PathLike | None = None, log=None):
        """The runtime this plan measured. For an in-process export, the export is checked to
        come from ``model`` (its manifest's source hash) and reports ``model``'s hash, so
        ``--expect-hash`` and clients see the same model whichever backend runs it. An export
        that is not on this machine (a plan file from another one) is made again into
        ``artifacts`` (default: the plan cache's)."""
        from vqserve.export.runtimes.loader import load_runtime, model_hash_of
        from vqserve.export.runtimes.synthetic import is_synthetic

        # the model as given: eager, an artifact, or the stand-in accelerator (nothing to export)
        if self.backend == "eager" or is_synthetic(model) or (Path(str(model)) / "manifest.json").is_file():
            return load_runtime(model, backend=backend, dtype=self.dtype, device=device, expect_hash=expect_hash)
        from vqserve.export.formats.manifest import read_manifest

        want = self.model_hash or model_hash_of(model)
        artifact = self.artifact
        if not artifact or not (Path(artifact) / "manifest.json").is_file():
            artifact = str(_export_candidate(model, want, self.backend, self.dtype, device,
                                             Path(artifacts) if artifacts else cache_dir() / "artifacts",
                                             log or (lambda msg: None)))
        if read_manifest(artifact)["source"]["sha256"] != want:
            raise ValueError(f"the plan cache's export {artifact} was not made from {model} "
                             f"(hash {want[:12]}); remove it or run with --plan-cache elsewhere")
        runtime = load_runtime(artifact, device=device)
        runtime.info = dataclasses.replace(runtime.info, model_hash=want,  # its source_hash is ``want`` already
                                           extra={**runtime.info.extra, "plan_artifact": artifact})
        return runtime


def check_reproduces(runtime, model, device: str, choice: PlanChoice, certificate=None) -> None:
    """The start-up check of a plan brought from elsewhere (a plan file): for an exact plan,
    its runtime must give eager fp32's tokens and decoded pixels on the calibration
    photographs here; and every plan must pass the start-up check under its own execution
    plan here (``certificate``: that check, when the caller ran it already). Raises
    :class:`PlanFileError` naming what differs."""
    from vqserve.export.runtimes.determinism import start_up_check
    from vqserve.export.runtimes.loader import load_runtime

    if choice.exact and runtime.info.backend != "eager":
        photos, _ = calibration_images()
        ref_tokens, ref_pixels = _encode_then_decode(load_runtime(model, dtype="fp32", device=device), photos)
        tokens, pixels = _encode_then_decode(runtime, photos, ref_tokens)
        if not np.array_equal(tokens, ref_tokens):
            raise PlanFileError(f"this machine cannot reproduce the plan's tokens: {choice.backend}/{choice.dtype} "
                                f"differs from eager fp32 on {np.mean(tokens != ref_tokens):.4%} of the "
                                "calibration tokens here; measure a plan on this kind of machine")
        if not np.array_equal(pixels, ref_pixels):
            raise PlanFileError(f"this machine cannot reproduce the plan's decoded pixels: "
                                f"{choice.backend}/{choice.dtype} decodes differently from eager fp32 here; "
                                "measure a plan on this kind of machine")
    cert = certificate or start_up_check(runtime, choice.plan)
    if not cert.invariant:
        raise PlanFileError(f"the plan fails the start-up check on this machine: {cert.summary()}")


def find_plan(plan: str, model, device: str, backend: str = "auto", dtype: str | None = None,
              min_agreement: float = 0.995, cache: str | os.PathLike | None = None,
              expect_hash: str | None = None) -> PlanChoice | None:
    """The plan ``--plan`` names for ``model`` here, without measuring: a plan file
    (checked against the model), the plan cached for this hardware and model (``auto``), or
    None - the safe plan (``default``, or ``auto`` with nothing cached yet). The server and
    ``vqserve tokenize`` both decide this way."""
    from vqserve.export.runtimes.synthetic import is_synthetic

    if plan == "default" or (plan == "auto" and is_synthetic(model)):  # nothing to measure on a stand-in
        return None
    if plan != "auto":
        return PlanChoice.from_file(plan, model, device, dtype)
    return lookup_plan(model, device, backend, dtype, min_agreement, cache, expect_hash)[0]


def lookup_plan(model, device: str = "cpu", backend: str = "auto", dtype: str | None = None,
                min_agreement: float = 0.995, cache: str | os.PathLike | None = None,
                expect_hash: str | None = None, **measure_kw) -> tuple[PlanChoice | None, dict]:
    """The cached plan for ``model`` here, or None; and the cache key (for the measurement
    that would fill it). ``expect_hash``: refuse a model whose hash differs, before anything
    of it runs."""
    from vqserve.export.runtimes.loader import check_expected_hash

    directory = cache_dir(cache)
    key = cache_key(model, device, backend, dtype, min_agreement,
                    tuple(measure_kw.get("sides", CALIBRATION_SIDES)),
                    measure_kw.get("micro_batches"), measure_kw.get("workers"),
                    measure_kw.get("backends"))
    check_expected_hash(expect_hash, key["model_hash"], model)
    cached = read_cached(directory, key)
    if cached is None:
        return None, key
    return PlanChoice(cached["dtype"], ExecutionPlan.from_dict(cached["plan"]), "cache",
                      str(_key_file(directory, key)), cached, key["model_hash"]), key


def choose_plan(model, device: str = "cpu", backend: str = "auto", dtype: str | None = None,
                min_agreement: float = 0.995, cache: str | os.PathLike | None = None,
                log: Callable[[str], None] | None = None, expect_hash: str | None = None,
                refresh: bool = False, should_stop: Callable[[], bool] | None = None,
                **measure_kw) -> PlanChoice:
    """The plan for serving ``model`` here: from the cache when this hardware, versions and
    model were measured before (unless ``refresh``), else measured now and cached (only once
    the measurement finished: a stopped one, :class:`PlanCancelled`, caches nothing).
    ``PlanChoice.load`` opens what was chosen."""
    cached, key = lookup_plan(model, device, backend, dtype, min_agreement, cache, expect_hash, **measure_kw)
    if cached is not None and not refresh:
        return cached
    directory = cache_dir(cache)
    result = measure(model, device, backend, dtype, min_agreement, log=log, artifacts=directory / "artifacts",
                     model_hash=key["model_hash"], should_stop=should_stop, **measure_kw)
    written = write_cached(directory, key, result)
    return PlanChoice(result["dtype"], ExecutionPlan.from_dict(result["plan"]), "measured",
                      str(written) if written else None, result, key["model_hash"])
