"""Where the time of a ``vqserve tokenize`` run goes: each stage's busy seconds and the
stage that kept the others waiting.

Apart from the overlapped engine (``offline/engine.py``) that fills them in because the
figures are a job of their own: both local engines (the serial one in
``offline/pipeline.py`` too) report a :class:`Stages`, read by the closing line of a run and
by ``vqserve bench tokenize``, and what a bottleneck is should not change when the pipeline
does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

SHORT_RUN_S = 2.0  # shorter runs get no bottleneck verdict: start-up and the end dominate them

@dataclass
class Stages:
    """Busy seconds of each stage of one run (``offline/engine.py``'s docstring says which)."""

    workers: int = 0
    devices: list = field(default_factory=list)
    wall_s: float = 0.0
    images: int = 0
    decode_s: float = 0.0          # decode wall seconds summed over workers (inline: this process)
    decode_images: int = 0
    device_s: dict = field(default_factory=dict)   # device -> seconds with a call in flight
    write_s: float = 0.0
    main_cpu_s: float = 0.0
    thread_cpu_s: dict = field(default_factory=dict)  # where main_cpu_s went: main, executors, writer
    marks: list = field(default_factory=list)  # (seconds since start, images written so far), per task

    @property
    def first_s(self) -> float | None:
        """Seconds from the start until the first tokens were written: workers spawned, the
        first tasks decoded and run (on a device, its first call's warm-up too)."""
        return self.marks[0][0] if self.marks else None

    @property
    def steady_rate(self) -> float | None:
        """Images/s between the tasks that wrote the first 10 % and the last 10 % of the
        images: the rate a long run keeps, without start-up and the drain at the end (None
        when the run had too few tasks to tell)."""
        if len(self.marks) < 4:
            return None
        total = self.marks[-1][1]
        inner = [m for m in self.marks if 0.1 * total <= m[1] <= 0.9 * total]
        if len(inner) < 2 or inner[-1][0] <= inner[0][0]:
            return None
        return (inner[-1][1] - inner[0][1]) / (inner[-1][0] - inner[0][0])

    @property
    def decode_capacity(self) -> float:
        """Images/s the decode workers can deliver: workers x their measured per-image rate."""
        if not self.decode_s:
            return float("inf")
        return max(1, self.workers) * self.decode_images / self.decode_s

    def shares(self) -> dict:
        """Each stage's busy time as a share of the run's wall time (decode: per worker)."""
        wall = self.wall_s or 1.0
        device = max(self.device_s.values(), default=0.0)
        return {"decode": self.decode_s / max(1, self.workers) / wall, "device": device / wall,
                "write": self.write_s / wall}

    def bottleneck(self) -> tuple[str, str]:
        """(stage, advice): the stage with the largest busy share; below 60 % for all, the
        pipeline between them (this process) is the limit; a run shorter than
        ``SHORT_RUN_S`` is ``start-up``-bound."""
        shares = self.shares()
        stage = max(shares, key=shares.get)
        if self.wall_s < SHORT_RUN_S:
            return "start-up", (f"a run under {SHORT_RUN_S:.0f} s is mostly starting the workers and "
                                "writing the manifest; a longer one shows its bottleneck")
        if shares[stage] < 0.6:
            return "pipeline", ("no stage is busy most of the time: the main process is the limit "
                                "(try a larger --batch-size)")
        return stage, {"decode": "add --workers or cores" if self.workers else
                       "decoding runs inline (--workers 0): add --workers",
                       "device": self._device_advice(),
                       "write": "the output folder's disk (or Parquet encoding) is the limit"}[stage]

    def _device_advice(self) -> str:
        if any(d.startswith("cpu") for d in self.devices):
            return "the model on the CPU is the limit (a GPU: --device cuda)"
        if len(self.devices) > 1:
            return "the accelerators are the limit"
        return "the accelerator is the limit (more of them: --device cuda:0,1,...)"

    def line(self) -> str:
        """The closing line: the time split into decode, device and write, and the bottleneck."""
        shares = self.shares()
        stage, advice = self.bottleneck()
        per_image = 1e6 * self.main_cpu_s / max(1, self.images)
        decode = (f"decode {shares['decode']:.0%} ({self.workers} workers, "
                  f"{self.decode_capacity:,.0f} img/s capacity)" if self.workers else
                  f"decode {shares['decode']:.0%} (inline)")
        devices = ",".join(self.devices) or "device"
        return (f"time: {decode}, device {shares['device']:.0%} ({devices}), write {shares['write']:.0%}"
                + (f", first tokens after {self.first_s:.1f} s" if self.first_s is not None else "") + "; "
                f"main process {per_image:.0f} µs CPU/image; {stage}-bound: {advice}")

    def to_dict(self) -> dict:
        stage, advice = self.bottleneck()
        return {"workers": self.workers, "devices": self.devices, "wall_s": self.wall_s, "images": self.images,
                "decode_s": self.decode_s, "decode_images": self.decode_images,
                "decode_capacity_images_per_s": (None if self.decode_capacity == float("inf")
                                                 else self.decode_capacity),
                "device_s": self.device_s, "write_s": self.write_s, "main_cpu_s": self.main_cpu_s,
                "main_cpu_us_per_image": 1e6 * self.main_cpu_s / max(1, self.images),
                "thread_cpu_us_per_image": {k: 1e6 * v / max(1, self.images) for k, v in self.thread_cpu_s.items()},
                "first_tokens_s": self.first_s, "steady_images_per_s": self.steady_rate,
                "shares": self.shares(), "bottleneck": stage, "advice": advice}


class _Busy:
    """Seconds during which at least one call is in flight (one device, several threads)."""

    def __init__(self) -> None:
        self.lock, self.inflight, self.since, self.seconds = threading.Lock(), 0, 0.0, 0.0

    def __enter__(self):
        with self.lock:
            if not self.inflight:
                self.since = time.perf_counter()
            self.inflight += 1

    def __exit__(self, *exc):
        with self.lock:
            self.inflight -= 1
            if not self.inflight:
                self.seconds += time.perf_counter() - self.since
