"""The one serving path both protocols share: check input, batch, run, record.

``Engine`` validates arrays against the runtime's ``RuntimeInfo`` (every rule named in
its error), submits them to the :class:`Batcher`, and feeds the codebook-usage metrics.
It never runs a decode with an index outside the codebook, nor a batch whose answer could
not fit the gRPC message limit (``max_message_bytes``): that is known from the shapes alone.
PNG/JPEG requests go through :class:`ImageDecoder` first: count and sizes from the headers,
then decoding off the event loop under a decoded-bytes budget.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np

from vqserve.core.input_rules import (
    decode_unsupported,
    image_size_rule,
    index_grid_rule,
    index_range_rule,
)
from vqserve.core.token_layout import VIDEO, TokenLayout
from vqserve.core.video_frames import attention_rule, latent_windows
from vqserve.serve.api.decoding import ImageDecoder
from vqserve.serve.engine.batcher import Batcher
from vqserve.serve.error_codes import BadInput, ReplyTooLarge

# Bytes a response adds around a tensor's data: field tags, lengths, shape, dtype, names.
REPLY_OVERHEAD = 1024
# Peak bytes per pixel of one model call, measured with the default tokenizer on CPU
# (encode: ~250 in fp32, ~290 in bf16 with its fp32 residual stream; decode: ~150-180).
MIN_DECODED_BYTES = 256 << 20


def default_decoded_bytes(max_batch_size: int, max_pixels: int) -> int:
    """Room to decode a few largest requests at once (each image and its stacked copy)."""
    return max(MIN_DECODED_BYTES, 2 * max_batch_size * max_pixels * 3 * 2)


class Engine:
    def __init__(self, runtime, metrics, max_batch_size: int = 32, max_delay_s: float = 0.005,
                 max_queue: int = 1024, max_message_bytes: int | None = None,
                 max_batch_pixels: int | None = None, max_decoded_bytes: int | None = None,
                 decode_threads: int | None = None, max_pixels: int | None = None, batcher=None):
        """``max_message_bytes``: the gRPC send limit; None or <= 0 checks no reply size.
        ``max_batch_pixels``: pixels per model call (None: no limit; images for encode,
        output pixels for decode). ``max_decoded_bytes``: memory for decoded PNG/JPEG
        images in flight (None: :func:`default_decoded_bytes`). ``max_pixels``: per image,
        replacing the runtime's own limit (both APIs and GetModelInfo read ``self.info``).
        ``batcher``: where checked requests go instead of a local :class:`Batcher` over
        ``runtime`` (a front-end process: the executor's, through ``serve/split/frontend.py``);
        ``runtime`` then only needs its ``info``."""
        self.runtime = runtime
        self.adopt_info(runtime.info if not max_pixels else dataclasses.replace(runtime.info, max_pixels=max_pixels))
        self.metrics = metrics
        self.index_dtype = np.dtype(self.info.index_dtype)
        self.max_batch_size = max_batch_size
        self.max_message_bytes = max_message_bytes if max_message_bytes and max_message_bytes > 0 else None
        self.max_batch_pixels = max_batch_pixels
        self._batching = {"max_batch_size": max_batch_size, "max_delay_s": max_delay_s, "max_queue": max_queue}
        self.batcher = batcher if batcher is not None else self._batcher_for(runtime)
        # a local model may write to its input (torch warns on read-only buffers); a remote
        # batcher copies the request into shared memory anyway, so a second copy would be waste
        self._requirements = ["C"] if batcher is not None else ["C", "W"]
        self.determinism = None  # the start-up batch-invariance Certificate, set by the server
        self.decoder = ImageDecoder(
            max_decoded_bytes or default_decoded_bytes(max_batch_size, self.info.max_pixels),
            decode_threads)
        metrics.set_codebook(self.info.codebook_size)

    def _batcher_for(self, runtime) -> Batcher:
        if self.max_batch_pixels and hasattr(runtime, "limit_call_pixels"):  # a PlannedRuntime
            runtime.limit_call_pixels(self.max_batch_pixels, self._pixels_per_item)
        return Batcher(runtime, observer=self.metrics.observe_batch, max_batch_pixels=self.max_batch_pixels,
                       pixels_per_item=self._pixels_per_item, **self._batching)

    def adopt_info(self, info) -> None:
        """The served model's facts, at start and after every plan switch: ``info``, the
        ``identity`` every answer carries (which tokens these are), and the token layout as
        the OIP parameter writes it (serialised once here, not per reply)."""
        self.info = info
        self.identity = info.identity()
        self.token_layout_json = json.dumps(info.token_layout, separators=(",", ":")) if info.token_layout else ""

    async def use_runtime(self, runtime, determinism=None) -> None:
        """Run every call from now on by ``runtime`` (a measured plan replacing the safe one).
        Only for a runtime that gives the same tokens and pixels as the one it replaces: the
        switch happens between calls, requests already queued finish on the old runtime, and
        a request never sees both. ``info`` keeps the server's limits (``max_pixels``)."""
        old_batcher, old_runtime = self.batcher, self.runtime
        self.batcher = self._batcher_for(runtime)
        self.batcher.start()
        self.runtime = runtime
        self.adopt_info(dataclasses.replace(runtime.info, max_pixels=self.info.max_pixels))
        self.determinism = determinism
        await old_batcher.close()  # what it had queued runs to the end; it takes nothing new
        if hasattr(old_runtime, "close"):
            old_runtime.close()

    async def close(self) -> None:
        """Run what is queued, then stop the model and decoding threads."""
        await self.batcher.close()
        self.decoder.close()
        if hasattr(self.runtime, "close"):  # a PlannedRuntime's model threads
            self.runtime.close()

    @property
    def layout(self) -> TokenLayout:
        """The per-image token shape rule of the served model (grid or pyramid)."""
        return self.info.layout

    @property
    def size_rule(self) -> str:
        f = self.info.factor
        rule = (f"H and W positive multiples of {f}, H*W at most {self.info.max_pixels} pixels, "
                f"at most {self.max_batch_size} images per request")
        if not self.layout.is_grid:
            rule += f"; tokens {self.layout.describe()}"
        if self.max_batch_pixels:
            rule += f"; the model runs at most {self.max_batch_pixels} pixels per call"
        return rule

    def _pixels_per_item(self, method: str, item_shape: tuple[int, ...]) -> int:
        """Encode: H*W of an image (T*H*W of a clip); decode: the pixels it will produce (h*w*f^2)."""
        video = self.layout.kind == VIDEO
        if method == "decode":
            h, w = self.layout.image_size(item_shape)
            return h * w * (self.layout.frames_of(item_shape[0]) if video else 1)
        if video:
            return int(np.prod(item_shape[:3]))
        h, w = item_shape[:2]
        return h * w

    # ---- checks -----------------------------------------------------------------------
    def _check_batch(self, b: int, field: str) -> None:
        if b == 0:
            raise BadInput(field, "is an empty batch (B=0); send at least one item")
        if b > self.max_batch_size:
            raise BadInput(field, f"batch of {b} exceeds max-batch-size {self.max_batch_size}; "
                                  "split it (the Python client does)")

    def check_images(self, images: np.ndarray, field: str = "images") -> np.ndarray:
        if images.dtype != np.uint8:
            raise BadInput(f"{field}.dtype", f"must be uint8, got {images.dtype.name}")
        if self.layout.kind == VIDEO:
            return self.check_clips(images, field)
        if images.ndim != 4 or images.shape[-1] != 3:
            raise BadInput(f"{field}.shape", f"must be [B,H,W,3] (uint8 NHWC RGB), got {list(images.shape)}")
        b, h, w, _ = images.shape
        self._check_batch(b, field)
        if rule := image_size_rule(h, w, self.info.factor, self.info.max_pixels) or self.layout.size_rule(h, w):
            raise BadInput(f"{field}.shape", rule)
        return images

    def check_clips(self, clips: np.ndarray, field: str) -> np.ndarray:
        """A video model's input: uint8 ``[B,T,H,W,3]``, on the layout's frame rule (or covered
        by its chunk/pad policy), frames within max-pixels, the attention within bounds."""
        if clips.ndim != 5 or clips.shape[-1] != 3:
            raise BadInput(f"{field}.shape", f"must be [B,T,H,W,3] (uint8 RGB clips) for this video model, "
                                             f"got {list(clips.shape)}")
        b, t, h, w, _ = clips.shape
        self._check_batch(b, field)
        if h * w > self.info.max_pixels:
            raise BadInput(f"{field}.shape", f"{h}x{w} = {h * w} pixels per frame exceeds the limit {self.info.max_pixels}")
        try:
            plan = self.layout.plan(t, h, w)
        except ValueError as exc:
            raise BadInput(f"{field}.shape", str(exc)) from None
        if rule := attention_rule(max(plan.window_latent), *plan.latent[1:]):
            raise BadInput(f"{field}.shape", rule)
        return clips

    def check_indices(self, indices: np.ndarray, field: str = "indices") -> np.ndarray:
        if indices.dtype.kind not in "iu":
            raise BadInput(f"{field}.dtype", f"must be an integer type (preferably {self.index_dtype.name}), "
                                             f"got {indices.dtype.name}")
        layout = self.layout
        if rule := layout.shape_rule(tuple(indices.shape)):
            raise BadInput(f"{field}.shape", rule)
        self._check_batch(indices.shape[0], field)
        if layout.is_grid:
            if rule := index_grid_rule(indices.shape[1], indices.shape[2], self.info.factor, self.info.max_pixels):
                raise BadInput(f"{field}.shape", rule)
        else:
            h, w = layout.image_size(indices.shape[1:])
            if rule := image_size_rule(h, w, self.info.factor, self.info.max_pixels):
                raise BadInput(f"{field}.shape", f"{list(indices.shape)} decodes to {rule}")
            if layout.kind == VIDEO:
                windows = latent_windows(indices.shape[1], temporal_factor=layout.temporal_factor,
                                         chunk_frames=layout.chunk_frames)
                if rule := attention_rule(max(e - s for s, e in windows), *indices.shape[2:4]):
                    raise BadInput(f"{field}.shape", rule)
        if rule := index_range_rule(indices, self.info.codebook_size):
            raise BadInput(f"{field}.data", rule)
        return indices.astype(self.index_dtype, copy=False)

    def check_reply(self, nbytes: int, what) -> None:
        """Refuse an answer of ``nbytes`` that gRPC could not send: it would drop the reply
        after the work was done (and the request would be counted as OK). ``what`` describes
        the answer, or is a function that does (made only for a refusal: it runs per request)."""
        limit = self.max_message_bytes
        if limit is None or nbytes <= limit:
            return
        raise ReplyTooLarge(
            f"the response would be about {nbytes} bytes ({what() if callable(what) else what}), more than the message limit "
            f"of {limit} bytes (--max-message-mb {limit / (1 << 20):g}); send fewer images per "
            "request (the Python client splits by --batch-size), or raise --max-message-mb on "
            "the server and the client")

    def check_encode_reply(self, images: np.ndarray, overhead: int = 0) -> None:
        if self.layout.kind == VIDEO:
            item = self.layout.clip_token_shape(*images.shape[1:4])
        else:
            item = self.layout.token_shape(*images.shape[1:3])
        b = images.shape[0]
        nbytes = b * int(np.prod(item)) * self.index_dtype.itemsize + REPLY_OVERHEAD + overhead
        self.check_reply(nbytes, lambda: f"{b} x {'x'.join(map(str, item))} {self.index_dtype.name} indices")

    def check_decode_reply(self, indices: np.ndarray, overhead: int = 0) -> None:
        b = indices.shape[0]
        h, w = self.layout.image_size(indices.shape[1:])
        frames = self.layout.frames_of(indices.shape[1]) if self.layout.kind == VIDEO else 1
        self.check_reply(b * frames * h * w * 3 + REPLY_OVERHEAD + overhead,
                         lambda: f"{b} x {frames} x {h}x{w} RGB uint8 frames, raw")

    # ---- the serving path -------------------------------------------------------------
    async def encode(self, images: np.ndarray, deadline: float | None = None,
                     field: str = "images", reply_overhead: int = 0) -> np.ndarray:
        """``reply_overhead``: bytes the caller's response adds beyond the indices (an echoed
        request id), counted against the message limit before the model runs."""
        images = np.require(self.check_images(images, field), requirements=self._requirements)
        self.check_encode_reply(images, reply_overhead)
        return self.answer("encode", await self.batcher.submit("encode", images, deadline))

    async def encode_encoded(self, blobs: Sequence[bytes], deadline: float | None = None,
                             field: str = "encoded.images", reply_overhead: int = 0) -> np.ndarray:
        """PNG/JPEG bytes -> indices. The count and every header are checked before any
        pixel is decoded, decoding runs off the event loop, and the decoded pixels count
        against the server's decoded-bytes budget until their indices are back."""
        if self.layout.kind == VIDEO:
            raise BadInput(field, "this video model takes clips as a uint8 [B,T,H,W,3] tensor; encoded images "
                                  "or video bytes are not accepted")
        async with self.decoder.decoded(blobs, field, self.max_batch_size, self.info.max_pixels,
                                        deadline) as images:
            return await self.encode(images, deadline, field, reply_overhead)

    async def decode(self, indices: np.ndarray, deadline: float | None = None,
                     field: str = "indices", reply_overhead: int | None = 0) -> np.ndarray:
        """``reply_overhead``: as for :meth:`encode`, for a raw-pixel answer; None when the
        answer is not raw pixels (PNG: its size is known only once encoded). An encode-only
        model refuses in one line (INVALID_ARGUMENT) before anything is checked or queued."""
        if not self.info.decodes:
            raise decode_unsupported(self.info.extra.get("family", "this model"))
        if reply_overhead is None and self.layout.kind == VIDEO:
            raise BadInput("output_format", "a video model answers clips raw ([B,T,H,W,3] uint8); PNG is for images")
        indices = np.require(self.check_indices(indices, field), requirements=self._requirements)
        if reply_overhead is not None:
            self.check_decode_reply(indices, reply_overhead)
        self.metrics.record_codes("decode", indices)
        return self.answer("decode", await self.batcher.submit("decode", indices, deadline))

    def enqueue_checked(self, method: str, array: np.ndarray, deadline: float | None = None):
        """The device executor's path: queue an array the front-end process that sent it
        checked already (with this same engine code) and return the local batcher's future,
        with no coroutine or task per request; :meth:`answer` turns its result into the
        reply's array."""
        if method == "decode":
            self.metrics.record_codes("decode", array)
        return self.batcher.enqueue(method, array, deadline)

    def answer(self, method: str, out: np.ndarray) -> np.ndarray:
        """The model's output as answered: indices in the served index dtype (counted in the
        codebook metrics), pixels as uint8."""
        if method == "encode":
            out = np.asarray(out).astype(self.index_dtype, copy=False)
            self.metrics.record_codes("encode", out)
            return out
        return np.asarray(out, dtype=np.uint8)


def build_engine(runtime, metrics, config, *, batcher=None, max_batch_pixels: int | None = None,
                 max_decoded_bytes: int | None = None) -> Engine:
    """The one Engine factory of both layouts: the limits of ``config``'s engine section over
    ``runtime`` (a front-end passes the executor's identity and its remote ``batcher``)."""
    max_pixels = config.max_pixels or runtime.info.max_pixels
    return Engine(runtime, metrics, max_batch_size=config.max_batch_size,
                  max_delay_s=config.max_delay_ms / 1000.0, max_queue=config.max_queue,
                  max_message_bytes=config.max_message_mb * 1024 * 1024, max_pixels=max_pixels,
                  max_batch_pixels=max_batch_pixels,
                  max_decoded_bytes=((config.max_decoded_mb or 0) << 20) or max_decoded_bytes,
                  decode_threads=config.decode_threads, batcher=batcher)
