"""``--model synthetic:N``: a stand-in accelerator, so the serving path and the batch CLI
can be built, tested and measured on a machine without a GPU.

It answers like a tokenizer (codebook 64,000, factor 8, encode and decode) after N
microseconds of simulated device time per 256x256 image, proportional to the pixels of
the call. The device is one serial queue, as a GPU stream is: a call reserves its time
on the device clock (starting when the device frees, or now) and sleeps until its work
is done, with the GIL released, so Python running meanwhile in other threads overlaps
with the "kernel" as it would with a real one. Its capacity is therefore known exactly:
``1e6 / N`` images per second at 256x256, whatever calls them, and a served figure
divided by it says how much of the device the serving path keeps busy.

Its tokens are a cheap deterministic function of every pixel, so answers can be checked
anywhere (a byte moved or lost on the way changes them): each 8x8 block's 192 bytes read
as 24 little-endian uint64 words, summed with wrap-around, modulo 64,000. That costs about
16 µs of real CPU per 256x256 image (2-core AMD EPYC; an exact byte sum over strided
axes cost 125 µs, which would have measured numpy instead of the serving path): host work
like a real runtime's upload, not device time. Decode paints each block the grey
``index % 256``.

Parsing a ``synthetic:N`` name imports no torch (the CLI checks ``--model`` with it before
anything heavy loads).

**Simulated device faults**, for testing how a server meets a failing GPU on a machine
without one: ``synthetic:N?OPTION=VALUE&...`` (quote it in a shell). Each fault fires on the
model calls of one image height (pixels: encode's input, decode's output), a height the
start-up check (64) never uses:

- ``oom_at=H``: the call raises ``RuntimeError("CUDA out of memory. ...")``, the text of
  torch's ``torch.cuda.OutOfMemoryError``;
- ``poison_at=H``: the call raises ``RuntimeError("CUDA error: an illegal memory access was
  encountered")``, an error after which a real CUDA context is unusable;
- ``hang_at=H``: the call holds the whole device (every other call waits behind it) for
  ``hang_s`` seconds (default 30), or until the file ``release=PATH`` exists, as a wedged
  kernel holds a GPU.

A fault is a property of how the model was started, never of a request: a server started
with ``synthetic:N`` (or any real model) has none, whatever a client sends; the served
identity lists the faults (``GetModelInfo`` ``simulated_faults``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass

import numpy as np

from vqserve.core.input_rules import index_range_text
from vqserve.core.runtime_info import RuntimeInfo

PREFIX = "synthetic:"
CODEBOOK_SIZE = 64_000
FACTOR = 8
REFERENCE_PIXELS = 256 * 256


def is_synthetic(model) -> bool:
    return isinstance(model, str) and model.startswith(PREFIX)


def parse_synthetic(model: str) -> float:
    """``synthetic:N`` -> N (µs per 256x256 image); a one-line ValueError otherwise (the
    fault options after ``?`` are checked too: :func:`parse_faults`)."""
    parse_faults(model)
    text = model[len(PREFIX):].partition("?")[0]
    try:
        micros = float(text)
    except ValueError:
        micros = -1.0
    if not (0 <= micros <= 1e6):
        raise ValueError(f"--model {model!r}: synthetic:N needs N, the simulated device microseconds per "
                         "256x256 image, a number from 0 to 1000000 (e.g. synthetic:200 = 5,000 img/s)")
    return micros


@dataclass(frozen=True)
class SimulatedFaults:
    """The faults a ``synthetic:N?...`` model was started with (module docstring)."""

    oom_at: int | None = None
    poison_at: int | None = None
    hang_at: int | None = None
    hang_s: float = 30.0
    release: str | None = None

    def __bool__(self) -> bool:
        return any(h is not None for h in (self.oom_at, self.poison_at, self.hang_at))

    def describe(self) -> str:
        return ",".join(f"{name}={getattr(self, name)}" for name in ("oom_at", "poison_at", "hang_at")
                        if getattr(self, name) is not None)


_HEIGHT = (int, lambda h: h > 0 and h % FACTOR == 0, f"an image height in pixels, a positive multiple of {FACTOR}")
_CHECKS = {"oom_at": _HEIGHT, "poison_at": _HEIGHT, "hang_at": _HEIGHT,
           "hang_s": (float, lambda s: 0 < s <= 86400, "seconds, more than 0 and at most 86400"),
           "release": (str, bool, "a file path")}


def parse_faults(model: str) -> SimulatedFaults:
    """The options after ``?`` in ``synthetic:N?oom_at=40&...``; a one-line ValueError for
    an unknown one or a bad value."""
    query = model[len(PREFIX):].partition("?")[2]
    if not query:
        return SimulatedFaults()
    fields: dict = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if name not in _CHECKS:
            raise ValueError(f"--model {model!r}: unknown simulated fault {name!r}; use "
                             "oom_at=H, poison_at=H, hang_at=H, hang_s=S, release=PATH")
        kind, valid, needs = _CHECKS[name]
        try:
            fields[name] = kind(value)
        except ValueError:
            fields[name] = None
        if fields[name] is None or not valid(fields[name]):
            raise ValueError(f"--model {model!r}: {name}={value!r} needs {needs}")
    return SimulatedFaults(**fields)


class SimulatedDeviceError(RuntimeError):
    """A simulated CUDA failure (``synthetic:N?oom_at=...`` or ``poison_at=...``)."""


def capacity(micros: float) -> float:
    """Images per second at 256x256 the simulated device can do (inf at N = 0)."""
    return 1e6 / micros if micros else float("inf")


# the model hash: the token function's version alone (the speed N changes no token)
SYNTHETIC_HASH = hashlib.sha256(b"vqserve synthetic tokenizer v1: 8x8 block uint64 word sums mod 64000").hexdigest()


class SimulatedDevice:
    """One serial device clock shared by every call of every runtime on one device."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.busy_s = 0.0  # total device time spent, for utilisation figures

    def run(self, seconds: float) -> None:
        """Queue ``seconds`` of work and wait (GIL released) until it has run."""
        if seconds <= 0:
            return
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + seconds
            self.busy_s += seconds
            done = self._free_at
        while (left := done - time.perf_counter()) > 0:
            time.sleep(left)

    def hang(self, seconds: float, release: str | None = None) -> None:
        """Hold the device (no other call may start) for ``seconds``, or until the file
        ``release`` exists: a wedged kernel."""
        end = time.perf_counter() + seconds
        with self._lock:
            while time.perf_counter() < end and not (release and os.path.exists(release)):
                time.sleep(0.05)
            self._free_at = max(self._free_at, time.perf_counter())


