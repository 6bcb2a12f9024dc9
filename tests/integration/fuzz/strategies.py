"""The requests the fuzz tests send, and the answers the documented rules allow for each.

Raw tensors (shapes, dtypes, byte lengths, out-of-range indices in every integer dtype) and
image bytes (valid, truncated and corrupted PNG/JPEG, headers claiming huge sizes), each with
its ``expected_*`` rule written from docs/SERVING.md, not from the server code; shared by the
v1 and the Open Inference Protocol tests.
"""

from __future__ import annotations

import functools
import io
import math
import struct
import zlib
from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st

from tests.integration.fuzz.common import (
    CODEBOOK,
    EXHAUSTED,
    FACTOR,
    INT_DTYPES,
    INVALID,
    JUNK_DTYPES,
    LIMIT,
    MAX_BATCH,
    MAX_PIXELS,
    OK,
    REPLY_OVERHEAD,
    WIRE_DTYPES,
    _grid_ok,
    _image_rules,
    _parses,
    rarely,
)
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve.api import codec

# ---- strategies: raw tensors -------------------------------------------------------------------
dims = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 8, 16, 24, 32, 7, 12]),
                 st.integers(-(2**63), 2**63 - 1))


def _payload(draw, shape: list[int], dtype: str, length_off: bool,
             fill: Callable[[np.random.Generator, np.dtype, int], np.ndarray]) -> bytes:
    """The data bytes for ``shape`` and ``dtype``: exactly the right length (from ``fill``),
    or, with ``length_off`` or when no length fits, some other length."""
    name = dtype.strip().lower()
    dt = np.dtype(name).newbyteorder("<") if name in codec.WIRE_DTYPES else None
    count = math.prod(shape) if shape and min(shape) >= 0 else -1
    if dt is None or not 0 <= count * dt.itemsize <= 8 << 20:
        return draw(st.binary(max_size=64))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    data = fill(rng, dt, count).astype(dt).tobytes()
    if length_off:
        data = data[: -draw(st.integers(1, len(data)))] if data and draw(st.booleans()) else \
            data + bytes(draw(st.integers(1, 9)))
    return data


@st.composite
def image_tensors(draw) -> tuple[pb.Tensor, np.ndarray | None]:
    """A v1 image tensor: half of them well formed (then the pixels come too), the others
    broken in one or two of batch, size, channels, rank, dtype, byte length, or made of
    random dimensions, or over the message limit."""
    shape = [draw(st.integers(1, MAX_BATCH)), draw(st.sampled_from([8, 16, 24, 32])),
             draw(st.sampled_from([8, 16, 32])), 3]
    dtype, length_off = "uint8", False
    for change in draw(st.just([]) | st.lists(st.sampled_from(
            ["batch", "size", "channels", "rank", "dtype", "length", "random", "oversize"]),
            min_size=1, max_size=2)):
        if change == "batch" and shape:
            shape[0] = draw(st.sampled_from([0, MAX_BATCH + 1, MAX_BATCH + 7, -1]))
        elif change == "size" and len(shape) > 2:
            shape[draw(st.integers(1, 2))] = draw(st.sampled_from([0, 12, 7, 1, -8, 2**40]))
        elif change == "channels" and shape:
            shape[-1] = draw(st.sampled_from([0, 1, 4]))
        elif change == "rank":
            shape = shape[:-1] if draw(st.booleans()) else [*shape, 1]
        elif change == "dtype":
            dtype = draw(st.sampled_from(WIRE_DTYPES + JUNK_DTYPES))
        elif change == "length":
            length_off = True
        elif change == "random":
            shape = draw(st.lists(dims, min_size=0, max_size=9))
        elif change == "oversize":  # over the 4 MiB message limit (1024x1024 RGB is 3 MiB)
            shape = list(draw(st.sampled_from([(2, 1024, 1024, 3), (6, 512, 512, 3)])))
    data = _payload(draw, shape, dtype, length_off,
                    lambda rng, dt, n: rng.integers(0, 256, n, dtype=np.uint8))
    tensor = pb.Tensor(shape=shape, dtype=dtype, data=data)
    pixels = None
    if _parses(shape, dtype, len(data)) and dtype.strip().lower() == "uint8" and len(shape) == 4 \
            and shape[3] == 3:
        pixels = np.frombuffer(data, np.uint8).reshape(shape)
    return tensor, pixels


def expected_encode(pixels: np.ndarray | None) -> set:
    if pixels is None:
        return {INVALID}
    b, h, w, _ = pixels.shape
    return {OK} if _image_rules(b, h, w) else {INVALID}


