"""PNG/JPEG request bytes -> pixels, without letting one request take the server down.

A 3 KB PNG can claim 1024x1024 pixels (3 MB decoded), so a 1 MB request can ask for
gigabytes. :class:`ImageDecoder` therefore works in three steps, cheapest first:

1. **count**: more images than ``max_batch_size`` is refused before a byte is parsed;
2. **headers**: each image's size is read from its header (no pixel decoded) and checked
   against the per-image limit and the one-size-per-request rule;
3. **decode**, only then, in a small thread pool of its own (never on the event loop, so
   health checks and other clients keep being answered), under a **decoded-bytes budget**
   shared by all requests: a request waits (up to its deadline) until the pixels already
   decoded and not yet encoded leave room for its own. The reservation is held until the
   caller has finished with the pixels (``async with``), so the budget bounds the
   server's decoded-image memory, queued batches included. A request that expires (or is
   cancelled) gives its room back at once: the images not yet decoded are never decoded,
   and the batcher drops its queued rows at the deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np

from vqserve.core import images
from vqserve.core.machine import available_cores
from vqserve.serve.api.codec import WIRE_IMAGE_FORMATS, BadInput, size_mismatch
from vqserve.serve.error_codes import DeadlineExpired


def default_decode_threads() -> int:
    """Pillow releases the GIL while decoding: a few threads use a few cores (those this
    process may use: a container's CPU limit, not the node's cores)."""
    return max(1, min(4, available_cores()))


class ByteBudget:
    """An asyncio counting budget in bytes: ``acquire(n)`` waits until ``n`` fits.

    First come, first served: a large request is not starved by a stream of small ones,
    because waiters are woken in arrival order and a waiter blocks those behind it."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"the decoded-bytes budget must be positive, got {limit}")
        self.limit = limit
        self.in_use = 0
        self._waiters: list[tuple[int, asyncio.Future]] = []

    async def acquire(self, nbytes: int) -> None:
        if nbytes > self.limit:
            raise ValueError(f"{nbytes} bytes can never fit the budget of {self.limit}")
        if not self._waiters and self.in_use + nbytes <= self.limit:
            self.in_use += nbytes
            return
        future = asyncio.get_running_loop().create_future()
        entry = (nbytes, future)
        self._waiters.append(entry)
        try:
            await future
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()  # it may have been the head blocking smaller requests
            elif future.done() and not future.cancelled():
                self.release(nbytes)  # granted just as we were cancelled: give it back
            raise

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_use + self._waiters[0][0] <= self.limit:
            nbytes_next, future = self._waiters.pop(0)
            if future.done():
                continue
            self.in_use += nbytes_next
            future.set_result(None)


class ImageDecoder:
    """Checks and decodes the ``encoded`` images of a request (see the module docstring)."""

    def __init__(self, max_decoded_bytes: int, threads: int | None = None):
        self.budget = ByteBudget(max_decoded_bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads or default_decode_threads(), thread_name_prefix="vqserve-decode")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_headers(self, blobs: Sequence[bytes], field: str, max_images: int,
                      max_pixels: int) -> tuple[int, int]:
        """Count, then every header: -> the request's (H, W). Raises :class:`BadInput`."""
        if not blobs:
            raise BadInput(field, "is an empty batch (no images)")
        if len(blobs) > max_images:
            raise BadInput(field, f"holds {len(blobs)} images, more than max-batch-size {max_images}; "
                                  "split it (the Python client does)")
        size = None
        for i, blob in enumerate(blobs):
            name = f"{field}[{i}]"
            if not blob:
                raise BadInput(name, "is empty (expected PNG or JPEG bytes)")
            try:
                header = images.probe(blob, WIRE_IMAGE_FORMATS, max_pixels)
            except images.ImageError as exc:
                raise BadInput(name, str(exc)) from None
            if size is None:
                size = (header.height, header.width)
            elif (header.height, header.width) != size:
                raise size_mismatch(name, (header.height, header.width), size, field)
        return size

    @contextlib.asynccontextmanager
    async def decoded(self, blobs: Sequence[bytes], field: str, max_images: int, max_pixels: int,
                      deadline: float | None = None) -> AsyncIterator[np.ndarray]:
        """``async with decoder.decoded(...) as pixels:`` uint8 ``[B,H,W,3]``; the memory
        stays reserved in the budget until the block ends."""
        loop = asyncio.get_running_loop()
        blobs = list(blobs)
        h, w = await loop.run_in_executor(self._pool, self.check_headers, blobs, field,
                                          max_images, max_pixels)
        nbytes = len(blobs) * h * w * 3 * 2  # each image, then their stacked copy
        await self._reserve(nbytes, deadline)
        try:
            decoding = asyncio.gather(*(
                loop.run_in_executor(self._pool, _decode_one, blob, f"{field}[{i}]", max_pixels)
                for i, blob in enumerate(blobs)))
            try:  # at the deadline the images not yet started are never decoded
                arrays = await asyncio.wait_for(decoding, _remaining(deadline))
            except asyncio.TimeoutError:
                raise DeadlineExpired("the deadline passed while the images were decoding") from None
            for i, arr in enumerate(arrays):
                if arr.shape[:2] != (h, w):  # a header that lied about its size
                    raise BadInput(f"{field}[{i}]", f"decodes to {arr.shape[0]}x{arr.shape[1]}, "
                                                    f"but its header says {h}x{w}")
            yield np.stack(arrays)
        finally:
            self.budget.release(nbytes)

    async def _reserve(self, nbytes: int, deadline: float | None) -> None:
        if nbytes > self.budget.limit:
            raise BadInput("encoded.images", f"would decode to {nbytes} bytes, more than the server's "
                                             f"decoded-image budget of {self.budget.limit} bytes "
                                             "(--max-decoded-mb); send fewer or smaller images")
        try:
            await asyncio.wait_for(self.budget.acquire(nbytes), _remaining(deadline))
        except asyncio.TimeoutError:
            raise DeadlineExpired("the deadline passed while waiting for room to decode the images") from None


def _remaining(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value; never negative), or None."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _decode_one(blob: bytes, name: str, max_pixels: int) -> np.ndarray:
    try:
        return images.load_rgb(blob, formats=WIRE_IMAGE_FORMATS, max_pixels=max_pixels)
    except images.ImageError as exc:
        raise BadInput(name, str(exc)) from None
