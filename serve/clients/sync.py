"""Python clients for vqserve.v1.Tokenizer.

    from vqserve.serve.clients.sync import TokenizerClient
    with TokenizerClient("127.0.0.1:50051") as client:
        indices = client.encode(images)          # uint8 [N,H,W,3], any N: split and pipelined
        images2 = client.decode(indices)
        tokens = client.encode_files(["a.png", "b.jpg"], size=256)

Large arrays are split into calls of at most the server's ``max_batch_size`` images (asked
once with GetModelInfo) and at most ``CALL_BYTES`` of pixels, and sent over one
bidirectional stream, so many calls are in flight at once and the server can batch them.
``AsyncTokenizerClient`` does the same for asyncio code: both clients share how work is cut
into calls (:mod:`vqserve.serve.clients.batches`) and differ only in how they wait for the
network.

Files (:meth:`TokenizerClient.iter_encode_files`) are read and preprocessed here by the
one shared function (``vqserve.core.images.prepare``) and sent as raw uint8 pixels, so the
server sees exactly the pixels ``vqserve tokenize`` would encode: same file, same tokens.

Deadlines: ``timeout="auto"`` (the default) gives each call ``scaled_timeout`` of its
pixels, so a call with 32 one-megapixel photos is not held to a deadline meant for one
thumbnail; a number is a fixed deadline per call; ``None`` waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np

from vqserve.core import images as imagelib
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc
from vqserve.serve.api import codec
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
    check_timeout,
    decode_pixels,
    encode_pixels,
    file_results,
    grid_pixels,
    header_pixels,
    prefetch,
    prepared_items,
    preprocess_for,
    succeeded,
)

INFO_TIMEOUT_S = 30.0  # GetModelInfo: tiny, but the server may still be loading
ENDED = object()  # what next() gives for an exhausted prefetch


class ServerError(Exception):
    """A stream message the server answered with an error."""

    def __init__(self, code: int, message: str):
        try:
            self.code = next(c for c in grpc.StatusCode if c.value[0] == code)
        except StopIteration:
            self.code = grpc.StatusCode.UNKNOWN
        self.details = message
        super().__init__(f"{self.code.name}: {message}")


def tensor_msg(array: np.ndarray) -> pb.Tensor:
    shape, dtype, data = codec.array_to_bytes(array)
    return pb.Tensor(shape=shape, dtype=dtype, data=data)


def tensor_array(msg: pb.Tensor) -> np.ndarray:
    return codec.array_from_bytes(msg.shape, msg.dtype, msg.data, "response")


def _channel_args(max_message_mb: int) -> list[tuple[str, int]]:
    limit = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


def _credentials(tls_ca: str | bytes | os.PathLike | None, tls: bool):
    if not tls and tls_ca is None:
        return None
    root = None
    if tls_ca is not None:
        root = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=root)


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def check_health(target: str, service: str = "", timeout: float = 5.0, tls_ca=None,
                 tls: bool = False) -> str:
    """Ask ``grpc.health.v1.Health/Check``; returns the status name (``SERVING``,
    ``NOT_SERVING``, ``SERVICE_UNKNOWN``...). Raises ``grpc.RpcError`` when unreachable.
    Health needs no token (the server leaves it open for probes)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    creds = _credentials(tls_ca, tls)
    channel = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _info_dict(info: pb.ModelInfo) -> dict:
    return {
        "quantizer": info.quantizer,
        "codebook_size": info.codebook_size,
        "levels": list(info.levels),
        "dither": info.dither or "none",
        "factor": info.factor,
        "codes_per_position": info.codes_per_position,
        "index_dtype": info.index_dtype,
        "accepted_sizes": info.accepted_sizes,
        "max_pixels": info.max_pixels,
        "max_batch_size": info.max_batch_size,
        "dtype": info.dtype,
        "backend": info.backend,
        "device": info.device,
        "model_hash": info.model_hash,
        "source_hash": info.source_hash or info.model_hash,  # servers before 26 Nov 2026: unset
        "exact": bool(info.exact),
        "decodes": not info.encode_only,
        "server_version": info.server_version,
        "execution_plan": info.execution_plan,
        "determinism": {"batch_invariant": info.determinism.batch_invariant,
                        "decode_batch_invariant": info.determinism.decode_batch_invariant,
                        "summary": info.determinism.summary},
    }


def _unwrap(response, field: str) -> np.ndarray:
    if response.HasField("error") and response.error.code:
        raise ServerError(response.error.code, response.error.message)
    if field == "images" and response.WhichOneof("pixels") == "encoded":
        return codec.decode_images(list(response.encoded.images), "response", 1 << 62)
    return tensor_array(getattr(response, field))