@st.composite
def index_tensors(draw) -> tuple[pb.Tensor, np.ndarray | None, bool]:
    """A v1 / OIP index tensor: (tensor, the array if it parses, whether every value lies in
    the codebook). Half well formed in some integer dtype; the others broken in batch,
    grid, rank, dtype, byte length or random dimensions, or holding one index outside the
    codebook that the dtype can hold (codebook_size, the dtype's extremes, 2**63 for
    uint64), or asking for answers too big for the message limit."""
    shape = [draw(st.integers(1, MAX_BATCH)), draw(st.sampled_from([1, 2, 3, 4, 8])),
             draw(st.sampled_from([1, 2, 4, 8]))]
    dtype = draw(st.sampled_from(INT_DTYPES))
    length_off, bad_value = False, False
    for change in draw(st.just([]) | st.lists(st.sampled_from(
            ["batch", "grid", "rank", "dtype", "length", "random", "value", "value", "big"]),
            min_size=1, max_size=2)):
        if change == "batch" and shape:
            shape[0] = draw(st.sampled_from([0, MAX_BATCH + 1, -1]))
        elif change == "grid" and len(shape) > 2:
            shape[draw(st.integers(1, 2))] = draw(st.sampled_from([0, -1, 129, 2**31]))
        elif change == "rank":
            shape = shape[:-1] if draw(st.booleans()) else [*shape, draw(st.integers(1, 2))]
        elif change == "dtype":
            dtype = draw(st.sampled_from(["float32", "float16", "float64", "bool"] + JUNK_DTYPES))
        elif change == "length":
            length_off = True
        elif change == "random":
            shape = draw(st.lists(dims, min_size=0, max_size=5))
        elif change == "value":
            bad_value = True
        elif change == "big":
            # 1024x1024 answers, 3 MiB each raw: 2 or more cannot fit the 4 MiB limit (one
            # would fit, and run the model at full size: not fuzzed, to keep the run fast)
            shape = [draw(st.sampled_from([2, 3])), 128, 128]
    bad = []

    def fill(rng, dt: np.dtype, n: int) -> np.ndarray:
        if dt.kind not in "iu":
            return rng.integers(0, 4, n)
        top = min(CODEBOOK - 1, np.iinfo(dt).max)
        values = rng.integers(0, top + 1, n).astype(dt)
        if bad and n:
            values[int(rng.integers(0, n))] = bad[0]
        return values

    name = dtype.strip().lower()
    if bad_value and name in INT_DTYPES and (choices := _out_of_range(np.dtype(name))):
        bad.append(draw(st.sampled_from(choices)))
    data = _payload(draw, shape, dtype, length_off, fill)
    tensor = pb.Tensor(shape=shape, dtype=dtype, data=data)
    if not _parses(shape, dtype, len(data)):
        return tensor, None, False
    array = np.frombuffer(data, np.dtype(name).newbyteorder("<")).reshape(shape)
    in_range = array.dtype.kind in "iu" and (array.size == 0 or (
        int(array.min()) >= 0 and int(array.max()) < CODEBOOK))
    return tensor, array, in_range


def _out_of_range(dt: np.dtype) -> list[int]:
    if dt.kind not in "iu":
        return []
    info = np.iinfo(dt)
    values = [CODEBOOK, int(info.max), -1, int(info.min)] + ([2**63] if dt == np.uint64 else [])
    return [v for v in values if info.min <= v <= info.max and not 0 <= v < CODEBOOK]


def expected_decode(array: np.ndarray | None, in_range: bool, raw_reply: bool,
                    extra: int = 0) -> set:
    """Bad structure -> INVALID; a well-formed grid whose raw answer cannot fit the message
    limit -> RESOURCE_EXHAUSTED (or INVALID too when some index is also out of range:
    either rule may be checked first); else OK."""
    if array is None or array.dtype.kind not in "iu" or array.ndim != 3:
        return {INVALID}
    b, h, w = array.shape
    if not (1 <= b <= MAX_BATCH and _grid_ok(h, w, FACTOR * FACTOR)):
        return {INVALID}
    too_big = raw_reply and b * h * w * FACTOR * FACTOR * 3 + REPLY_OVERHEAD + extra > LIMIT
    if too_big:
        return {EXHAUSTED} | ({INVALID} if not in_range else set())
    return {OK} if in_range else {INVALID}


