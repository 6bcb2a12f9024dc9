"""The measurement: ``vqserve plan``, and ``vqserve serve`` / ``vqserve tokenize`` with
``--plan auto`` (the default) when nothing is cached for this machine and model.

:func:`measure` probes the device and lists the candidates (:mod:`~vqserve.export.plan.candidates`),
checks every path's exactness against the reference (:mod:`~vqserve.export.plan.exactness`),
then **times** every way to run each qualifying path - each micro-batch with one
single-threaded call per core, and one call with every core's threads - in interleaved
rounds (each round times every candidate once), and keeps each candidate's median speed
*relative to the safe plan in the same round*: a busy machine slows whole rounds, not one
candidate. It then **chooses** (:mod:`~vqserve.export.plan.choose`) and certifies the choice
with the server's own start-up check.

The measurement stops between two model calls when asked (``should_stop``; a signal, or its
time budget): :class:`PlanCancelled`, and nothing half-measured is cached.
:func:`choose_plan` caches a finished one (:mod:`~vqserve.export.plan.store`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from vqserve.export.plan.candidates import (
    CALIBRATION_SIDES,
    DTYPES,
    EXPORT_BACKENDS,
    Candidate,
    DtypeResult,
    _candidates,
    _export_dtypes,
    default_backends,
    micro_batches_for,
    probe_device,
    timing_seconds,
)
from vqserve.export.plan.choose import _choose
from vqserve.export.plan.exactness import _certified, _exactness, calibration_images, exactness_rule
from vqserve.export.plan.store import (
    PLANNER_VERSION,
    PlanChoice,
    _export_candidate,
    cache_dir,
    lookup_plan,
    write_cached,
)
from vqserve.export.runtimes.determinism import synthetic_images
from vqserve.export.runtimes.execution import (
    ExecutionPlan,
    PlannedRuntime,
    apply_intra_op_threads,
    default_model_workers,
)
from vqserve.export.runtimes.synthetic import is_synthetic

ROUNDS = 3                 # interleaved timing rounds: every candidate once per round


class PlanCancelled(Exception):
    """The measurement was stopped (a signal, or its time budget ran out) between two model
    calls. Nothing of it is cached: the next start measures again."""


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


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        return None


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


def calibration_for(layout, sides: tuple[int, ...]) -> tuple[tuple[int, ...], np.ndarray, str]:
    """The calibration sides and photographs a model takes: as asked for a grid; for a
    pyramid (VAR), its accepted sizes nearest those asked (a pyramid tokenizes fixed sizes)."""
    if layout.is_grid:
        return tuple(sides), *calibration_images()
    sides = tuple(dict.fromkeys(layout.square_size_near(s) for s in sides))
    return sides, *calibration_images(layout.square_size_near(128))


def measure(model, device: str = "cpu", backend: str = "auto", dtype: str | None = None,
            min_agreement: float = 0.995, sides: tuple[int, ...] = CALIBRATION_SIDES,
            micro_batches: tuple[int, ...] | None = None, seconds: float | None = None,
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

    say = log or (lambda msg: None)

    def check() -> None:
        if should_stop is not None and should_stop():
            raise PlanCancelled("the measurement was stopped before it finished; nothing was cached")

    t0 = time.perf_counter()
    load_before = load_average()
    workers = workers or default_model_workers(device)
    seconds = seconds or timing_seconds(device)
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
    photos, source = None, ""  # made once the model as given is loaded: its token layout picks the sizes
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
            if photos is None:
                sides, photos, source = calibration_for(raw.info.layout, sides)
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
