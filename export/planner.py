"""Choose an execution plan by measuring it: ``vqserve plan`` (issue 15, first step).

A plan is a dtype plus an :class:`~vqserve.export.execution.ExecutionPlan` (micro-batch,
parallel calls, one intra-op thread each). What is fastest depends on the hardware (bf16 is
3x faster than fp32 on a CPU with AMX and slower than fp32 without it) and on the image
size (batching pays at 64x64 on a CPU and not at 256x256), so the planner does not guess:

1. **probe** the device: CPU instruction sets from ``/proc/cpuinfo`` (AVX2, AVX-512 BF16 /
   FP16, AMX), CUDA capability;
2. **measure** each candidate on calibration images of the requested size: images/s with
   enough work in flight to keep every worker busy, token agreement with fp32 on the same
   images, and batch invariance (``vqserve.export.determinism``);
3. **choose** the fastest candidate whose agreement is at least ``min_agreement`` and whose
   tokens do not depend on the batch; fp32 is always a candidate, so there is always one.

Wiring the choice into ``vqserve serve --plan auto`` (with a cache keyed by hardware, model
hash and version) is the next step; today ``vqserve plan`` prints the measurements and the
choice, and ``vqserve serve --dtype --micro-batch --model-workers`` applies one by hand.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from vqserve.export.determinism import check_invariance, synthetic_images
from vqserve.export.execution import ExecutionPlan, PlannedRuntime, default_model_workers
from vqserve.machine import available_cores, cpu_info

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


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
    dtype: str
    micro_batch: int
    workers: int
    images_per_s: float = 0.0
    agreement: float = 0.0            # tokens equal to fp32's on the calibration images
    batch_invariant: bool = False
    eligible: bool = False
    why_not: str = ""

    def plan(self) -> ExecutionPlan:
        return ExecutionPlan(micro_batch=self.micro_batch, workers=self.workers)


def candidates(device: str, micro_batches: tuple[int, ...] = (1, 4)) -> list[Candidate]:
    """Every dtype this build can run, each at the given micro-batches, one call per core."""
    workers = default_model_workers(device)
    return [Candidate(dtype, mb, workers) for dtype in ("fp32", "bf16", "fp16") for mb in micro_batches]


def images_per_second(encode, images: np.ndarray, seconds: float) -> float:
    """``encode(images)`` back to back for ``seconds`` after one warm-up call at this shape."""
    encode(images)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        encode(images)
        n += len(images)
    return n / (time.perf_counter() - t0)


def measure(model, size: int, device: str = "cpu", min_agreement: float = 0.995,
            seconds: float = 2.0, micro_batches: tuple[int, ...] = (1, 4), images: np.ndarray | None = None,
            log=None) -> dict:
    """Measure every candidate on ``images`` (default: 8 synthetic ``size`` x ``size``
    images) and choose one. Returns ``{"device": probe, "candidates": [...], "choice": ...}``."""
    from vqserve.export.runtime import load_runtime

    say = log or (lambda msg: None)
    probe = probe_device(device)
    if images is None:
        images = synthetic_images(8, size, seed=1)
    reference = None
    rows = []
    for cand in candidates(device, micro_batches):
        try:
            raw = load_runtime(model, dtype=cand.dtype, device=device)
        except (ValueError, RuntimeError) as exc:
            cand.why_not = f"cannot run: {exc}"
            rows.append(cand)
            continue
        runtime = PlannedRuntime(raw, cand.plan())
        try:
            batch = np.resize(images, (cand.micro_batch * cand.workers * 2, *images.shape[1:]))
            tokens = runtime.encode(images)
            if reference is None:  # fp32 comes first
                reference = tokens
            cand.agreement = float(np.mean(tokens == reference))
            cand.images_per_s = images_per_second(runtime.encode, batch, seconds)
            cert = check_invariance(raw, cand.plan(), images[:6], "calibration", batch_sizes=(1, 2, 5),
                                    compositions=1)
            cand.batch_invariant = cert.batch_invariant and cert.decode_batch_invariant
        finally:
            runtime.close()
        if cand.agreement < min_agreement:
            cand.why_not = f"agreement {cand.agreement:.4%} < {min_agreement:.2%}"
        elif not cand.batch_invariant:
            cand.why_not = "tokens depend on the batch"
        cand.eligible = not cand.why_not
        say(f"{cand.dtype} micro-batch {cand.micro_batch} x {cand.workers} workers: "
            f"{cand.images_per_s:.1f} img/s, agreement {cand.agreement:.4%}, "
            f"{'invariant' if cand.batch_invariant else 'NOT invariant'}")
        rows.append(cand)
    eligible = [c for c in rows if c.eligible]
    choice = max(eligible, key=lambda c: c.images_per_s) if eligible else None
    return {"device": probe, "size": size, "min_agreement": min_agreement,
            "candidates": [asdict(c) for c in rows], "choice": asdict(choice) if choice else None}
