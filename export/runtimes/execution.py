"""How a runtime is called so that an image's tokens never depend on the batch it is in.

Measured on a 2-core Xeon (AVX-512 BF16; the default tokenizer, 48 photo tiles): with
PyTorch's default of one intra-op thread per core, a batch of one image is split across
threads *inside* each convolution (a batch of several is split across images), so the same
image gets different bf16/fp16 tokens alone than beside others (0.05-0.09% of tokens) and
fp32 decodes move by a grey level. With one intra-op thread per model call, every batch
size, position and neighbour gave identical tokens and pixels.

So the :class:`PlannedRuntime` wrapper runs every model call the same way, whatever the
caller's batch:

* **fixed micro-batch**: the batch is cut into calls of exactly ``micro_batch`` images;
  the last call is padded by repeating its last image (padding rows are dropped), so the
  kernels always see one shape per image size (and a lone image a call of one, where the
  plan measured that to give the same tokens: ``ExecutionPlan.lone_unpadded``; or a short
  call the next power of two, where the plan measured every such size to give the same
  tokens: ``ExecutionPlan.bucketed``);
* **one intra-op thread per call**: the process's torch intra-op threads are set to 1
  (and ONNX Runtime sessions are opened with one), so no reduction is split by thread count;
* **parallel calls instead**: ``workers`` calls run at once in threads (PyTorch and ONNX
  Runtime release the GIL), which uses the cores without touching any one call's arithmetic.

The server and ``vqserve tokenize`` both wrap their runtime in it, so both give the same
tokens. Whether a given device really is invariant under this plan is *measured*, not
assumed: :mod:`vqserve.export.runtimes.determinism` checks it (at export time into the manifest, at
server start into GetModelInfo).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
from dataclasses import asdict, dataclass

import numpy as np

from vqserve.core.machine import available_cores


def default_model_workers(device: str) -> int:
    """One call per core on CPU (each single-threaded). Two on a GPU or the simulated device
    (``synthetic:N``), so one call's host work (upload, kernel launches, download) overlaps
    the other's device time: on an H100 (default tokenizer, 256x256, one server process,
    16-image requests) bf16 went from 2,518 to 3,232 img/s and fp32 from 787 to 856 (the
    same kernels run, so the tokens are the same)."""
    if device.startswith("synthetic") or device.startswith("cuda"):
        return 2
    return available_cores()


@dataclass(frozen=True)
class ExecutionPlan:
    """``micro_batch``: images per model call (fixed; the last call is padded).
    ``workers``: model calls running at once. ``intra_op_threads``: threads inside one call
    (1 keeps tokens independent of the batch on CPU; see the module docstring).

    ``micro_batch_by_pixels``: measured micro-batches per image size, as ``(pixels, micro)``
    pairs (e.g. ``((4096, 4), (65536, 1))``: batching pays at 64x64 on a CPU, not at
    256x256). An image takes the entry whose pixel count is nearest on a log scale, so one
    image shape always gets the same micro-batch (and the same kernels); empty: ``micro_batch``
    for every size.

    ``lone_unpadded``: the methods (``"encode"``, ``"decode"``) whose short calls of a single
    row run as a call of one. Otherwise a short call (fewer rows than the micro-batch) is
    padded to the micro-batch, so the kernels see one shape per image size. ``--plan auto``
    lists a method only where it measured a call of one giving the same result as the same
    row inside a full micro-batch: then a lone request costs one image, not a padded
    micro-batch. On this project's CPU (one intra-op thread per call) encode tokens were equal
    at every call size, while decoding one image alone moved a pixel by one level against
    decoding it among eight — so encode runs lone images unpadded and decode pads."""

    micro_batch: int = 1
    workers: int = 1
    intra_op_threads: int = 1
    micro_batch_by_pixels: tuple[tuple[int, int], ...] = ()
    lone_unpadded: tuple[str, ...] = ()
    # methods whose short calls are padded only to the next power of two (1, 2, 4, ... below
    # the micro-batch): listed where every such call size was measured to give each row the
    # result of a full micro-batch. A few requests then cost their bucket, not a whole padded
    # micro-batch (one-image requests on a GPU at micro-batch 64 ran at 0.22 of the device).
    bucketed: tuple[str, ...] = ()
    # on CUDA, replay each call shape's kernels from a CUDA graph captured from the eager code,
    # uploading through pinned buffers (export/runtimes/cuda_graphs.py): the same kernels, so the same
    # tokens, with a fraction of the Python per call. A preference: a runtime that cannot be
    # graphed (not eager, not CUDA) or whose graphs differ from eager on the check runs eager
    cuda_graphs: bool = False

    def __post_init__(self):
        for name in ("micro_batch", "workers", "intra_op_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        pairs = tuple(sorted((int(p), int(m)) for p, m in self.micro_batch_by_pixels))
        if any(p < 1 or m < 1 for p, m in pairs):
            raise ValueError(f"micro_batch_by_pixels needs positive (pixels, micro) pairs, got {pairs}")
        object.__setattr__(self, "micro_batch_by_pixels", pairs)
        for name in ("lone_unpadded", "bucketed"):
            methods = tuple(sorted(set(getattr(self, name))))
            if set(methods) - {"encode", "decode"}:
                raise ValueError(f"{name} takes encode and decode, got {methods}")
            object.__setattr__(self, name, methods)

    def micro_batch_at(self, pixels: int) -> int:
        """The micro-batch for images of ``pixels`` (H*W): the measured size nearest on a log
        scale (ties go to the larger size), else ``micro_batch``."""
        if not self.micro_batch_by_pixels:
            return self.micro_batch
        target = math.log(max(1, pixels))
        return min(self.micro_batch_by_pixels, key=lambda pm: (abs(math.log(pm[0]) - target), -pm[0]))[1]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["micro_batch_by_pixels"] = [list(p) for p in self.micro_batch_by_pixels]
        out["lone_unpadded"] = list(self.lone_unpadded)
        out["bucketed"] = list(self.bucketed)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> ExecutionPlan:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(tuple(p) for p in v) if k == "micro_batch_by_pixels"
                          else tuple(v) if k in ("lone_unpadded", "bucketed") else v)
                      for k, v in data.items() if k in known})

    def describe(self) -> str:
        """One line for GetModelInfo and logs."""
        sizes = ", ".join(f"{int(math.isqrt(p))}^2:{m}" for p, m in self.micro_batch_by_pixels)
        micro = f"micro_batch={self.micro_batch}" + (f" ({sizes})" if sizes else "")
        lone = f" lone-unpadded={'+'.join(self.lone_unpadded)}" if self.lone_unpadded else ""
        lone += f" buckets={'+'.join(self.bucketed)}" if self.bucketed else ""
        lone += " cuda-graphs" if self.cuda_graphs else ""
        return (f"{micro}{lone} workers={self.workers} "
                f"intra_op_threads={self.intra_op_threads}")


def label_of(backend: str, dtype: str) -> str:
    """How a runtime runs, in plan lines and plan tables: ``fp32`` for eager, ``onnx/fp32``
    for an export."""
    return dtype if backend == "eager" else f"{backend}/{dtype}"


def default_plan(device: str) -> ExecutionPlan:
    """CPU: single images, one thread each, one call per core. CUDA (and its stand-in,
    ``synthetic:N``): fixed calls of 8 (kernel choice depends on the batch shape there, so
    the shape never changes), two at once; on CUDA replayed from CUDA graphs of the eager
    kernels (``cuda_graphs``: the same tokens, checked at start; H200, 256x256, 16-image
    requests: fp32 served 1,037 -> 1,158 img/s, bf16 3,584 -> 3,808). The stand-in's tokens
    are integer sums per image, the same in a call of any size by construction, so its short
    calls take buckets (what ``--plan auto`` gives a GPU where it measures them equal)."""
    if device.startswith("synthetic"):
        return ExecutionPlan(micro_batch=8, workers=default_model_workers(device), intra_op_threads=1,
                             bucketed=("decode", "encode"))
    if device.startswith("cuda"):
        return ExecutionPlan(micro_batch=8, workers=default_model_workers(device), intra_op_threads=1,
                             cuda_graphs=True)
    return ExecutionPlan(micro_batch=1, workers=default_model_workers(device), intra_op_threads=1)


def plan_for(device: str, micro_batch: int | None = None, workers: int | None = None,
             threads: int | None = None, base: ExecutionPlan | None = None,
             cuda_graphs: bool | None = None) -> ExecutionPlan:
    """``base`` (default: :func:`default_plan`) with the caller's settings (None or 0 keeps
    the base's). A micro-batch given by hand applies to every image size. ``cuda_graphs``:
    False turns them off, True on a device other than CUDA is a one-line ValueError."""
    if cuda_graphs and not str(device).startswith("cuda"):
        raise ValueError(f"CUDA graphs need a CUDA device, not {device}: they replay GPU kernels")
    plan = base or default_plan(device)
    by_pixels = () if micro_batch else plan.micro_batch_by_pixels
    # other intra-op threads or micro-batch than measured: a call of one is no longer known to agree
    changed = bool(threads and threads != plan.intra_op_threads) or bool(micro_batch)
    lone = () if changed else plan.lone_unpadded
    # a measured bucket set holds for the measured micro-batch; the stand-in's holds for any
    buckets = () if changed and not device.startswith("synthetic") else plan.bucketed
    return ExecutionPlan(micro_batch=micro_batch or plan.micro_batch, workers=workers or plan.workers,
                         intra_op_threads=threads or plan.intra_op_threads, micro_batch_by_pixels=by_pixels,
                         lone_unpadded=lone, bucketed=buckets,
                         cuda_graphs=plan.cuda_graphs if cuda_graphs is None else cuda_graphs)


_threads_lock = threading.Lock()
_allocator_warm = False


def warm_allocator() -> None:
    """Free one 31 MiB block once per process, so glibc's malloc raises its mmap threshold
    (it follows the largest mmapped block freed, up to 32 MiB) and a model call's large
    buffers come from the heap instead of fresh mappings. Measured with the default model
    at 64x64: without it every call mapped its largest buffers afresh, ~2,000 page faults
    and +30 % time per call. A no-op elsewhere than glibc, and after the first call."""
    global _allocator_warm
    if not _allocator_warm:
        block = bytearray(31 << 20)
        del block
        _allocator_warm = True


def apply_intra_op_threads(threads: int) -> None:
    """Set torch's intra-op thread count for the process (it is process-wide)."""
    import torch

    with _threads_lock:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


