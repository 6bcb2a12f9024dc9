"""CUDA graphs and pinned host buffers for the eager runtime: the same kernels, launched once.

Why: an eager call of the default tokenizer launches every convolution, norm and activation
of the encoder (or decoder) one by one from Python, and uploads from pageable memory (the
driver stages it through a bounce buffer, synchronously). At the small fixed call shapes a
plan uses on a GPU (micro-batches of 1-32) the device then waits on the host. A CUDA graph
captured from the *same* eager code path (``pixels_to_float -> encode_latents ->
quantize``, ``indices_to_codes -> decode_codes -> float_to_pixels``) replays those kernels
with one launch, on the same shapes and buffers' layouts, so the tokens and pixels are the
eager ones (``info.exact`` is the inner's); page-locked (pinned) host buffers make the
upload and download plain DMA copies on the call's own stream. :func:`graphs_equal_eager`
measures both claims (equality and speed) on a GPU. Measured with it on an H100 (default
tokenizer, random images, one thread, encode): tokens and pixels equal in fp32 and bf16;
256x256 fp32 1.62x at a call of 1, 1.04x at 8, 1.00x at 32; bf16 4.2x, 1.14x, 1.04x; 64x64
calls of 8 2.7x (fp32) and 5.5x (bf16). The gain is the host's launch time, so it is largest
for small calls.

How the pieces are kept safe:

* **one graph per (method, shape, dtype, slot)**: a graph replays on fixed static buffers,
  so two concurrent replays of one graph would race. Each call checks out a *slot* (a
  stream, its graphs, their pinned and device buffers, one private memory pool) for its
  whole duration; concurrent calls (``PlannedRuntime`` runs ``workers`` at once) hold
  different slots. Slots are bound to concurrency, not to thread identity, so a caller
  with many threads still makes at most ``max_slots`` (beyond: eager). The graphs of one
  slot share its pool: a slot replays one graph at a time, every call waits for its stream
  before the slot is given back, and every graph's static output stays alive, so no replay
  can overwrite memory another graph still needs. Slots never share a pool.
* **bounded**: at most ``max_graphs`` capture attempts per slot, and captures stop once the
  graphs' memory pools hold ``MEMORY_SHARE`` of the GPU's memory; other shapes run eager
  (a graph keeps its activations' memory for good, so unbounded image sizes must not). A shape whose capture raises is
  remembered and runs eager: a call never fails because of graphs.
* **captures exclusive**: a process-wide gate is held shared by every call that launches
  device work here (replay or eager) and exclusively by a capture, and
  ``torch.cuda.graph`` synchronizes the device before capturing. So no work of this module
  runs while a stream is being captured; the capture also uses
  ``capture_error_mode="thread_local"``, so CUDA calls of other code in the process (not
  gated) do not invalidate it, as the default ``"global"`` mode would.
* **same errors**: inputs are checked on the CPU by the tokenizer's own checks before
  anything runs on the device, so a bad request raises the eager ValueError.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import torch

from vqserve.export.runtimes.loader import EagerRuntime
from vqserve.model.tokenizer import TokenizerBase, float_to_pixels, pixels_to_float

log = logging.getLogger(__name__)

MAX_GRAPHS = 16  # capture attempts per slot (shapes); beyond, a new shape runs eager
MEMORY_SHARE = 0.25  # of the GPU's memory that the graphs of one runtime may hold; beyond, eager
MAX_SLOTS = 4    # concurrent graphed calls (PlannedRuntime runs 2 on CUDA); beyond, eager
WARMUP = 3       # eager iterations on the capture stream before capturing (PyTorch's recipe)


class _Gate:
    """Shared by calls, exclusive for a capture; a waiting capture goes before new calls."""

    def __init__(self):
        self._cond = threading.Condition()
        self._calls = 0
        self._capturing = False
        self._waiting = 0

    @contextmanager
    def shared(self):
        with self._cond:
            self._cond.wait_for(lambda: not (self._capturing or self._waiting))
            self._calls += 1
        try:
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not (self._capturing or self._calls))
            self._waiting -= 1
            self._capturing = True
        try:
            yield
        finally:
            with self._cond:
                self._capturing = False
                self._cond.notify_all()


_GATE = _Gate()  # process-wide: captures of every GraphedCalls exclude all their calls


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    host_in: torch.Tensor     # pinned
    static_in: torch.Tensor   # device, read by the graph
    static_out: torch.Tensor  # device, written by the graph (in the slot's pool)
    host_out: torch.Tensor    # pinned


class _Slot:
    """One concurrent call's stream, memory pool and graphs."""

    def __init__(self, device: torch.device, generation: int):
        self.stream = torch.cuda.Stream(device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Graph] = {}
        self.attempts = 0
        self.generation = generation
        self.broken = False


