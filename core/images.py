"""Image bytes -> the uint8 RGB pixels a tokenizer sees: the one preprocessing function.

The server (``codec.decode_images``), the client commands and the offline batch
tokenizer (``vqserve tokenize``) all call :func:`load_rgb` and :func:`prepare`, so the
same file gives the same pixels — and therefore the same tokens — on every path.

What "the pixels of an image" means here, decided once:

* **EXIF orientation** is applied (a phone photo is tokenized the way it is displayed);
* **16-bit** grayscale (``I;16``, ``I``) is scaled to 8 bits (``round(v / 257)``), not
  clipped; 16-bit RGB PNGs are reduced to 8 bits by Pillow;
* **alpha** (RGBA, LA, palette with transparency) is composited over white, so colours
  hidden under transparent pixels never reach the model;
* **grayscale, palette, CMYK, YCbCr, 1-bit** become RGB;
* **size**: ``exact`` (use as is), ``keep`` (centre-crop down to multiples of the factor)
  or ``size`` N (resize the shorter side to N, centre-crop N x N). The crop box is
  recorded in original-image coordinates. Large JPEGs are decoded at a reduced DCT scale
  (``Image.draft``) when the target is smaller: 3-10x less decode work, and deterministic.

Only numpy and Pillow: this module runs inside decode worker processes that never load torch.
"""

from __future__ import annotations

import io
import os
from dataclasses import asdict, dataclass

import numpy as np

RESIZE_MODES = ("exact", "keep", "size")
ALPHA_BACKGROUND = (255, 255, 255)


class ImageError(ValueError):
    """An image could not be read or does not fit the rules; the message says why."""


@dataclass(frozen=True)
class Preprocess:
    """How an image becomes model input; recorded in every output manifest.

    ``mode``: ``exact`` (H, W must already be multiples of ``factor``), ``keep`` (centre-crop
    down to multiples of ``factor``), ``size`` (shorter side to ``size``, centre crop).
    """

    mode: str = "exact"
    factor: int = 8
    size: int = 0
    resample: str = "bicubic"
    max_pixels: int = 0          # 0: no limit beyond Pillow's decompression-bomb guard

    def __post_init__(self):
        if self.mode not in RESIZE_MODES:
            raise ValueError(f"preprocess mode must be one of {RESIZE_MODES}, got {self.mode!r}")
        if self.factor < 1:
            raise ValueError(f"factor must be positive, got {self.factor}")
        if self.mode == "size" and (self.size <= 0 or self.size % self.factor):
            raise ValueError(f"--size must be a positive multiple of the model's factor {self.factor}, "
                             f"got {self.size}")
        if self.resample not in _RESAMPLE_NAMES:
            raise ValueError(f"resample must be one of {sorted(_RESAMPLE_NAMES)}, got {self.resample!r}")

    def to_dict(self) -> dict:
        return {**asdict(self), "exif_orientation": True, "alpha_background": list(ALPHA_BACKGROUND),
                "sixteen_bit": "round(v/257)", "jpeg_draft": self.mode == "size"}


@dataclass(frozen=True)
class Prepared:
    """Model-ready pixels and where they came from in the original image."""

    pixels: np.ndarray               # uint8 [h, w, 3], h and w multiples of the factor
    orig_height: int
    orig_width: int
    crop: tuple[int, int, int, int]  # (top, left, height, width) in original pixels


_RESAMPLE_NAMES = {"bicubic": "BICUBIC", "bilinear": "BILINEAR", "lanczos": "LANCZOS",
                   "area": "BOX", "nearest": "NEAREST"}


def _what(formats: tuple[str, ...] | None) -> str:
    return f"a decodable {' or '.join(formats)} image" if formats else "a decodable image"


def _open(data: bytes | str | os.PathLike, formats: tuple[str, ...] | None = None):
    from PIL import Image

    what = _what(formats)

    try:
        if isinstance(data, bytes | bytearray | memoryview):
            if not len(data):
                raise ImageError("is empty (0 bytes)")
            img = Image.open(io.BytesIO(bytes(data)))
        else:
            img = Image.open(data)
    except ImageError:
        raise
    except FileNotFoundError:
        raise ImageError("does not exist") from None
    except IsADirectoryError:
        raise ImageError("is a directory, not an image") from None
    except Image.DecompressionBombError as exc:
        raise ImageError(f"is refused as a decompression bomb ({exc})") from None
    except Image.UnidentifiedImageError:
        raise ImageError(f"is not {what} (unknown format)") from None
    except Exception as exc:  # Pillow raises many types for corrupt data
        raise ImageError(f"is not {what} ({type(exc).__name__}: {exc})") from None
    if formats is not None and img.format not in formats:
        img.close()
        raise ImageError(f"must be a {' or '.join(formats)} image, got {img.format}")
    return img


def _to_rgb(img) -> np.ndarray:
    """Any Pillow mode -> uint8 RGB, by the rules in the module docstring."""
    from PIL import Image

    mode = img.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        a = np.asarray(img).astype(np.float64)
        if mode == "I" and a.max(initial=0) <= 255:  # 8-bit data stored as int32
            g = np.clip(a, 0, 255).astype(np.uint8)
        else:
            g = np.clip(np.rint(a / 257.0), 0, 255).astype(np.uint8)
        return np.repeat(g[..., None], 3, axis=2)
    if mode == "F":
        a = np.asarray(img, dtype=np.float64)
        scale = 255.0 if a.max(initial=0) <= 1.0 else 1.0
        g = np.clip(np.rint(a * scale), 0, 255).astype(np.uint8)
        return np.repeat(g[..., None], 3, axis=2)
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    elif mode in ("LA", "La", "PA", "RGBa"):
        img = img.convert("RGBA")
    elif mode == "L" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode == "RGBA":
        background = Image.new("RGB", img.size, ALPHA_BACKGROUND)
        background.paste(img, mask=img.getchannel("A"))
        img = background
    if img.mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img, dtype=np.uint8)


