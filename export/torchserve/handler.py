"""TorchServe handler: vqserve's Runtime behind TorchServe's own batching.

``vqserve export --format torchserve`` copies this file into two model archives
(``vqserve-encode.mar``, ``vqserve-decode.mar``). TorchServe imports it in its Python worker
as a top-level module, so it uses absolute imports only; it imports the installed
``vqserve`` (model and export layers, never ``vqserve.serve``) and opens the model the
archive carries with :func:`vqserve.export.runtimes.loader.load_runtime` - the same tokens, the
same fp32 quantizer island and the same input rules as ``vqserve serve``.

One request is one item (TorchServe sends a list of them per batch):

* ``encode``: the body is one image, PNG or JPEG bytes (decoded by the rules of
  ``vqserve.core.images.load_rgb``: EXIF orientation applied, alpha over white, 16-bit
  scaled by 1/257, grayscale/palette/CMYK to RGB, no resizing), or an ``.npy`` of uint8
  ``[H,W,3]``. The response is an ``.npy`` of indices ``[H/f,W/f]`` in the model's index
  dtype, or JSON with ``output=json``.
* ``decode``: the body is an ``.npy`` of integer indices ``[h,w]`` (``[h,w,Q]`` for residual
  quantizers). The response is PNG bytes, or an ``.npy`` of uint8 ``[h*f,w*f,3]`` with
  ``output=npy``.

``output`` is chosen per request with the ``X-Vqserve-Output`` header (REST) or an
``output`` entry of the ``input`` map (gRPC). Requests of one TorchServe batch that share a
shape run in one runtime call; every request gets its own response, in order. A request
that breaks a rule gets a JSON body naming the rule (``{"code": 400, "type": ..., "message": ...}``) and,
over REST, status 400 - without failing its batch-mates. (TorchServe 0.12's gRPC
``Predictions`` drops per-request status codes: a gRPC caller sees that JSON body with
status OK, told apart from a result by its first byte, ``{``.)
Every response carries ``x-vqserve-batch-size`` (requests in the TorchServe batch) and
``x-vqserve-group-size`` (rows in the runtime call that produced it) headers.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vqserve.core.input_rules import image_size_rule, index_grid_rule, index_range_rule

logger = logging.getLogger(__name__)

HANDLER_CONFIG = "vqserve_handler.json"  # written by vqserve.export.torchserve.archives
MODEL_SUBDIR = "model"                   # the checkpoint or artifact inside the archive
MODES = ("encode", "decode")
OUTPUTS = {"encode": ("npy", "json"), "decode": ("png", "npy")}
IMAGE_FORMATS = ("PNG", "JPEG")
NPY_MAGIC = b"\x93NUMPY"
NPY_TYPE = "application/x-npy"
BATCH_HEADER = "x-vqserve-batch-size"
GROUP_HEADER = "x-vqserve-group-size"
BODY_KEYS = ("body", "data")
PHRASES = {200: "OK", 400: "Bad Request", 500: "Internal Server Error"}


class BadRequest(ValueError):
    """The request breaks an input rule; only this request fails (HTTP 400)."""

    status = 400


@dataclass
class Reply:
    """One response of a batch: body, content type and HTTP status."""

    body: bytes
    content_type: str
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


def error_reply(status: int, kind: str, message: str) -> Reply:
    body = json.dumps({"code": status, "type": kind, "message": message}).encode()
    return Reply(body, "application/json", status)


# ---- request bodies ----------------------------------------------------------------------
def _as_bytes(value) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    raise BadRequest(f"body must be bytes, got {type(value).__name__} (send Content-Type: "
                     "application/octet-stream)")


def read_body(request: dict) -> bytes:
    """The payload of one TorchServe request: ``body`` (REST) or ``data`` (REST form, gRPC)."""
    for key in BODY_KEYS:
        if request.get(key) is not None:
            body = _as_bytes(request[key])
            if not body:
                raise BadRequest("body is empty (0 bytes)")
            return body
    raise BadRequest(f"request has no body; send the payload as the request body (REST) or as "
                     f"input['data'] (gRPC); got parameters {sorted(request)}")


def request_option(request: dict, headers: dict[str, str], name: str, allowed: Sequence[str],
                   default: str) -> str:
    """A small text option: a request parameter (``input['output']`` over gRPC, a multipart
    form field over REST) or the ``X-Vqserve-<Name>`` header (REST). TorchServe drops query
    parameters of requests that have a body, and does not forward gRPC metadata."""
    value = request.get(name)
    if value is None:
        value = headers.get(f"x-vqserve-{name}")
    if value is None:
        return default
    text = _as_bytes(value).decode("utf-8", "replace").strip().lower()
    if text not in allowed:
        raise BadRequest(f"{name} must be one of {', '.join(allowed)}, got {text!r}")
    return text


def lower_keys(headers) -> dict[str, str]:
    return {str(k).lower(): v for k, v in (headers or {}).items() if isinstance(v, str)}


def load_npy(blob: bytes, what: str) -> np.ndarray:
    """``.npy`` bytes -> array. The header is checked against the bytes that follow before
    numpy allocates anything: ``np.load`` on a stream preallocates what the header claims,
    so a 100-byte body must not be able to ask for gigabytes. Pickles are refused."""
    fmt = np.lib.format
    stream = io.BytesIO(blob)
    try:
        version = fmt.read_magic(stream)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, _, dtype = fmt.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy version {version}")
        if dtype.hasobject:
            raise ValueError("object arrays (pickles) are not accepted")
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        have = len(blob) - stream.tell()
        if need != have:
            raise ValueError(f"header says {list(shape)} {dtype.name} ({need} bytes) "
                             f"but {have} bytes follow")
        return np.load(io.BytesIO(blob), allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError / EOFError / OSError for bad data
        raise BadRequest(f"{what} is not a readable .npy array ({type(exc).__name__}: {exc})") from None


def load_image(blob: bytes, max_pixels: int) -> np.ndarray:
    """PNG/JPEG bytes -> uint8 ``[H,W,3]`` as displayed, by vqserve's one preprocessing
    function (``vqserve.core.images``, shared with the server and the batch CLI); the pixel limit
    is checked from the header, before any pixel is decoded."""
    from vqserve.core.images import ImageError, load_rgb

    try:
        return load_rgb(blob, formats=IMAGE_FORMATS, max_pixels=max_pixels)
    except ImageError as exc:
        raise BadRequest(f"image {exc}") from None


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), "RGB").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


# ---- the service -------------------------------------------------------------------------
@dataclass
class Item:
    """One parsed request waiting for its runtime call."""

    index: int
    array: np.ndarray
    output: str


class TokenizerService:
    """Parses, checks, groups by shape, runs the runtime, formats replies.

    Written against the Runtime interface only, so it runs (and is tested) without TorchServe.
    """

    def __init__(self, runtime, mode: str, max_pixels: int | None = None,
                 default_output: str | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.runtime = runtime
        self.info = runtime.info
        self.mode = mode
        self.max_pixels = int(max_pixels or self.info.max_pixels)
        self.default_output = default_output or OUTPUTS[mode][0]
        if self.default_output not in OUTPUTS[mode]:
            raise ValueError(f"{mode} output must be one of {OUTPUTS[mode]}, got {self.default_output!r}")
        self.index_dtype = np.dtype(self.info.index_dtype)

    # -- input rules (the messages match vqserve serve's) --
    def check_image(self, image: np.ndarray) -> np.ndarray:
        """One image's rules, worded as ``vqserve serve`` words them (core/input_rules.py)."""
        if image.dtype != np.uint8:
            raise BadRequest(f"images must be uint8, got {image.dtype.name}")
        if image.ndim != 3 or image.shape[-1] != 3:
            raise BadRequest(f"image must be [H,W,3] (uint8 HWC RGB), got {list(image.shape)}")
        if rule := (image_size_rule(*image.shape[:2], self.info.factor, self.max_pixels)
                    or self.info.layout.size_rule(*image.shape[:2])):  # a pyramid takes fixed sizes
            raise BadRequest(rule)
        return np.ascontiguousarray(image)

    def check_indices(self, indices: np.ndarray) -> np.ndarray:
        """One image's tokens' rules (a grid, or a pyramid's flat [L]); a decode never sees an
        out-of-range index."""
        q = self.info.codes_per_position
        expected = "[h,w]" if q == 1 else f"[h,w,{q}]"
        if indices.dtype.kind not in "iu":
            raise BadRequest(f"indices must be an integer type (preferably {self.index_dtype.name}), "
                             f"got {indices.dtype.name}")
        layout = self.info.layout
        if not layout.is_grid:
            if rule := layout.shape_rule((1, *indices.shape)):
                raise BadRequest(f"indices {rule}")
            size_rule = image_size_rule(*layout.image_size(indices.shape), layout.factor, self.max_pixels)
        else:
            if indices.ndim != (2 if q == 1 else 3) or (q > 1 and indices.shape[-1] != q):
                raise BadRequest(f"indices must be {expected}, got {list(indices.shape)}")
            size_rule = index_grid_rule(*indices.shape[:2], self.info.factor, self.max_pixels)
        for rule in (size_rule, index_range_rule(indices, self.info.codebook_size)):
            if rule:
                raise BadRequest(rule)
        return np.ascontiguousarray(indices)

    def parse(self, index: int, request: dict, headers: dict[str, str] | None = None) -> Item:
        """One TorchServe request -> a checked array (raises :class:`BadRequest`)."""
        if not isinstance(request, dict):
            raise BadRequest(f"request must be a parameter map, got {type(request).__name__}")
        output = request_option(request, lower_keys(headers), "output", OUTPUTS[self.mode],
                                self.default_output)
        body = read_body(request)
        if self.mode == "encode":
            if body.startswith(NPY_MAGIC):
                array = self.check_image(load_npy(body, "body"))
            else:
                array = self.check_image(load_image(body, self.max_pixels))
        else:
            if not body.startswith(NPY_MAGIC):
                raise BadRequest("decode takes an .npy array of integer indices [h,w] "
                                 "(numpy.save); the body is not .npy")
            array = self.check_indices(load_npy(body, "body"))
        return Item(index, array, output)

    def _reply(self, row: np.ndarray, output: str) -> Reply:
        if self.mode == "encode":
            row = row.astype(self.index_dtype, copy=False)
            if output == "json":
                return Reply(json.dumps({"indices": row.tolist(), "dtype": self.index_dtype.name}).encode(),
                             "application/json")
            return Reply(npy_bytes(row), NPY_TYPE)
        row = np.asarray(row, dtype=np.uint8)
        if output == "npy":
            return Reply(npy_bytes(row), NPY_TYPE)
        return Reply(png_bytes(row), "image/png")

    def _run(self, arrays: np.ndarray) -> np.ndarray:
        if self.mode == "encode":
            return np.asarray(self.runtime.encode(arrays))
        return np.asarray(self.runtime.decode(arrays.astype(self.index_dtype, copy=False)))

    def handle_batch(self, requests: Sequence[dict],
                     headers: Sequence[dict] | None = None) -> list[Reply]:
        """A TorchServe batch -> one reply per request, in order; same-shape requests share a
        runtime call, and a bad request or failed group never fails the others."""
        replies: list[Reply | None] = [None] * len(requests)
        groups: dict[tuple, list[Item]] = {}
        for i, request in enumerate(requests):
            try:
                item = self.parse(i, request, headers[i] if headers else None)
            except BadRequest as exc:
                replies[i] = error_reply(exc.status, "BadRequest", str(exc))
                continue
            groups.setdefault((item.array.shape, item.array.dtype.str), []).append(item)
        for (shape, _), items in groups.items():
            start = time.perf_counter()
            try:
                out = self._run(np.stack([it.array for it in items]))
            except ValueError as exc:  # the runtime's own input rules
                for it in items:
                    replies[it.index] = error_reply(400, "BadRequest", str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - one group's failure stays in that group
                logger.exception("vqserve %s failed for shape %s", self.mode, shape)
                for it in items:
                    replies[it.index] = error_reply(500, type(exc).__name__, str(exc))
                continue
            ms = (time.perf_counter() - start) * 1e3
            logger.info("vqserve %s batch=%d group=%d shape=%s %.1f ms", self.mode, len(requests),
                        len(items), list(shape), ms)
            for it, row in zip(items, out, strict=True):
                replies[it.index] = self._reply(row, it.output)
                replies[it.index].headers[GROUP_HEADER] = str(len(items))
        done = [r if r is not None else error_reply(500, "InternalError", "no reply") for r in replies]
        for r in done:
            r.headers[BATCH_HEADER] = str(len(requests))
        return done


# ---- TorchServe entry point --------------------------------------------------------------
def read_handler_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / HANDLER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: build the archive with "
                                "`vqserve export --format torchserve`")
    return json.loads(path.read_text())