_FAILED_CAPTURES: list[torch.cuda.CUDAGraph] = []  # kept alive: see _forget_failed_capture


def _forget_failed_capture(graph: torch.cuda.CUDAGraph, slot: _Slot, began: bool,
                           stream: torch.cuda.Stream) -> None:
    """Undo what a failed ``torch.cuda.graph`` leaves behind. When the capture itself fails
    (a device sync inside it, say), PyTorch's ``CUDAGraph::capture_end`` raises before it tells
    the allocator that the capture ended, and ``__exit__`` then skips restoring the stream
    (seen on an H100, torch 2.11: the next capture into the same pool raised
    "beginAllocateToPool: already recording to mempool_id"). So:

    * the stream that was current before is made current again, and the slot is dropped
      (its pool is never used for another capture);
    * a capture that did end (a Python error inside it) is reset like any graph;
    * otherwise the allocator stops routing to the pool (``_cuda_endAllocateToPool``, as
      ``torch.cuda.use_mem_pool`` does) and the capture's hold on it is released where the
      capture had certainly begun; the graph object is kept alive, because the allocator's
      routing filter (if it could not be removed) holds a raw pointer to it.
    """
    torch.cuda.set_stream(stream)
    slot.broken = True
    try:
        graph.pool()  # raises unless capture_end completed
    except RuntimeError:
        pass
    else:
        graph.reset()
        return
    _FAILED_CAPTURES.append(graph)
    device = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, slot.pool)
        if began:
            torch._C._cuda_releasePool(device, slot.pool)
    except Exception:  # not recording (it failed before capture_begin), or another torch
        pass