def check_pixels(height: int, width: int, max_pixels: int) -> None:
    """The per-image pixel limit, checked on the header's size before any pixel is decoded
    (a 3 KB PNG can claim a billion pixels)."""
    if max_pixels and height * width > max_pixels:
        raise ImageError(f"has {height}x{width} = {height * width} pixels, more than the limit {max_pixels}")


def _orientation(img) -> int:
    try:
        return int(img.getexif().get(0x0112, 1))
    except Exception:  # a broken EXIF block: show the image as stored
        return 1


@dataclass(frozen=True)
class Header:
    """What an image's header says, read without decoding a single pixel."""

    height: int          # as displayed (EXIF orientation applied)
    width: int
    format: str          # Pillow's format name: PNG, JPEG, ...

    @property
    def pixels(self) -> int:
        return self.height * self.width


def probe(data: bytes | str | os.PathLike, formats: tuple[str, ...] | None = None,
          max_pixels: int = 0) -> Header:
    """Read only the header: size (displayed orientation) and format. Microseconds for
    PNG/JPEG, whatever the pixel count, so a server can apply its count and pixel budgets
    to a whole request before it spends memory or CPU on decoding."""
    img = _open(data, formats)
    with img:
        w0, h0 = img.size
        check_pixels(h0, w0, max_pixels)
        transposed = _orientation(img) in (5, 6, 7, 8)
        fmt = img.format or ""
    return Header(height=w0 if transposed else h0, width=h0 if transposed else w0, format=fmt)


def _centre_box(h: int, w: int, th: int, tw: int) -> tuple[int, int, int, int]:
    return (h - th) // 2, (w - tw) // 2, th, tw


def prepare(data: bytes | str | os.PathLike, pre: Preprocess = Preprocess(),
            formats: tuple[str, ...] | None = None) -> Prepared:
    """Image bytes or a path -> :class:`Prepared`. Raises :class:`ImageError` naming the rule.

    ``formats``: Pillow format names accepted (e.g. ``("PNG", "JPEG")`` on the wire);
    ``None`` accepts anything Pillow reads.
    """
    from PIL import Image, ImageOps

    img = _open(data, formats)
    with img:
        w0, h0 = img.size  # before EXIF rotation: what the header says
        check_pixels(h0, w0, pre.max_pixels)
        orientation = _orientation(img)
        transposed = orientation in (5, 6, 7, 8)
        oh, ow = (w0, h0) if transposed else (h0, w0)
        if pre.mode == "size":
            side = min(oh, ow)
            top, left, ch, cw = _centre_box(oh, ow, side, side)
        elif pre.mode == "keep":
            ch, cw = oh // pre.factor * pre.factor, ow // pre.factor * pre.factor
            if ch == 0 or cw == 0:
                raise ImageError(f"is {oh}x{ow}, smaller than one {pre.factor}x{pre.factor} token")
            top, left, _, _ = _centre_box(oh, ow, ch, cw)
        else:
            if oh % pre.factor or ow % pre.factor or oh == 0 or ow == 0:
                raise ImageError(f"is {oh}x{ow}; H and W must be positive multiples of the factor "
                                 f"{pre.factor} (resize or crop first, e.g. `--size` or `--keep-size`)")
            top, left, ch, cw = 0, 0, oh, ow
        try:
            if pre.mode == "size" and img.format == "JPEG" and orientation == 1:
                # DCT-domain downscale, never below the target size (deterministic)
                img.draft("RGB", (max(pre.size, 1) * w0 // side, max(pre.size, 1) * h0 // side))
            scale_y, scale_x = img.size[1] / h0, img.size[0] / w0
            if transposed:
                scale_y, scale_x = scale_x, scale_y
            if orientation != 1:
                img = ImageOps.exif_transpose(img)
            rgb = _to_rgb(img)
        except ImageError:
            raise
        except Exception as exc:  # truncated / corrupt data surfaces while decoding
            raise ImageError(f"is not {_what(formats)} ({type(exc).__name__}: {exc})") from None
    if pre.mode == "size":
        box = (left * scale_x, top * scale_y, (left + cw) * scale_x, (top + ch) * scale_y)
        resample = getattr(Image.Resampling, _RESAMPLE_NAMES[pre.resample])
        out = Image.fromarray(rgb, "RGB").resize((pre.size, pre.size), resample, box=box)
        pixels = np.asarray(out, dtype=np.uint8)
    else:
        pixels = np.ascontiguousarray(rgb[top:top + ch, left:left + cw])
    return Prepared(pixels=pixels, orig_height=oh, orig_width=ow, crop=(top, left, ch, cw))


def load_rgb(data: bytes | str | os.PathLike, formats: tuple[str, ...] | None = None,
             max_pixels: int = 0) -> np.ndarray:
    """Image bytes or a path -> uint8 ``[H, W, 3]`` as displayed, any size (no crop): the
    ``exact`` rule with a factor of 1, so it cannot drift from :func:`prepare`."""
    return prepare(data, Preprocess(mode="exact", factor=1, max_pixels=max_pixels), formats).pixels