def pick_device(requested: str, gpu_id) -> str:
    """TorchServe assigns ``gpu_id`` per worker; ``auto`` follows it, ``cpu`` ignores it."""
    import torch

    if requested == "auto":
        return f"cuda:{gpu_id}" if gpu_id is not None and torch.cuda.is_available() else "cpu"
    return requested


def service_from_model_dir(model_dir: str | os.PathLike, gpu_id=None) -> TokenizerService:
    """Open the archive's model the way its ``vqserve_handler.json`` says."""
    import vqserve
    from vqserve.export.runtimes.loader import load_runtime

    cfg = read_handler_config(model_dir)
    if cfg.get("vqserve_version") and cfg["vqserve_version"] != vqserve.__version__:
        logger.warning("archive built by vqserve %s, running vqserve %s", cfg["vqserve_version"],
                       vqserve.__version__)
    threads = int(cfg.get("threads") or 0)
    if threads:
        import torch

        torch.set_num_threads(threads)
    runtime = load_runtime(Path(model_dir) / MODEL_SUBDIR, backend=cfg.get("backend", "auto"),
                           dtype=cfg.get("dtype"), device=pick_device(cfg.get("device", "auto"), gpu_id))
    if cfg.get("model_hash") and runtime.info.model_hash != cfg["model_hash"]:
        raise ValueError(f"archive model hash {runtime.info.model_hash[:16]}... differs from "
                         f"the recorded {cfg['model_hash'][:16]}...; rebuild the archive")
    service = TokenizerService(runtime, cfg["mode"], cfg.get("max_pixels"), cfg.get("output"))
    logger.info("vqserve %s ready: %s %s on %s, factor %d, codebook %d", service.mode,
                runtime.info.backend, runtime.info.dtype, runtime.info.device, runtime.info.factor,
                runtime.info.codebook_size)
    return service


_service: TokenizerService | None = None


def _headers(context, index: int) -> dict:
    try:
        return context.get_all_request_header(index) or {}
    except (AttributeError, IndexError, TypeError):  # no request processor (direct calls)
        return {}


def handle(data, context):
    """TorchServe's entry point: ``handle(None, ctx)`` loads, ``handle(batch, ctx)`` serves."""
    global _service
    if _service is None:
        props = context.system_properties
        _service = service_from_model_dir(props["model_dir"], props.get("gpu_id"))
    if data is None:
        return None
    replies = _service.handle_batch(data, [_headers(context, i) for i in range(len(data))])
    for i, reply in enumerate(replies):
        context.set_response_status(reply.status, PHRASES.get(reply.status, "Error"), i)
        context.set_response_content_type(i, reply.content_type)
        for key, value in reply.headers.items():
            context.set_response_header(i, key, value)
    return [r.body for r in replies]