class GraphedCalls:
    """``encode``/``decode`` of an :class:`EagerRuntime` on CUDA through captured graphs,
    falling back to the runtime itself (see the module docstring)."""

    def __init__(self, runtime: EagerRuntime, max_graphs: int = MAX_GRAPHS, max_slots: int = MAX_SLOTS):
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer
        self.device = self.tokenizer.device
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a tokenizer on a CUDA device, not {self.device}")
        self.max_graphs = max_graphs
        self.max_slots = max_slots
        self._index_dtype = np.dtype(runtime.info.index_dtype)
        # a family that overrode the serving path would not be the code captured here
        self._graphable = {m: getattr(type(self.tokenizer), m) is getattr(TokenizerBase, m)
                           for m in ("encode", "decode")}
        self._lock = threading.Lock()
        self._graph_bytes = 0  # what captures added to the device memory reserved
        self._memory_budget = int(MEMORY_SHARE * torch.cuda.get_device_properties(self.device).total_memory)
        self._free: list[_Slot] = []
        self._made = 0
        self._generation = 0
        self._uncapturable: set[tuple] = set()

    # -- the two calls ---------------------------------------------------------------------
    def encode(self, images: np.ndarray) -> np.ndarray:
        images = np.ascontiguousarray(images)
        if not images.flags.writeable:  # as eager: torch warns on read-only buffers
            images = images.copy()
        key = ("encode", images.shape, images.dtype.str)
        out = None
        if self._graphable["encode"] and images.dtype == np.uint8 and key not in self._uncapturable:
            self.tokenizer.check_images(torch.from_numpy(images))
            out = self._run(key, self._encode_graph, images)
        if out is None:
            with _GATE.shared():
                return self.runtime.encode(images)
        return out.astype(self._index_dtype)  # a copy: the pinned buffer serves the next call

    def decode(self, indices: np.ndarray) -> np.ndarray:
        self.tokenizer.refuse_decode()
        indices = np.ascontiguousarray(indices)
        key = ("decode", indices.shape, "<i8")
        out = None
        if self._graphable["decode"] and indices.dtype.kind in "iu" and key not in self._uncapturable:
            indices = indices.astype(np.int64)  # as eager, which checks int64 indices
            self.tokenizer.check_indices(torch.from_numpy(indices))
            out = self._run(key, self._decode_graph, indices)
        if out is None:  # eager raises its own error for a non-integer dtype
            with _GATE.shared():
                return self.runtime.decode(indices)
        return out.copy()

    def _encode_graph(self, images: torch.Tensor) -> torch.Tensor:  # TokenizerBase.encode after .to
        tok = self.tokenizer
        return tok.quantize(tok.encode_latents(pixels_to_float(images, tok.pixel_range)))[1]

    def _decode_graph(self, indices: torch.Tensor) -> torch.Tensor:  # TokenizerBase.decode after .to
        tok = self.tokenizer
        return float_to_pixels(tok.decode_codes(tok.indices_to_codes(indices)), tok.pixel_range)

    # -- slots, capture, replay --------------------------------------------------------------
    def _run(self, key: tuple, body: Callable, array: np.ndarray) -> np.ndarray | None:
        """The pinned output of one replay for ``array`` (None: run eager)."""
        slot = self._take()
        if slot is None:
            return None
        try:
            entry = slot.graphs.get(key)
            if entry is None:
                if slot.attempts >= self.max_graphs or self._graph_bytes >= self._memory_budget:
                    return None
                slot.attempts += 1
                entry = self._capture(slot, key, body, array)
                if entry is None:
                    return None
            entry.host_in.numpy()[...] = array  # the previous call of this slot has synchronized
            with _GATE.shared(), torch.cuda.device(self.device), torch.cuda.stream(slot.stream):
                entry.static_in.copy_(entry.host_in, non_blocking=True)
                entry.graph.replay()
                entry.host_out.copy_(entry.static_out, non_blocking=True)
                slot.stream.synchronize()
            return entry.host_out.numpy()
        finally:
            self._give(slot)

    def _capture(self, slot: _Slot, key: tuple, body: Callable, array: np.ndarray) -> _Graph | None:
        previous = torch.cuda.current_stream(self.device)
        graph, began = None, False
        try:
            with _GATE.exclusive(), torch.cuda.device(self.device), torch.no_grad():
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()  # as torch.cuda.graph does: what grows next is the capture's
                reserved = torch.cuda.memory_reserved(self.device)
                host_in = torch.empty(array.shape, dtype=_torch_dtype(array.dtype), pin_memory=True)
                host_in.numpy()[...] = array
                slot.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(slot.stream):
                    static_in = torch.empty_like(host_in, device=self.device)
                    static_in.copy_(host_in, non_blocking=True)
                    for _ in range(WARMUP):  # lazy init, cuDNN/cuBLAS plans, allocator warm
                        body(static_in)
                graph = torch.cuda.CUDAGraph()
                # torch.cuda.graph synchronizes the device (and empties the cache) first
                with torch.cuda.graph(graph, pool=slot.pool, stream=slot.stream,
                                      capture_error_mode="thread_local"):
                    began = True
                    static_out = body(static_in)
                host_out = torch.empty(static_out.shape, dtype=static_out.dtype, pin_memory=True)
                self._graph_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        except Exception as exc:  # an op that cannot be captured: this shape runs eager
            self._uncapturable.add(key)
            log.warning("CUDA graph capture of %s %s failed, it runs eager: %s: %s",
                        key[0], key[1], type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            if graph is not None:
                _forget_failed_capture(graph, slot, began, previous)
            return None
        entry = _Graph(graph, host_in, static_in, static_out, host_out)
        slot.graphs[key] = entry
        return entry

    def _take(self) -> _Slot | None:
        with self._lock:
            if self._free:
                return self._free.pop()  # the last given back: one caller keeps its graphs
            if self._made >= self.max_slots:
                return None
            self._made += 1
            generation = self._generation
        with _GATE.shared():  # not while another slot captures
            return _Slot(self.device, generation)

    def _give(self, slot: _Slot) -> None:
        with self._lock:
            if slot.generation != self._generation:
                return
            if slot.broken:  # its pool saw a failed capture: dropped, a fresh slot may be made
                self._made -= 1
            else:
                self._free.append(slot)

    def reset(self) -> None:
        """Drop every graph and buffer (slots in use are dropped when given back)."""
        with _GATE.exclusive(), self._lock:
            self._free.clear()
            self._made = 0
            self._generation += 1
            self._uncapturable.clear()
            self._graph_bytes = 0

    def stats(self) -> dict:
        """Slots made, graphs held by idle slots, shapes found uncapturable, bytes captured."""
        with self._lock:
            return {"slots": self._made, "graphs": sum(len(s.graphs) for s in self._free),
                    "uncapturable": len(self._uncapturable), "graph_bytes": self._graph_bytes}


class GraphedRuntime:
    """A Runtime: an eager CUDA runtime's ``encode``/``decode`` through :class:`GraphedCalls`
    (same ``info``, ``extra["cuda_graphs"] = True``; the tokens are the inner's)."""

    def __init__(self, inner, max_graphs: int = MAX_GRAPHS, max_slots: int = MAX_SLOTS):
        info = getattr(inner, "info", None)
        if not isinstance(inner, EagerRuntime):
            what = f"{info.backend} runtime" if info is not None else type(inner).__name__
            raise ValueError(f"CUDA graphs wrap an eager runtime only, not a {what} "
                             "(exported artifacts are not supported yet)")
        if not str(info.device).startswith("cuda") or not torch.cuda.is_available():
            raise ValueError(f"CUDA graphs need a runtime on a CUDA device; this one runs on {info.device}")
        self.inner = inner
        self.calls = GraphedCalls(inner, max_graphs=max_graphs, max_slots=max_slots)
        self.info = dataclasses.replace(info, extra={**info.extra, "cuda_graphs": True})

    def __getattr__(self, name):  # everything else (tokenizer, fp32_layers, ...) is the inner's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def encode(self, images: np.ndarray) -> np.ndarray:
        return self.calls.encode(images)

    def decode(self, indices: np.ndarray) -> np.ndarray:
        return self.calls.decode(indices)

    def close(self) -> None:
        self.calls.reset()


_CHECKED_LOCK = threading.Lock()


def graphed_if_equal(inner, sizes=(1, 4)) -> tuple[object, str]:
    """``(runtime, why)``: ``inner`` through CUDA graphs where it can be (an eager runtime on
    CUDA) and the graphs gave eager's tokens and pixels on a few check images at the call
    sizes ``sizes``; else ``inner`` itself and why not (one line). A plan's ``cuda_graphs``
    is a preference: what cannot be graphed, or is found to differ, runs eager, so tokens
    never depend on it. The check costs a capture per size (a fraction of a second).

    Decided once per runtime: every plan over it (the start-up check's, the one that serves)
    gets the same graphed runtime, so the check runs once and its graphs are held once."""
    with _CHECKED_LOCK:
        decided = getattr(inner, "_cuda_graphs_decided", None)
        if decided is None:
            decided = _check_graphs(inner, sizes)
            if isinstance(inner, EagerRuntime):  # only these can be graphed; others decide at once
                inner._cuda_graphs_decided = decided
        return decided


def _check_graphs(inner, sizes) -> tuple[object, str]:
    try:
        graphed = GraphedRuntime(inner)
    except ValueError as exc:
        return inner, str(exc)
    side = inner.info.layout.square_size_near(64)
    check = np.random.default_rng(7).integers(0, 256, (max(sizes), side, side, 3), dtype=np.uint8)
    for n in sizes:
        want = inner.encode(check[:n])
        if not np.array_equal(graphed.encode(check[:n]), want) or (
                inner.info.decodes and not np.array_equal(graphed.decode(want), inner.decode(want))):
            graphed.close()
            why = f"CUDA graphs gave other results than eager at a call of {n}: running eager"
            log.warning(why)
            return inner, why
    return graphed, ""


def _images_per_s(fn: Callable, batch: np.ndarray, seconds: float) -> float:
    fn(batch)  # warm
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn(batch)
        n += len(batch)
    return n / elapsed


def graphs_equal_eager(runtime, images: np.ndarray, batch_sizes=(1, 8), rounds: int = 3,
                       seconds: float = 1.0) -> dict:
    """Graphed against eager for an eager CUDA ``runtime``: tokens (and decoded pixels where
    the model decodes) equal at each call size, and encode speed in images/s (the median of
    ``rounds`` interleaved rounds of ``seconds`` each, after a warm call). ``images`` are
    repeated to fill a call. Never raises: an exception ends the measurement into ``error``."""
    out: dict = {"tokens_equal": None, "pixels_equal": None, "rows": []}
    graphed = None
    try:
        graphed = GraphedRuntime(runtime)
        images = np.asarray(images)
        for b in batch_sizes:
            batch = images[np.arange(b) % len(images)]
            want, got = runtime.encode(batch), graphed.encode(batch)
            out["tokens_equal"] = (out["tokens_equal"] is not False and want.dtype == got.dtype
                                   and np.array_equal(want, got))
            if runtime.info.decodes:
                same = np.array_equal(runtime.decode(want), graphed.decode(want))
                out["pixels_equal"] = out["pixels_equal"] is not False and same
            rates: dict[str, list[float]] = {"eager": [], "graphs": []}
            for _ in range(rounds):
                rates["eager"].append(_images_per_s(runtime.encode, batch, seconds))
                rates["graphs"].append(_images_per_s(graphed.encode, batch, seconds))
            eager, graphs = statistics.median(rates["eager"]), statistics.median(rates["graphs"])
            out["rows"].append({"batch": int(b), "eager_img_s": round(eager, 1),
                                "graphs_img_s": round(graphs, 1), "ratio": round(graphs / eager, 3)})
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if graphed is not None:
            graphed.close()
    return out
