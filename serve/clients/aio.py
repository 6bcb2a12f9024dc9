"""The asyncio client of vqserve.v1.Tokenizer, over ``grpc.aio``.

    from vqserve.serve.clients.aio import AsyncTokenizerClient
    async with AsyncTokenizerClient("127.0.0.1:50051") as client:
        indices = await client.encode(images)
        async for outcome in client.iter_encode_files(paths):
            ...

The same calls and helpers as the blocking :class:`~vqserve.serve.clients.sync.TokenizerClient`
- split by the server's limits and pipelined over one stream, files prepared here, tagged
items, deadlines scaled by pixels - awaitable: both share how work is cut into calls
(:mod:`vqserve.serve.clients.batches`) and what they send and hold
(:mod:`vqserve.serve.clients.channel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence

import grpc
import numpy as np

from vqserve.core import images as imagelib
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve.clients.batches import (
    AUTO,
    Buckets,
    FileError,  # noqa: F401 - what encode_files raises: part of this module's API
    Item,
    Limits,
    Outcome,
    Timeout,
    after_failure,
    array_parts,
    batch_pixels,
    call_deadline,
    decode_pixels,
    encode_pixels,
    file_results,
    grid_pixels,
    prefetch,
    prepared_items,
    preprocess_for,
    succeeded,
)
from vqserve.serve.clients.channel import (
    INFO_TIMEOUT_S,
    _info_dict,
    _setup_client,
    _unwrap,
    tensor_array,
    tensor_msg,
)

ENDED = object()  # what next() gives for an exhausted prefetch


class AsyncTokenizerClient:
    """asyncio client over ``grpc.aio``: the same calls and helpers as :class:`TokenizerClient`
    (splitting by the server's limits, files, tagged items), awaitable."""

    def __init__(self, target: str, token: str | None = None, tls_ca=None, tls: bool = False,
                 timeout: Timeout = AUTO, max_message_mb: int = 64, batch_size: int | None = None):
        _setup_client(self, grpc.aio, target, token, tls_ca, tls, timeout, max_message_mb,
                      batch_size)
        self._asking: asyncio.Future | None = None

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncTokenizerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- info ---------------------------------------------------------------------------
    async def model_info(self) -> dict:
        timeout = INFO_TIMEOUT_S if self.timeout == AUTO else self.timeout
        info = _info_dict(
            await self.stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata
            )
        )
        self._info = info
        return info

    async def limits(self) -> Limits:
        """The server's limits, asked once: concurrent first calls share one GetModelInfo."""
        if self._limits is None:
            if self._asking is None:
                self._asking = asyncio.ensure_future(self.model_info())
            try:
                info = await asyncio.shield(self._asking)
            except BaseException:
                self._asking = None
                raise
            self._limits = Limits.from_info(info, self._batch_size, self.max_message_mb)
        return self._limits

    async def batch_size(self) -> int:
        return (await self.limits()).max_items

    async def preprocess(
        self, size: int = 0, keep_size: bool = False, resample: str = "bicubic"
    ) -> imagelib.Preprocess:
        await self.limits()
        return preprocess_for(self._info, size, keep_size, resample)

    # ---- one request ----------------------------------------------------------------------
    async def encode_batch(self, images: np.ndarray, timeout: float | None = None) -> np.ndarray:
        images = np.asarray(images)
        seconds = timeout or call_deadline(self.timeout, int(np.prod(images.shape[:3])))
        response = await self.stub.Encode(
            pb.EncodeRequest(images=tensor_msg(images)), timeout=seconds, metadata=self.metadata
        )
        return tensor_array(response.indices)

    async def decode_batch(
        self, indices: np.ndarray, png: bool = False, timeout: float | None = None
    ) -> np.ndarray:
        indices = np.asarray(indices)
        fmt = pb.IMAGE_FORMAT_PNG if png else pb.IMAGE_FORMAT_RAW
        seconds = timeout or await self._decode_deadline(indices.shape)
        response = await self.stub.Decode(
            pb.DecodeRequest(indices=tensor_msg(indices), output_format=fmt),
            timeout=seconds,
            metadata=self.metadata,
        )
        return _unwrap(response, "images")

    async def _decode_deadline(self, shape: Sequence[int], calls: int = 1) -> float | None:
        if self.timeout != AUTO:
            return call_deadline(self.timeout, 0, calls)
        layout = (await self.limits()).tokens
        return call_deadline(self.timeout, len(shape) and shape[0] * grid_pixels(shape, layout), calls)

    # ---- any size ------------------------------------------------------------------------------
    async def encode(self, images: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        """uint8 ``[N,H,W,3]``, any N -> indices; split like :meth:`TokenizerClient.encode`."""
        images = np.asarray(images)
        if len(images) <= 1 and not batch_size:  # fits any server: skip asking for its limits
            return await self.encode_batch(images)
        parts = array_parts(
            images, await self.limits(), int(np.prod(images.shape[1:3])), batch_size
        )
        if len(parts) == 1:
            return await self.encode_batch(parts[0])
        seconds = call_deadline(self.timeout, int(np.prod(images.shape[:3])), len(parts))
        return np.concatenate([r async for r in self.encode_stream(parts, timeout=seconds)])

    async def decode(self, indices: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        """Indices ``[N,h,w]``, any N -> uint8 pixels; split like :meth:`TokenizerClient.decode`."""
        indices = np.asarray(indices)
        lim = await self.limits()
        parts = array_parts(indices, lim, grid_pixels(indices.shape, lim.tokens), batch_size)
        if len(parts) == 1:
            return await self.decode_batch(parts[0])
        seconds = await self._decode_deadline(indices.shape, len(parts))
        return np.concatenate([r async for r in self.decode_stream(parts, timeout=seconds)])

    async def encode_stream(
        self, batches: Iterable[np.ndarray], timeout: float | None = None
    ) -> AsyncIterator[np.ndarray]:
        requests = [
            pb.EncodeRequest(images=tensor_msg(b), request_id=str(i)) for i, b in enumerate(batches)
        ]
        async for response in self.stub.EncodeStream(
            iter(requests), timeout=timeout, metadata=self.metadata
        ):
            yield _unwrap(response, "indices")

    async def decode_stream(
        self, batches: Iterable[np.ndarray], timeout: float | None = None
    ) -> AsyncIterator[np.ndarray]:
        requests = [
            pb.DecodeRequest(indices=tensor_msg(b), request_id=str(i))
            for i, b in enumerate(batches)
        ]
        async for response in self.stub.DecodeStream(
            iter(requests), timeout=timeout, metadata=self.metadata
        ):
            yield _unwrap(response, "images")

    # ---- tagged items and files ------------------------------------------------------------------
    async def encode_items(
        self, items: Iterable[Item | Outcome], batch_size: int | None = None
    ) -> AsyncIterator[Outcome]:
        """As :meth:`TokenizerClient.encode_items`; ``items`` is produced in a thread."""
        async for o in self._run(items, self.encode_batch, encode_pixels, batch_size):
            yield o

    async def decode_items(
        self, items: Iterable[Item | Outcome], batch_size: int | None = None
    ) -> AsyncIterator[Outcome]:
        layout = (await self.limits()).tokens
        async for o in self._run(items, self.decode_batch, decode_pixels(layout), batch_size):
            yield o

    async def _run(self, items, call, pixels, batch_size) -> AsyncIterator[Outcome]:
        lim = await self.limits()
        buckets = Buckets(
            min(batch_size, lim.max_items) if batch_size else lim.max_items, lim.call_bytes, pixels
        )
        ahead = prefetch(items, lim.max_items)
        try:
            while (x := await asyncio.to_thread(next, ahead, ENDED)) is not ENDED:
                if isinstance(x, Outcome):
                    yield x
                    continue
                for batch in buckets.add(x):
                    for o in await self._send(batch, call, pixels):
                        yield o
            for batch in buckets.flush():
                for o in await self._send(batch, call, pixels):
                    yield o
        finally:
            with contextlib.suppress(ValueError):  # still running in its thread when cancelled
                ahead.close()

    async def _send(self, batch: list[Item], call, pixels) -> list[Outcome]:
        todo, done = deque([batch]), []
        while todo:
            b = todo.popleft()
            n_px = batch_pixels(b, pixels)
            seconds = call_deadline(self.timeout, n_px)
            try:
                out = await call(np.stack([it.array for it in b]), timeout=seconds)
            except grpc.RpcError as exc:
                retry, failed = after_failure(b, exc, self.timeout, seconds, n_px)
                todo.extendleft(reversed(retry))
                done.extend(failed)
            else:
                done.extend(succeeded(b, out))
        return done

    async def iter_encode_files(
        self,
        paths: Sequence[str | os.PathLike],
        preprocess: imagelib.Preprocess | None = None,
        *,
        size: int = 0,
        keep_size: bool = False,
        batch_size: int | None = None,
    ) -> AsyncIterator[Outcome]:
        """As :meth:`TokenizerClient.iter_encode_files`."""
        pre = preprocess or await self.preprocess(size, keep_size)
        lim = await self.limits()
        async for o in self.encode_items(prepared_items(paths, pre, lim.max_pixels), batch_size):
            yield o

    async def encode_files(
        self,
        paths: Sequence[str | os.PathLike],
        batch_size: int | None = None,
        *,
        size: int = 0,
        keep_size: bool = False,
    ) -> list[np.ndarray]:
        """As :meth:`TokenizerClient.encode_files`."""
        outcomes = [
            o
            async for o in self.iter_encode_files(
                paths, size=size, keep_size=keep_size, batch_size=batch_size
            )
        ]
        return file_results(outcomes, len(paths))
