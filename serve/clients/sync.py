"""The blocking Python client of vqserve.v1.Tokenizer.

    from vqserve.serve.clients.sync import TokenizerClient
    with TokenizerClient("127.0.0.1:50051") as client:
        indices = client.encode(images)          # uint8 [N,H,W,3], any N: split and pipelined
        images2 = client.decode(indices)
        tokens = client.encode_files(["a.png", "b.jpg"], size=256)

Large arrays are split into calls of at most the server's ``max_batch_size`` images (asked
once with GetModelInfo) and at most ``CALL_BYTES`` of pixels, and sent over one
bidirectional stream, so many calls are in flight at once and the server can batch them.
``AsyncTokenizerClient`` (:mod:`vqserve.serve.clients.aio`) does the same for asyncio code: both
clients share how work is cut into calls (:mod:`vqserve.serve.clients.batches`) and what they
send and hold (:mod:`vqserve.serve.clients.channel`), and differ only in how they wait for the
network.

Files (:meth:`TokenizerClient.iter_encode_files`) are read and preprocessed here by the
one shared function (``vqserve.core.images.prepare``) and sent as raw uint8 pixels, so the
server sees exactly the pixels ``vqserve tokenize`` would encode: same file, same tokens.

Deadlines: ``timeout="auto"`` (the default) gives each call ``scaled_timeout`` of its
pixels, so a call with 32 one-megapixel photos is not held to a deadline meant for one
thumbnail; a number is a fixed deadline per call; ``None`` waits forever.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

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
    header_pixels,
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
            self.timeout, len(shape) and shape[0] * grid_pixels(shape, self.limits().tokens), calls
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
        per_item = grid_pixels(indices.shape, self.limits().tokens)
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
            items, self.decode_batch, decode_pixels(self.limits().tokens), batch_size
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