def _setup_client(client, channels, target: str, token, tls_ca, tls: bool, timeout,
                  max_message_mb: int, batch_size: int | None) -> None:
    """What both clients hold: a channel from ``channels`` (``grpc`` or ``grpc.aio``), the
    stub, the auth metadata, the deadline rule and the (lazily asked) server limits."""
    creds = _credentials(tls_ca, tls)
    options = _channel_args(max_message_mb)
    client.channel = (channels.secure_channel(target, creds, options) if creds
                      else channels.insecure_channel(target, options))
    client.stub = pb_grpc.TokenizerStub(client.channel)
    client.metadata = _metadata(token)
    client.timeout = check_timeout(timeout)
    client.max_message_mb = max_message_mb
    client._batch_size = batch_size
    client._limits = None
    client._info = None


# ---- the blocking client -----------------------------------------------------------------
class TokenizerClient:
    """Blocking client. ``token``: bearer token; ``tls_ca``: CA/cert file (turns TLS on);
    ``timeout``: ``"auto"`` (scaled by pixels), seconds per call, or None (no deadline);
    ``batch_size``: most images per call (default and ceiling: the server's max_batch_size)."""

    def __init__(self, target: str, token: str | None = None, tls_ca=None, tls: bool = False,
                 timeout: Timeout = AUTO, max_message_mb: int = 64, batch_size: int | None = None):
        _setup_client(self, grpc, target, token, tls_ca, tls, timeout, max_message_mb, batch_size)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TokenizerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- info ---------------------------------------------------------------------------
    def model_info(self) -> dict:
        timeout = INFO_TIMEOUT_S if self.timeout == AUTO else self.timeout
        info = _info_dict(
            self.stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata
            )
        )
        self._info = info
        return info

    def limits(self) -> Limits:
        """The server's limits, asked once (GetModelInfo) and kept."""
        if self._limits is None:
            self._limits = Limits.from_info(
                self._info or self.model_info(), self._batch_size, self.max_message_mb
            )
        return self._limits

    @property
    def batch_size(self) -> int:
        return self.limits().max_items

    def preprocess(
        self, size: int = 0, keep_size: bool = False, resample: str = "bicubic"
    ) -> imagelib.Preprocess:
        """The preprocessing for this server's model (its factor), as ``vqserve tokenize``."""
        self.limits()
        return preprocess_for(self._info, size, keep_size, resample)

    def wait_ready(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    # ---- one request ----------------------------------------------------------------------
    def encode_batch(self, images: np.ndarray, timeout: float | None = None) -> np.ndarray:
        """One Encode call: uint8 ``[B,H,W,3]`` -> indices ``[B,h,w]``."""
        images = np.asarray(images)
        seconds = timeout or call_deadline(self.timeout, int(np.prod(images.shape[:3])))
        response = self.stub.Encode(
            pb.EncodeRequest(images=tensor_msg(images)), timeout=seconds, metadata=self.metadata
        )
        return tensor_array(response.indices)

    def encode_encoded(self, blobs: Sequence[bytes]) -> np.ndarray:
        """One Encode call with PNG/JPEG bytes (all of one size) -> indices ``[B,h,w]``.
        The server decodes them (no resizing): prefer :meth:`encode_files`."""
        seconds = call_deadline(self.timeout, sum(header_pixels(b) for b in blobs))
        response = self.stub.Encode(
            pb.EncodeRequest(encoded=pb.EncodedImages(images=list(blobs))),
            timeout=seconds,
            metadata=self.metadata,
        )
        return tensor_array(response.indices)

    def decode_batch(
        self, indices: np.ndarray, png: bool = False, timeout: float | None = None
    ) -> np.ndarray:
        """One Decode call: indices ``[B,h,w]`` -> uint8 ``[B,H,W,3]``."""
        indices = np.asarray(indices)
        fmt = pb.IMAGE_FORMAT_PNG if png else pb.IMAGE_FORMAT_RAW
        seconds = timeout or self._decode_deadline(indices.shape)
        response = self.stub.Decode(
            pb.DecodeRequest(indices=tensor_msg(indices), output_format=fmt),
            timeout=seconds,
            metadata=self.metadata,
        )
        return _unwrap(response, "images")

    def _decode_deadline(self, shape: Sequence[int], calls: int = 1) -> float | None:
        if self.timeout != AUTO:
            return call_deadline(self.timeout, 0, calls)
        return call_deadline(
            self.timeout, len(shape) and shape[0] * grid_pixels(shape, self.limits().factor), calls
        )

    # ---- any size: split and pipelined over a stream -----------------------------------------
    def encode(self, images: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        images = np.asarray(images)
        parts = array_parts(images, self.limits(), int(np.prod(images.shape[1:3])), batch_size)
        if len(parts) == 1:
            return self.encode_batch(parts[0])
        seconds = call_deadline(self.timeout, int(np.prod(images.shape[:3])), len(parts))
        return np.concatenate(list(self.encode_stream(parts, timeout=seconds)))

    def decode(self, indices: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        indices = np.asarray(indices)
        per_item = grid_pixels(indices.shape, self.limits().factor)
        parts = array_parts(indices, self.limits(), per_item, batch_size)
        if len(parts) == 1:
            return self.decode_batch(parts[0])
        seconds = self._decode_deadline(indices.shape, len(parts))
        return np.concatenate(list(self.decode_stream(parts, timeout=seconds)))

    def encode_stream(
        self, batches: Iterable[np.ndarray], timeout: float | None = None
    ) -> Iterator[np.ndarray]:
        """Each uint8 batch -> its indices, in order, over one EncodeStream."""
        requests = (
            pb.EncodeRequest(images=tensor_msg(b), request_id=str(i)) for i, b in enumerate(batches)
        )
        for response in self.stub.EncodeStream(requests, timeout=timeout, metadata=self.metadata):
            yield _unwrap(response, "indices")

    def decode_stream(
        self, batches: Iterable[np.ndarray], timeout: float | None = None
    ) -> Iterator[np.ndarray]:
        requests = (
            pb.DecodeRequest(indices=tensor_msg(b), request_id=str(i))
            for i, b in enumerate(batches)
        )
        for response in self.stub.DecodeStream(requests, timeout=timeout, metadata=self.metadata):
            yield _unwrap(response, "images")

    # ---- tagged items of any sizes: grouped, batched, failures per item ---------------------
    def encode_items(
        self, items: Iterable[Item | Outcome], batch_size: int | None = None
    ) -> Iterator[Outcome]:
        """Images of any sizes -> one :class:`Outcome` per item, in completion order. Items
        are grouped by size into calls within the server's limits; a failed call becomes
        failed outcomes (a multi-image call that fails is retried image by image).
        Outcomes passed in (already failed) pass through. Raises ``grpc.RpcError`` only
        when no call can succeed (UNAVAILABLE, UNAUTHENTICATED, ...)."""
        yield from self._run(items, self.encode_batch, encode_pixels, batch_size)

    def decode_items(
        self, items: Iterable[Item | Outcome], batch_size: int | None = None
    ) -> Iterator[Outcome]:
        """Token grids of any sizes -> one :class:`Outcome` (uint8 pixels) per item; as
        :meth:`encode_items`."""
        yield from self._run(
            items, self.decode_batch, decode_pixels(self.limits().factor), batch_size
        )

    def _run(self, items, call, pixels, batch_size) -> Iterator[Outcome]:
        lim = self.limits()
        buckets = Buckets(
            min(batch_size, lim.max_items) if batch_size else lim.max_items, lim.call_bytes, pixels
        )
        for x in prefetch(items, lim.max_items):
            if isinstance(x, Outcome):
                yield x
                continue
            for batch in buckets.add(x):
                yield from self._send(batch, call, pixels)
        for batch in buckets.flush():
            yield from self._send(batch, call, pixels)

    def _send(self, batch: list[Item], call, pixels) -> Iterator[Outcome]:
        todo = deque([batch])
        while todo:
            b = todo.popleft()
            n_px = batch_pixels(b, pixels)
            seconds = call_deadline(self.timeout, n_px)
            try:
                out = call(np.stack([it.array for it in b]), timeout=seconds)
            except grpc.RpcError as exc:
                retry, failed = after_failure(b, exc, self.timeout, seconds, n_px)
                todo.extendleft(reversed(retry))
                yield from failed
            else:
                yield from succeeded(b, out)

    # ---- files -------------------------------------------------------------------------------
    def iter_encode_files(
        self,
        paths: Sequence[str | os.PathLike],
        preprocess: imagelib.Preprocess | None = None,
        *,
        size: int = 0,
        keep_size: bool = False,
        batch_size: int | None = None,
    ) -> Iterator[Outcome]:
        """Image files -> one :class:`Outcome` per file (``tag`` a :class:`FileTag`), in
        completion order; a bad file is a failed outcome and the rest go on. Files are
        preprocessed here as ``vqserve tokenize`` does (``size``/``keep_size`` or a
        ``preprocess``) and sent as raw pixels."""
        pre = preprocess or self.preprocess(size, keep_size)
        yield from self.encode_items(
            prepared_items(paths, pre, self.limits().max_pixels), batch_size
        )

    def encode_files(
        self,
        paths: Sequence[str | os.PathLike],
        batch_size: int | None = None,
        *,
        size: int = 0,
        keep_size: bool = False,
    ) -> list[np.ndarray]:
        """Image files -> one ``[h,w]`` index array per file, in order. Raises
        :class:`FileError` naming the first file that failed."""
        outcomes = self.iter_encode_files(
            paths, size=size, keep_size=keep_size, batch_size=batch_size
        )
        return file_results(outcomes, len(paths))


# ---- the asyncio client ------------------------------------------------------------------
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
        factor = (await self.limits()).factor
        return call_deadline(self.timeout, len(shape) and shape[0] * grid_pixels(shape, factor), calls)

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
        parts = array_parts(indices, lim, grid_pixels(indices.shape, lim.factor), batch_size)
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
        factor = (await self.limits()).factor
        async for o in self._run(items, self.decode_batch, decode_pixels(factor), batch_size):
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