# ---- strategies: image bytes ----------------------------------------------------------------------
def _png(img, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


@functools.cache
def sample_image(fmt: str, mode: str, h: int, w: int) -> bytes:
    """A deterministic, textured image of ``mode`` in ``fmt`` (PNG, JPEG, GIF, BMP, WEBP)."""
    from PIL import Image

    rng = np.random.default_rng(h * 1000 + w)
    rgb = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
    img = rgb.convert(mode) if mode not in ("I;16",) else Image.fromarray(
        rng.integers(0, 65536, (h, w), dtype=np.uint16))
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


@functools.cache
def flat_png(size: int) -> bytes:
    """A ``size`` x ``size`` single-colour palette PNG: ~600 bytes for 1024x1024, 3 MB of
    RGB once decoded (the amplification attack of issue 13, item 1)."""
    from PIL import Image

    return _png(Image.new("P", (size, size), 3), optimize=True)


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


@functools.cache
def png_claiming(width: int, height: int, real: bool = False) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` RGB; ``real``: its IDAT really
    inflates to every row (a zlib bomb: ~1000x), else a few bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    packer = zlib.compressobj(9)
    if real:
        row = bytes(1 + 3 * width)
        idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    else:
        idat = packer.compress(b"\x00" * 64) + packer.flush()
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def jpeg_claiming(width: int, height: int) -> bytes:
    """An 8x8 JPEG whose frame header (SOF0) is patched to claim ``width`` x ``height``."""
    blob = bytearray(sample_image("JPEG", "RGB", 8, 8))
    at = blob.index(b"\xff\xc0")
    blob[at + 5: at + 9] = struct.pack(">HH", height, width)
    return bytes(blob)


VALID = [("PNG", m, s) for m in ("RGB", "L", "RGBA", "P", "1", "I;16") for s in (8, 16)] + \
        [("JPEG", m, s) for m in ("RGB", "L", "CMYK") for s in (8, 16)]


@st.composite
def blobs(draw) -> tuple[bytes, str, tuple[int, int] | None]:
    """One entry of ``encoded.images``: (bytes, verdict, size). ``verdict`` is "ok" (must
    decode, to ``size``), "bad" (must be refused) or "maybe" (corrupted: either)."""
    kind = draw(st.sampled_from(["valid"] * 4 + ["wrong-size", "other-format", "truncated",
                                                 "flipped", "garbage", "bomb", "jpeg-bomb"]))
    if kind == "valid":
        fmt, mode, s = draw(st.sampled_from(VALID))
        h = 2 * s if rarely(draw, 4) else s
        return sample_image(fmt, mode, h, s), "ok", (h, s)
    if kind == "wrong-size":
        fmt = draw(st.sampled_from(["PNG", "JPEG"]))
        h, w = draw(st.sampled_from([(12, 8), (8, 7), (1, 1), (9, 16)]))
        return sample_image(fmt, "RGB", h, w), "bad", None
    if kind == "other-format":
        fmt = draw(st.sampled_from(["GIF", "BMP", "WEBP", "TIFF"]))
        return sample_image(fmt, "RGB", 8, 8), "bad", None
    if kind in ("truncated", "flipped"):
        fmt, mode, s = draw(st.sampled_from(VALID))
        blob = bytearray(sample_image(fmt, mode, s, s))
        at = draw(st.integers(0, len(blob) - 1))
        if kind == "truncated":
            return bytes(blob[:at]), ("bad" if at < 16 else "maybe"), (s, s)
        blob[at] ^= draw(st.integers(1, 255))
        return bytes(blob), "maybe", (s, s)
    if kind == "garbage":
        magic = draw(st.sampled_from([b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a"]))
        return magic + draw(st.binary(max_size=300)), "bad", None
    if kind == "bomb":
        real = rarely(draw, 4)
        if real:
            w = h = draw(st.sampled_from([2048, 4096, 8192]))
        else:
            w, h = draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 2**31 - 1))
        verdict = "bad" if w * h > MAX_PIXELS or w == 0 or h == 0 else "maybe"
        return png_claiming(w, h, real), verdict, (h, w)
    w, h = draw(st.integers(1, 65535)), draw(st.integers(1, 65535))
    return jpeg_claiming(w, h), ("bad" if w * h > MAX_PIXELS else "maybe"), (h, w)


def expected_encoded(entries: list[tuple[bytes, str, tuple | None]]) -> set:
    if not entries or len(entries) > MAX_BATCH:
        return {INVALID}
    if any(v == "bad" for _, v, _ in entries):
        return {INVALID}
    if len({size for _, v, size in entries if v == "ok"}) > 1:
        return {INVALID}   # one request holds one size
    if all(v == "ok" for _, v, _ in entries):
        return {OK}
    return {OK, INVALID}   # a corrupted entry may still decode, to any size


def _size_rule(request_bytes: bytes, allowed: set) -> set:
    """A request over the message limit is refused by gRPC, whatever it holds."""
    return {EXHAUSTED} if len(request_bytes) > LIMIT else allowed
