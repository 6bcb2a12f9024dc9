"""The execution plan: which dtype x micro-batch a server or ``vqserve tokenize`` runs, chosen by
measuring the exact candidates on this machine and stored as a portable plan file.

``vqserve plan``, and ``vqserve serve`` / ``vqserve tokenize`` with ``--plan auto`` (the
default) or ``--plan FILE``. A plan is a backend and dtype plus an
:class:`~vqserve.export.runtimes.execution.ExecutionPlan` (micro-batch per image size,
parallel calls, intra-op threads). What is fastest depends on the hardware and the image
size, so the planner does not guess - but it never trades tokens for speed unless asked:

1. **probe** the device and list the candidates (:mod:`.candidates`);
2. **check exactness** against the reference, eager fp32 or the pinned dtype (:mod:`.exactness`);
3. **time** every qualifying candidate in interleaved rounds, relative to the safe plan
   (:mod:`.measurement`, which runs the steps);
4. **choose**: the simpler wins unless something is measurably faster (:mod:`.choose`); the
   choice then passes the server's own start-up check.

A finished measurement is cached, and can be written as a plan file that a fleet shares
(:mod:`.store`). The names below are the package's public face (and what the old module name
``vqserve.export.planner`` gives for one release); each lives in the module named beside it.
"""

from vqserve.export.plan.candidates import (
    EXPORT_BACKENDS,
    Candidate,
    DtypeResult,
    micro_batches_for,
    probe_device,
    row_label,
)
from vqserve.export.plan.exactness import calibration_images
from vqserve.export.plan.measurement import PlanCancelled, choose_plan, images_per_second, measure
from vqserve.export.plan.store import (
    PLANNER_VERSION,
    PlanChoice,
    PlanFileError,
    artifact_dir,
    cache_dir,
    cache_key,
    check_plan_out,
    check_reproduces,
    find_plan,
    lookup_plan,
    read_cached,
    write_cached,
)

__all__ = [
    "EXPORT_BACKENDS", "PLANNER_VERSION", "Candidate", "DtypeResult", "PlanCancelled", "PlanChoice",
    "PlanFileError", "artifact_dir", "cache_dir", "cache_key", "calibration_images", "check_plan_out",
    "check_reproduces", "choose_plan", "find_plan", "images_per_second", "lookup_plan", "measure",
    "micro_batches_for", "probe_device", "read_cached", "row_label", "write_cached",
]
