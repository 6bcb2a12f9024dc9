"""What the planner may choose between, and what this machine offers.

A plan is a backend and dtype plus an :class:`~vqserve.export.runtimes.execution.ExecutionPlan`
(micro-batch per image size, parallel calls, intra-op threads). What is fastest depends on
the hardware and the image size, so the planner does not guess: it first **probes** the
device (CPU instruction sets from ``/proc/cpuinfo``, CUDA capability), then lists every way
to run each path it may measure - the model as given, and (for a checkpoint served with
``--backend auto``) its in-process exports: each micro-batch with one single-threaded call
per core, and one call with every core's threads. :class:`DtypeResult` holds what one path
measured, :class:`Candidate` what one way to run it did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vqserve.core.machine import available_cores, cpu_info
from vqserve.export.runtimes.execution import ExecutionPlan, label_of

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
DTYPES = ("fp32", "bf16", "fp16")
CALIBRATION_SIDES = (64, 256)
MICRO_BATCHES = (1, 2, 4, 8)  # tried on a CPU
# tried on CUDA: a GPU keeps gaining to 32-64 images per call (H200 bf16 at 256x256: 2,989 img/s
# at 8, 4,370 at 32, 4,339 at 64), and with candidates to 8 alone --plan auto chose 8 there
GPU_MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
MAX_CALL_PIXELS = 4 << 20  # candidates above this many pixels per call are not tried
# timing window per candidate and round: a CPU call of the default model at 256x256 takes
# ~0.1 s, so 0.3 s holds a few; a GPU call takes milliseconds, and on a GPU node's first start
# the measurement shares the device with the traffic served meanwhile (issue 54: the safe plan
# served half its speed while it ran), so it is kept short there
TIMING_SECONDS = {"cpu": 0.3, "cuda": 0.15}


def timing_seconds(device: str) -> float:
    """The timing window ``vqserve plan`` and ``--plan auto`` use on ``device`` by default."""
    return TIMING_SECONDS["cuda" if str(device).startswith("cuda") else "cpu"]


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


def row_label(row: dict) -> str:
    """:func:`label_of` for a measured row (a ``DtypeResult`` or ``Candidate`` as a dict)."""
    return label_of(row["backend"], row["dtype"])


def micro_batches_for(device: str) -> tuple[int, ...]:
    """The micro-batches ``--plan auto`` tries on ``device`` by default."""
    return GPU_MICRO_BATCHES if str(device).startswith("cuda") else MICRO_BATCHES


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
