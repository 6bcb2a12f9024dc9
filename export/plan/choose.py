"""The choice rule: which measured path and plan the planner picks.

The reference path and micro-batch 1 unless something more complex is faster by more than
5 % (:data:`MICRO_TOLERANCE`) and more than the spread of the timing rounds: where they cannot
be told apart, the simpler wins. Paths are compared by the geometric mean over image sizes of
their best speed relative to the safe plan; within the chosen path, parallel single-threaded
calls come before one threaded call, smaller micro-batches before larger ones. A change here
changes what a cached plan would be: bump ``PLANNER_VERSION`` (:mod:`vqserve.export.plan.store`).
"""

from __future__ import annotations

import math

from vqserve.export.plan.candidates import Candidate, DtypeResult
from vqserve.export.runtimes.execution import ExecutionPlan

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
