"""What both Python clients share: the gRPC channel they open (TLS credentials, message-size
limits), the bearer-token metadata, arrays as ``Tensor`` messages (:func:`tensor_msg`,
:func:`tensor_array`), the error a stream message answers with (:class:`ServerError`), the
model-info dict, and the health check. Kept apart so that :mod:`~vqserve.serve.clients.sync`
and :mod:`~vqserve.serve.clients.aio` differ only in how they wait for the network.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import numpy as np

from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve._proto import tokenizer_pb2_grpc as pb_grpc
from vqserve.serve.api import codec
from vqserve.serve.clients.batches import check_timeout

INFO_TIMEOUT_S = 30.0  # GetModelInfo: tiny, but the server may still be loading


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
    return health_detail(target, service, timeout, tls_ca, tls)[0]


def health_detail(target: str, service: str = "", timeout: float = 5.0, tls_ca=None,
                  tls: bool = False) -> tuple[str, str | None]:
    """:func:`check_health`'s status, and what the server says it is doing while it is not
    yet serving (loading, the start-up check: how far, the time left, how to skip it), or None."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    creds = _credentials(tls_ca, tls)
    channel = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
    with channel:
        reply, call = health_pb2_grpc.HealthStub(channel).Check.with_call(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    step = next((value for key, value in (call.trailing_metadata() or ()) if key == "vqserve-step"), None)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), step


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
        # only for a non-grid layout (a pyramid's scales), as RuntimeInfo.identity() has it
        **({"token_layout": _layout_dict(info.token_layout)} if info.HasField("token_layout") else {}),
    }


def _layout_dict(layout: pb.TokenLayout) -> dict:
    """``TokenLayout.to_dict()`` from its message (vqserve.core.token_layout)."""
    if layout.kind == "sequence":
        return {"kind": layout.kind, "length": layout.length, "size": list(layout.size)}
    if layout.kind == "video":
        return {"kind": layout.kind, "temporal_factor": layout.temporal_factor, "chunk_frames": layout.chunk_frames,
                "pad": layout.pad, "frame_rule": layout.frame_rule}
    return {"kind": layout.kind, "schedules": [[[h, w] for h, w in zip(s.heights, s.widths, strict=True)]
                                               for s in layout.schedules]}


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