class PlannedRuntime:
    """A Runtime that runs ``inner`` by an :class:`ExecutionPlan` (same ``info``; the plan
    is added to ``info.extra['plan']``, and as one line with where it came from,
    ``source``, to ``info.extra['plan_line']``)."""

    def __init__(self, inner, plan: ExecutionPlan, source: str = ""):
        self.graphs_refused = ""
        if plan.cuda_graphs:  # the same kernels replayed from graphs, where they give eager's results
            from vqserve.export.runtimes.cuda_graphs import graphed_if_equal

            inner, self.graphs_refused = graphed_if_equal(inner)
            if self.graphs_refused:  # what runs is eager: the plan and identity say so
                plan = dataclasses.replace(plan, cuda_graphs=False)
        self.inner = inner
        self.plan = plan
        self.source = source
        line = f"{label_of(inner.info.backend, inner.info.dtype)} {plan.describe()}" + (f" [{source}]" if source else "")
        self.info = dataclasses.replace(inner.info, extra={**inner.info.extra, "plan": plan.to_dict(),
                                                           "plan_line": line})
        apply_intra_op_threads(plan.intra_op_threads)
        warm_allocator()
        self._max_call_pixels: int | None = None
        self._pixels_per_item = self._image_pixels
        self._pool = (concurrent.futures.ThreadPoolExecutor(plan.workers, thread_name_prefix="vqserve-model")
                      if plan.workers > 1 else None)

    def relabel(self, source: str) -> None:
        """Say the plan now comes from ``source`` (e.g. the safe plan turned out to be the
        measured one): ``info.extra['plan_line']`` is updated in place, so every copy of
        ``info`` that shares its ``extra`` (the engine's) reads the new line."""
        self.source = source
        line = self.info.extra["plan_line"].rsplit(" [", 1)[0]
        self.info.extra["plan_line"] = f"{line} [{source}]" if source else line

    def __getattr__(self, name):  # everything else (fp32_layers, tokenizer, ...) is the inner's
        return getattr(self.inner, name)

    def _image_pixels(self, method: str, item_shape: tuple[int, ...]) -> int:
        """Pixels of the image one item is: H*W to encode, (h*f)*(w*f) to decode."""
        scale = 1 if method == "encode" else int(self.inner.info.factor) ** 2
        return int(np.prod(item_shape[:2])) * scale if len(item_shape) >= 2 else 1

    def limit_call_pixels(self, max_pixels: int | None, pixels_per_item=None) -> None:
        """Cap a call's pixels (``pixels_per_item(method, item_shape)`` each): for large
        images the micro-batch shrinks, to the same size every time for one image shape, so
        the call shape stays a function of the image shape alone."""
        self._max_call_pixels = max_pixels
        self._pixels_per_item = pixels_per_item or self._image_pixels

    def micro_batch_for(self, method: str, item_shape: tuple[int, ...]) -> int:
        """Images (or index grids) per call for this item shape: the plan's micro-batch
        for the image size, lowered by the pixel budget; a function of the shape alone."""
        per_item = max(1, self._pixels_per_item(method, item_shape))
        step = self.plan.micro_batch_at(per_item)
        if self._max_call_pixels:
            step = max(1, min(step, self._max_call_pixels // per_item))
        return step

    def encode(self, images: np.ndarray) -> np.ndarray:
        return self._run(self.inner.encode, images, self.micro_batch_for("encode", tuple(images.shape[1:])),
                         "encode" in self.plan.lone_unpadded, "encode" in self.plan.bucketed)

    def decode(self, indices: np.ndarray) -> np.ndarray:
        return self._run(self.inner.decode, indices, self.micro_batch_for("decode", tuple(indices.shape[1:])),
                         "decode" in self.plan.lone_unpadded, "decode" in self.plan.bucketed)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _run(self, fn, batch: np.ndarray, step: int, lone: bool = False, bucketed: bool = False) -> np.ndarray:
        n = int(batch.shape[0])
        if n == 0:
            return fn(batch)
        chunks = [c if lone and len(c) == 1 else _padded(c, bucket_of(len(c), step) if bucketed else step)
                  for c in (batch[i:i + step] for i in range(0, n, step))]
        if self._pool is None or len(chunks) == 1:
            outs = [fn(c) for c in chunks]
        else:
            outs = list(self._pool.map(fn, chunks))
        out = np.concatenate([np.asarray(o) for o in outs])
        return out[:n]


def bucket_of(rows: int, micro_batch: int) -> int:
    """The call size a short call of ``rows`` is padded to in a bucketed plan: the next
    power of two, at most the micro-batch."""
    return min(micro_batch, 1 << max(0, rows - 1).bit_length())


def _padded(chunk: np.ndarray, size: int) -> np.ndarray:
    """``chunk`` with its last row repeated up to ``size`` rows (its own results are kept)."""
    short = size - chunk.shape[0]
    if short <= 0:
        return chunk
    return np.concatenate([chunk, np.repeat(chunk[-1:], short, axis=0)])
