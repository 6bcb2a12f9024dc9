"""Python clients for vqserve.v1.Tokenizer, with batching helpers.

    from vqserve.serve.client import TokenizerClient
    with TokenizerClient("127.0.0.1:50051") as client:
        indices = client.encode(images)          # uint8 [N,H,W,3], any N: split and pipelined
        images2 = client.decode(indices)

Large arrays are split into chunks of at most the server's ``max_batch_size`` and sent
over one bidirectional stream, so many chunks are in flight at once and the server can
batch them. ``AsyncTokenizerClient`` is the same for asyncio code.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np

from vqserve.serve import codec
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc


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


def chunks(array: np.ndarray, size: int) -> list[np.ndarray]:
    """Split along axis 0 into pieces of at most ``size``."""
    return [array[i: i + size] for i in range(0, len(array), size)]


def _info_dict(info: pb.ModelInfo) -> dict:
    return {
        "quantizer": info.quantizer, "codebook_size": info.codebook_size, "levels": list(info.levels),
        "factor": info.factor, "codes_per_position": info.codes_per_position,
        "index_dtype": info.index_dtype, "accepted_sizes": info.accepted_sizes,
        "max_pixels": info.max_pixels, "max_batch_size": info.max_batch_size, "dtype": info.dtype,
        "backend": info.backend, "device": info.device, "model_hash": info.model_hash,
        "server_version": info.server_version,
    }


def _unwrap(response, field: str) -> np.ndarray:
    if response.HasField("error") and response.error.code:
        raise ServerError(response.error.code, response.error.message)
    if field == "images" and response.WhichOneof("pixels") == "encoded":
        return codec.decode_images(list(response.encoded.images), "response", 1 << 62)
    return tensor_array(getattr(response, field))


class TokenizerClient:
    """Blocking client. ``token``: bearer token; ``tls_ca``: CA/cert file (turns TLS on)."""

    def __init__(self, target: str, token: str | None = None, tls_ca=None, tls: bool = False,
                 timeout: float | None = 60.0, max_message_mb: int = 64, batch_size: int | None = None):
        creds = _credentials(tls_ca, tls)
        options = _channel_args(max_message_mb)
        self.channel = (grpc.secure_channel(target, creds, options) if creds
                        else grpc.insecure_channel(target, options))
        self.stub = pb_grpc.TokenizerStub(self.channel)
        self.metadata = _metadata(token)
        self.timeout = timeout
        self._batch_size = batch_size

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TokenizerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- info ---------------------------------------------------------------------------
    def model_info(self) -> dict:
        return _info_dict(self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout,
                                                 metadata=self.metadata))

    @property
    def batch_size(self) -> int:
        if self._batch_size is None:
            self._batch_size = int(self.model_info()["max_batch_size"]) or 32
        return self._batch_size

    def wait_ready(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    # ---- one request ----------------------------------------------------------------------
    def encode_batch(self, images: np.ndarray) -> np.ndarray:
        """One Encode call: uint8 ``[B,H,W,3]`` -> indices ``[B,h,w]``."""
        response = self.stub.Encode(pb.EncodeRequest(images=tensor_msg(images)),
                                    timeout=self.timeout, metadata=self.metadata)
        return tensor_array(response.indices)

    def encode_encoded(self, blobs: Sequence[bytes]) -> np.ndarray:
        """One Encode call with PNG/JPEG bytes (all of one size) -> indices ``[B,h,w]``."""
        response = self.stub.Encode(pb.EncodeRequest(encoded=pb.EncodedImages(images=list(blobs))),
                                    timeout=self.timeout, metadata=self.metadata)
        return tensor_array(response.indices)

    def decode_batch(self, indices: np.ndarray, png: bool = False) -> np.ndarray:
        """One Decode call: indices ``[B,h,w]`` -> uint8 ``[B,H,W,3]``."""
        fmt = pb.IMAGE_FORMAT_PNG if png else pb.IMAGE_FORMAT_RAW
        response = self.stub.Decode(pb.DecodeRequest(indices=tensor_msg(indices), output_format=fmt),
                                    timeout=self.timeout, metadata=self.metadata)
        return _unwrap(response, "images")

    # ---- any size: split and pipelined over a stream -----------------------------------------
    def encode(self, images: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        parts = chunks(np.asarray(images), batch_size or self.batch_size)
        if len(parts) == 1:
            return self.encode_batch(parts[0])
        return np.concatenate(list(self.encode_stream(parts)))

    def decode(self, indices: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        parts = chunks(np.asarray(indices), batch_size or self.batch_size)
        if len(parts) == 1:
            return self.decode_batch(parts[0])
        return np.concatenate(list(self.decode_stream(parts)))

    def encode_stream(self, batches: Iterable[np.ndarray], timeout: float | None = None) -> Iterator[np.ndarray]:
        """Each uint8 batch -> its indices, in order, over one EncodeStream."""
        requests = (pb.EncodeRequest(images=tensor_msg(b), request_id=str(i)) for i, b in enumerate(batches))
        for response in self.stub.EncodeStream(requests, timeout=timeout, metadata=self.metadata):
            yield _unwrap(response, "indices")

    def decode_stream(self, batches: Iterable[np.ndarray], timeout: float | None = None) -> Iterator[np.ndarray]:
        requests = (pb.DecodeRequest(indices=tensor_msg(b), request_id=str(i)) for i, b in enumerate(batches))
        for response in self.stub.DecodeStream(requests, timeout=timeout, metadata=self.metadata):
            yield _unwrap(response, "images")

    def encode_files(self, paths: Sequence[str | os.PathLike], batch_size: int | None = None) -> list[np.ndarray]:
        """Image files -> one ``[h,w]`` index array per file. Files are sent as their own
        PNG/JPEG bytes (other formats are converted to PNG first), batched by size."""
        size = batch_size or self.batch_size
        blobs, shapes = [], []
        for p in paths:
            data = Path(p).read_bytes()
            if not (data.startswith(b"\x89PNG") or data.startswith(b"\xff\xd8")):
                data = codec.encode_png(codec.read_image_file(p)[None])[0]
            blobs.append(data)
            shapes.append(_image_size(data))
        results: list[np.ndarray | None] = [None] * len(blobs)
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(shapes):
            groups.setdefault(s, []).append(i)
        for members in groups.values():
            for start in range(0, len(members), size):
                idx = members[start: start + size]
                out = self.encode_encoded([blobs[i] for i in idx])
                for j, i in enumerate(idx):
                    results[i] = out[j]
        return results


def _image_size(blob: bytes) -> tuple[int, int]:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(blob)) as img:
        return img.size


class AsyncTokenizerClient:
    """asyncio client over ``grpc.aio`` (same calls, awaitable)."""

    def __init__(self, target: str, token: str | None = None, tls_ca=None, tls: bool = False,
                 timeout: float | None = 60.0, max_message_mb: int = 64):
        creds = _credentials(tls_ca, tls)
        options = _channel_args(max_message_mb)
        self.channel = (grpc.aio.secure_channel(target, creds, options) if creds
                        else grpc.aio.insecure_channel(target, options))
        self.stub = pb_grpc.TokenizerStub(self.channel)
        self.metadata = _metadata(token)
        self.timeout = timeout

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncTokenizerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def model_info(self) -> dict:
        return _info_dict(await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout,
                                                       metadata=self.metadata))

    async def encode(self, images: np.ndarray) -> np.ndarray:
        response = await self.stub.Encode(pb.EncodeRequest(images=tensor_msg(images)),
                                          timeout=self.timeout, metadata=self.metadata)
        return tensor_array(response.indices)

    async def decode(self, indices: np.ndarray) -> np.ndarray:
        response = await self.stub.Decode(pb.DecodeRequest(indices=tensor_msg(indices)),
                                          timeout=self.timeout, metadata=self.metadata)
        return tensor_array(response.images)

    async def encode_stream(self, batches: Iterable[np.ndarray]) -> AsyncIterator[np.ndarray]:
        requests = [pb.EncodeRequest(images=tensor_msg(b), request_id=str(i)) for i, b in enumerate(batches)]
        async for response in self.stub.EncodeStream(iter(requests), metadata=self.metadata):
            yield _unwrap(response, "indices")