_DEVICES: dict[str, SimulatedDevice] = {}
_DEVICES_LOCK = threading.Lock()


def simulated_device(name: str) -> SimulatedDevice:
    with _DEVICES_LOCK:
        return _DEVICES.setdefault(name, SimulatedDevice())


def block_tokens(images: np.ndarray) -> np.ndarray:
    """uint8 ``[B,H,W,3]`` -> uint16 ``[B,H/8,W/8]``: per 8x8 block, the wrapping sum of
    its 24 little-endian uint64 words, modulo the codebook (contiguous adds only)."""
    b, h, w, _ = images.shape
    words = np.ascontiguousarray(images).reshape(b, h // FACTOR, FACTOR, w * 3).view("<u8")
    total = words[:, :, 0].copy()
    for row in range(1, FACTOR):
        total += words[:, :, row]
    total = total.reshape(b, h // FACTOR, w // FACTOR, 3)
    total = total[..., 0] + total[..., 1] + total[..., 2]
    return (total % np.uint64(CODEBOOK_SIZE)).astype(np.uint16)


class SyntheticRuntime:
    """The Runtime interface over :class:`SimulatedDevice` (see the module docstring)."""

    def __init__(self, model: str = "synthetic:200", device: str = "synthetic:0"):
        self.micros = parse_synthetic(model)
        self.faults = parse_faults(model)
        if device in ("synthetic", "synthetic:") or not device.startswith("synthetic"):
            device = "synthetic:0"  # the kind alone, auto, cpu or cuda: the first simulated device
        self.device = simulated_device(device)
        self.name = model

        self.info = RuntimeInfo(
            backend="synthetic", dtype="fp32", device=device, quantizer="vq",
            codebook_size=CODEBOOK_SIZE, factor=FACTOR, index_dtype="uint16",
            model_hash=SYNTHETIC_HASH, source_hash=SYNTHETIC_HASH, exact=True,
            extra={"family": "synthetic", "device_us_per_256": self.micros,
                   **({"simulated_faults": self.faults.describe()} if self.faults else {})})

    @property
    def capacity(self) -> float:
        return capacity(self.micros)

    def _spend(self, pixels: int, height: int) -> None:
        faults = self.faults
        if height == faults.oom_at:
            raise SimulatedDeviceError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated by "
                                       f"{self.name})")
        if height == faults.poison_at:
            raise SimulatedDeviceError("CUDA error: an illegal memory access was encountered (simulated by "
                                       f"{self.name})")
        if height == faults.hang_at:
            self.device.hang(faults.hang_s, faults.release)
        self.device.run(self.micros * 1e-6 * pixels / REFERENCE_PIXELS)

    def encode(self, images: np.ndarray) -> np.ndarray:
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"images must be uint8 [B,H,W,3], got {images.dtype} {list(images.shape)}")
        b, h, w, _ = images.shape
        if h % FACTOR or w % FACTOR:
            raise ValueError(f"H and W must be multiples of {FACTOR}, got {h}x{w}")
        tokens = block_tokens(images)
        self._spend(b * h * w, h)
        return tokens

    def decode(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices)
        if indices.dtype.kind not in "iu" or indices.ndim != 3:
            raise ValueError(f"indices must be an integer [B,h,w] array, got {indices.dtype} {list(indices.shape)}")
        rule = index_range_text(int(indices.min()), int(indices.max()), CODEBOOK_SIZE) if indices.size else None
        if rule:
            raise ValueError(f"indices: {rule}")
        b, h, w = indices.shape
        grey = (indices % 256).astype(np.uint8)
        # each index's grey level over its 8x8x3 block, written once by one broadcast (two
        # np.repeat and a copy cost 6x the CPU: 0.68 ms per 256x256 image, more than the
        # reply path it stands in front of)
        pixels = np.empty((b, h, FACTOR, w, FACTOR, 3), np.uint8)
        pixels[...] = grey[:, :, None, :, None, None]
        self._spend(b * h * w * FACTOR * FACTOR, h * FACTOR)
        return pixels.reshape(b, h * FACTOR, w * FACTOR, 3)
