"""The choice rule: which measured path and plan the planner picks.

One rule, used by ``vqserve plan`` and by ``vqserve serve --plan auto`` alike (the server's
background measurement *is* ``vqserve plan``), so that the same machine gets the same plan
run after run:

- **the path** (dtype x backend): the reference unless another is faster by more than 5 %
  (:data:`MICRO_TOLERANCE`) and more than the spread of the timing rounds, comparing each
  path's best speed relative to the safe plan (geometric mean over image sizes);
- **the micro-batch** at each image size: the *smallest* micro-batch whose median speed is
  within :data:`FIT_TOLERANCE` (20 %) of the best micro-batch's at that size. A larger call
  only pays when that many requests are waiting: one-image traffic padded to calls of 64
  served 1,145-1,672 img/s on an H200 where calls of 16, 0.8 of the in-process best, served
  3,273-3,472. The tolerance is also what keeps the choice stable: timing noise smaller than
  the gap between a candidate and the threshold cannot move it (tests/unit/export/test_choose.py);
- **parallel calls or one threaded call**: parallel single-threaded calls unless one call with
  every core's threads is measurably faster (5 % and the spread).

A change here changes what a cached plan would be: bump ``PLANNER_VERSION``
(:mod:`vqserve.export.plan.store`).
"""

from __future__ import annotations

import math

from vqserve.export.plan.candidates import Candidate, DtypeResult
from vqserve.export.runtimes.execution import ExecutionPlan

MICRO_TOLERANCE = 0.05  # a more complex path or threading must beat the simpler one by more than this (and the spread)
FIT_TOLERANCE = 0.20    # the smallest micro-batch within this of the best micro-batch's speed is chosen


def _noise(c: Candidate) -> float:
    """How far a candidate's rounds scattered, relative to its median ratio."""
    return c.spread / c.ratio if c.ratio > 0 else 0.0


def _better(new_ratio: float, new_noise: float, old_ratio: float, old_noise: float) -> bool:
    """Whether a more complex choice beats a simpler one: by more than 5 % and more than the
    two relative spreads together; where the measurements cannot tell them apart, the simpler
    wins."""
    return new_ratio > old_ratio * (1 + max(MICRO_TOLERANCE, new_noise + old_noise))


def fitting(speeds: dict[int, float], tolerance: float = FIT_TOLERANCE) -> int:
    """The micro-batch rule on its own: of ``{micro_batch: speed}``, the smallest micro-batch
    whose speed is at least ``1 - tolerance`` of the fastest's."""
    if not speeds:
        raise ValueError("no micro-batch was measured")
    floor = (1 - tolerance) * max(speeds.values())
    return min(m for m, s in speeds.items() if s >= floor)


def _pool(rows: list[Candidate], res: DtypeResult, side: int, threads: bool | None) -> list[Candidate]:
    return [c for c in rows if (c.backend, c.dtype, c.side) == (res.backend, res.dtype, side)
            and (threads is None or (c.threads > 1) == threads)]


def _best_at(rows: list[Candidate], res: DtypeResult, side: int, threads: bool | None = None) -> Candidate | None:
    """The candidate the rule picks for one path at one size: :func:`fitting` over its
    micro-batches (for threaded candidates, one each: the same)."""
    pool = _pool(rows, res, side, threads)
    if not pool:
        return None
    chosen = fitting({c.micro_batch: c.ratio for c in pool})
    return min((c for c in pool if c.micro_batch == chosen), key=lambda c: c.complexity)


def _fastest_at(rows: list[Candidate], res: DtypeResult, side: int, threads: bool | None = None) -> Candidate | None:
    """The path's fastest candidate at one size: what the path can do, to compare paths."""
    return max(_pool(rows, res, side, threads), key=lambda c: c.ratio, default=None)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values)) if values else 0.0


def _choose(rows: list[Candidate], results: dict[str, DtypeResult], sides: tuple[int, ...],
            workers: int) -> tuple[DtypeResult, ExecutionPlan]:
    """The path (in measuring order: the reference first) and plan: a later path or a
    threaded call replaces an earlier, simpler one only where it is measurably faster; the
    micro-batch at each size is the smallest within :data:`FIT_TOLERANCE` of the fastest."""
    noise = {}
    for res in results.values():
        tops = [_fastest_at(rows, res, s, threads=False) for s in sides]
        res.score = _geomean([c.ratio for c in tops]) if all(tops) else 0.0
        noise[res.label] = max((_noise(c) for c in tops if c), default=0.0)
    choice = None
    for res in (r for r in results.values() if r.eligible and r.score):
        if choice is None or _better(res.score, noise[res.label], choice.score, noise[choice.label]):
            choice = res
    fastest = [_fastest_at(rows, choice, s, threads=False) for s in sides]
    threaded = [_best_at(rows, choice, s, threads=True) for s in sides]
    if all(threaded) and _better(_geomean([c.ratio for c in threaded]), max(_noise(c) for c in threaded),
                                 _geomean([c.ratio for c in fastest]), max(_noise(c) for c in fastest)):
        return choice, ExecutionPlan(1, 1, workers)
    parallel = [_best_at(rows, choice, s, threads=False) for s in sides]
    by_pixels = tuple((s * s, c.micro_batch) for s, c in zip(sides, parallel, strict=True))
    return choice, ExecutionPlan(micro_batch=parallel[-1].micro_batch, workers=workers,
                                 micro_batch_by_pixels=by_pixels, lone_unpadded=tuple(choice.lone_invariant),
                                 bucketed=tuple(choice.bucket_invariant))
