"""How the two clients (:mod:`vqserve.serve.clients.sync`, :mod:`vqserve.serve.clients.aio`) cut
their work into calls, and what they do when a call fails: the server's limits per call, the
items of a job and what became of each, buckets of one shape and dtype within those limits,
deadlines that grow with the pixels moved, a failed multi-item call resent item by item, image
files prepared by the one shared function (:func:`vqserve.core.images.prepare`) ahead of the
network in a thread.

Why apart from the clients: the blocking and the asyncio client share every one of these
decisions and differ only in how they wait for the network, so the decisions live here
once, testable without a server.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from vqserve.core import images as imagelib
from vqserve.core.token_layout import TokenLayout

AUTO = "auto"
TIMEOUT_BASE_S = 30.0            # connection, queueing and a first batch on a cold server
TIMEOUT_PER_MEGAPIXEL_S = 15.0   # ~5x a CPU encode of the default model (2.8 s per megapixel)
CALL_BYTES = 16 << 20            # pixel bytes per call (well under the 64 MiB message limit)

# Failures that no other call can get past: stop the whole job rather than list every file.
FATAL_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED,
                         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED,
                         grpc.StatusCode.CANCELLED})
# Failures that may belong to one item of a batch: resend the batch's items one by one, so
# one bad item (say, indices outside the codebook) does not take its batch-mates with it.
SPLIT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})

Timeout = float | str | None



class FileError(ValueError):
    """A file :meth:`TokenizerClient.encode_files` could not encode; says which and why."""

    def __init__(self, path: str, reason: str, code: grpc.StatusCode | None = None):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.code = path, reason, code


def chunks(array: np.ndarray, size: int) -> list[np.ndarray]:
    """Split along axis 0 into pieces of at most ``size``."""
    return [array[i: i + size] for i in range(0, len(array), size)]


# ---- deadlines ---------------------------------------------------------------------------
def scaled_timeout(pixels: int) -> float:
    """The automatic deadline for one call moving ``pixels`` image pixels (sent or received):
    a fixed base plus a share per megapixel, so the deadline grows with the work."""
    return TIMEOUT_BASE_S + TIMEOUT_PER_MEGAPIXEL_S * pixels / 1e6


def check_timeout(timeout: Timeout) -> Timeout:
    if timeout is None or timeout == AUTO:
        return timeout
    if isinstance(timeout, str) or timeout <= 0:
        raise ValueError(
            f"timeout must be 'auto', None or a positive number of seconds, got {timeout!r}"
        )
    return float(timeout)


def call_deadline(timeout: Timeout, pixels: int, calls: int = 1) -> float | None:
    """Seconds for a call (or a stream of ``calls`` calls) moving ``pixels`` pixels."""
    if timeout == AUTO:
        return scaled_timeout(pixels) + TIMEOUT_BASE_S * (calls - 1)
    return None if timeout is None else float(timeout) * calls


def deadline_message(timeout: Timeout, seconds: float | None, n: int, pixels: int) -> str:
    """DEADLINE_EXCEEDED, said so that the reader knows what to change."""
    if timeout == AUTO:
        how = (f"the automatic deadline: {TIMEOUT_BASE_S:.0f} s + "
               f"{TIMEOUT_PER_MEGAPIXEL_S:.0f} s per megapixel")
    else:
        how = "--timeout"
    suggest = max(60.0, 2 * (seconds or 0))
    return (f"DEADLINE_EXCEEDED: no answer within {seconds or 0:.0f} s for {n} image(s), "
            f"{pixels / 1e6:.1f} megapixels ({how}); the server is slower than that: raise "
            f"--timeout (e.g. --timeout {suggest:.0f}) or lower --batch-size")


# ---- the calls of a job ------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """What one call may carry, from the server's GetModelInfo (asked once per client)."""

    max_items: int
    max_pixels: int
    factor: int
    call_bytes: int = CALL_BYTES
    layout: TokenLayout | None = None  # the token shape (a grid of ``factor`` when None)

    @property
    def tokens(self) -> TokenLayout:
        return self.layout or TokenLayout(factor=self.factor)

    @classmethod
    def from_info(cls, info: dict, batch_size: int | None, max_message_mb: int) -> Limits:
        server_max = int(info.get("max_batch_size") or 32)
        items = min(batch_size, server_max) if batch_size else server_max
        call_bytes = min(CALL_BYTES, max_message_mb * (1 << 20) // 2)
        return cls(
            max_items=max(1, items),
            max_pixels=int(info.get("max_pixels") or 0),
            factor=int(info.get("factor") or 1),
            call_bytes=call_bytes,
            layout=TokenLayout.from_info(info),
        )


@dataclass
class Item:
    """One image (encode, ``[H,W,3]`` uint8) or one token grid (decode, ``[h,w]``) to send.
    ``tag`` is the caller's label for it and comes back on its :class:`Outcome`. Items with
    a ``group`` never share a call with another group's (decode sends each token file on
    its own, so its pixels do not depend on what else was decoded with it)."""

    tag: Any
    array: np.ndarray
    group: Any = None


@dataclass
class Outcome:
    """What became of one item: ``result`` (indices or pixels) or ``error`` (one line)."""

    tag: Any
    result: np.ndarray | None = None
    error: str = ""
    code: grpc.StatusCode | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None


@dataclass(frozen=True)
class FileTag:
    """Where an encoded image came from: its position in the input list, its path, its size
    as displayed and the crop box (top, left, height, width) the preprocessing took."""

    index: int
    path: str
    original_size: tuple[int, int] = (0, 0)
    crop: tuple[int, int, int, int] = (0, 0, 0, 0)


def encode_pixels(item: Item) -> int:
    """Pixels an encode call sends for this image."""
    return int(item.array.shape[0] * item.array.shape[1])


def decode_pixels(layout: TokenLayout) -> Callable[[Item], int]:
    """Pixels a decode call gets back for one image's tokens (the response is the big side)."""
    def pixels(item: Item) -> int:
        try:
            h, w = layout.image_size(item.array.shape)
        except (ValueError, IndexError):
            return 0  # a shape the server will refuse, in its own words
        return int(h * w)
    return pixels


class Buckets:
    """Groups items of one shape and dtype into calls of at most ``max_items`` items and
    ``max_bytes`` bytes (3 bytes per pixel; one item alone may be larger).

    Memory stays bounded when images come in many sizes: once more than ``max_pending``
    bytes wait in part-filled buckets, the fullest one is sent early.
    """

    def __init__(
        self,
        max_items: int,
        max_bytes: int,
        pixels: Callable[[Item], int],
        max_pending: int = 8 * CALL_BYTES,
    ):
        self.max_items, self.max_bytes, self.pixels = max_items, max_bytes, pixels
        self.max_pending = max_pending
        self.groups: dict[tuple, list[Item]] = {}
        self.bytes: dict[tuple, int] = {}
        self.last_group: Any = None

    def add(self, item: Item) -> list[list[Item]]:
        """Queue ``item``; returns the batches that are now ready to send. A new ``group``
        sends what the previous group left part-filled."""
        ready = []
        if item.group != self.last_group:
            ready += [self._take(k) for k in list(self.groups) if k[0] == self.last_group]
            self.last_group = item.group
        key = (item.group, item.array.shape, item.array.dtype.str)
        size = 3 * self.pixels(item)
        if key in self.groups and self.bytes[key] + size > self.max_bytes:
            ready.append(self._take(key))
        self.groups.setdefault(key, []).append(item)
        self.bytes[key] = self.bytes.get(key, 0) + size
        if len(self.groups[key]) >= self.max_items or self.bytes[key] >= self.max_bytes:
            ready.append(self._take(key))
        if sum(self.bytes.values()) > self.max_pending:
            ready.append(self._take(max(self.bytes, key=self.bytes.__getitem__)))
        return ready

    def flush(self) -> list[list[Item]]:
        """Every part-filled batch, in the order its shape first appeared."""
        return [self._take(key) for key in list(self.groups)]

    def _take(self, key: tuple) -> list[Item]:
        self.bytes.pop(key)
        return self.groups.pop(key)


def batch_pixels(batch: Sequence[Item], pixels: Callable[[Item], int]) -> int:
    return sum(pixels(it) for it in batch)


def after_failure(
    batch: list[Item], exc: grpc.RpcError, timeout: Timeout, seconds: float | None, pixels: int
) -> tuple[list[list[Item]], list[Outcome]]:
    """A failed call -> (batches to resend, outcomes to report). Raises ``exc`` again when
    no further call can succeed (server down, wrong token)."""
    code = exc.code()
    if code in FATAL_CODES:
        raise exc
    if len(batch) > 1 and code in SPLIT_CODES:
        return [[it] for it in batch], []
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = deadline_message(timeout, seconds, len(batch), pixels)
    else:
        message = f"{code.name}: {' '.join((exc.details() or '').split())}"
    return [], [Outcome(it.tag, error=message, code=code) for it in batch]


def succeeded(batch: list[Item], out: np.ndarray) -> list[Outcome]:
    return [Outcome(it.tag, result=np.asarray(r)) for it, r in zip(batch, out, strict=True)]


def prepared_items(
    paths: Iterable[str | os.PathLike], pre: imagelib.Preprocess, max_pixels: int = 0
) -> Iterator[Item | Outcome]:
    """Image files -> model-ready pixels (:func:`vqserve.core.images.prepare`), one at a time; a
    file that cannot be used becomes an :class:`Outcome` with the reason, not an exception."""
    for i, p in enumerate(paths):
        tag = FileTag(i, str(p))
        try:
            prep = imagelib.prepare(p, pre)
        except imagelib.ImageError as exc:
            yield Outcome(tag, error=str(exc))
            continue
        h, w = prep.pixels.shape[:2]
        tag = FileTag(i, str(p), (prep.orig_height, prep.orig_width), tuple(prep.crop))
        if max_pixels and h * w > max_pixels:
            yield Outcome(
                tag,
                error=f"is {h}x{w} = {h * w} pixels after preprocessing, more than the "
                f"server's limit of {max_pixels}; use --size to shrink it",
            )
            continue
        yield Item(tag, prep.pixels)


def file_results(outcomes: Iterable[Outcome], n: int) -> list[np.ndarray]:
    """Outcomes of :func:`prepared_items` -> indices in input order; the first failure raises."""
    results: list[np.ndarray | None] = [None] * n
    for o in outcomes:
        if not o.ok:
            raise FileError(o.tag.path, o.error, o.code)
        results[o.tag.index] = o.result
    return results  # type: ignore[return-value]


def preprocess_for(
    info: dict, size: int = 0, keep_size: bool = False, resample: str = "bicubic"
) -> imagelib.Preprocess:
    """The preprocessing ``vqserve tokenize --size/--keep-size`` would use with this model."""
    if size and keep_size:
        raise ValueError("give --size or --keep-size, not both")
    mode = "size" if size else "keep" if keep_size else "exact"
    return imagelib.Preprocess(mode=mode, factor=int(info["factor"]), size=size, resample=resample)


def array_parts(
    array: np.ndarray, limits: Limits, per_item_pixels: int, batch_size: int | None = None
) -> list[np.ndarray]:
    """An array batch -> pieces that each fit in one call (items and bytes)."""
    items = min(batch_size, limits.max_items) if batch_size else limits.max_items
    by_bytes = max(1, limits.call_bytes // max(1, 3 * per_item_pixels))
    return chunks(np.asarray(array), max(1, min(items, by_bytes)))


def header_pixels(blob: bytes) -> int:
    """Pixels of an encoded image, from its header (no decoding); 1 MP when unreadable."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(blob)) as img:
            return img.size[0] * img.size[1]
    except Exception:  # noqa: BLE001 - the server reports the real problem
        return 1_000_000


def grid_pixels(shape: Sequence[int], layout: TokenLayout) -> int:
    """Pixels per image that a batch of tokens of ``shape`` decodes to (0 when malformed)."""
    try:
        h, w = layout.image_size(tuple(shape[1:]))
    except (ValueError, IndexError):
        return 0
    return int(h * w)


_END = object()


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


def prefetch(items: Iterable, depth: int) -> Iterator:
    """Run ``items`` (reading and preprocessing files) in a thread, ``depth`` ahead, so the
    next batch is being prepared while the server works on this one."""
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for x in items:
                if not put(x):
                    return
            put(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(_Raised(exc))

    threading.Thread(target=work, daemon=True, name="vqserve-prefetch").start()
    try:
        while True:
            x = q.get()
            if x is _END:
                return
            if isinstance(x, _Raised):
                raise x.exc
            yield x
    finally:
        stop.set()
