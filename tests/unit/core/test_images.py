"""The one preprocessing function (core/images.py): every mode Pillow hands us, every size rule.

Each case writes a real file with Pillow and checks the pixels a tokenizer would see.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vqserve.core import images
from vqserve.core.images import ImageError, Preprocess, load_rgb, prepare
from vqserve.serve.api import codec


def _bytes(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _photo(h=48, w=64) -> np.ndarray:
    from skimage import data

    return np.ascontiguousarray(data.astronaut()[100:100 + h, 150:150 + w])


def test_exif_orientation_is_applied():
    """A phone JPEG stored landscape with 'rotate 90 CW' is tokenized as displayed (portrait)."""
    px = _photo(48, 64)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display
    blob = _bytes(Image.fromarray(px), "PNG", exif=exif)
    out = load_rgb(blob)
    assert out.shape == (64, 48, 3)
    np.testing.assert_array_equal(out, np.rot90(px, k=-1))
    p = prepare(blob, Preprocess(mode="keep", factor=8))
    assert (p.orig_height, p.orig_width) == (64, 48)
    np.testing.assert_array_equal(p.pixels, np.rot90(px, k=-1))


def test_sixteen_bit_is_scaled_not_clipped():
    ramp = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)
    out = load_rgb(_bytes(Image.fromarray(ramp), "PNG"))
    expect = np.clip(np.rint(ramp / 257.0), 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(out[..., 0], expect)
    assert out.max() > 200 and out.min() == 0 and (out < 255).mean() > 0.9  # not clipped to white


def test_alpha_is_composited_over_white():
    rgba = np.zeros((16, 16, 4), np.uint8)
    rgba[..., :3] = (200, 10, 10)          # colour hidden under transparency
    rgba[:8, :, 3] = 255                    # top half opaque
    out = load_rgb(_bytes(Image.fromarray(rgba, "RGBA"), "PNG"))
    assert (out[:8] == (200, 10, 10)).all()
    assert (out[8:] == 255).all()


def test_palette_with_transparency_and_grayscale():
    pal = Image.new("P", (8, 8), 1)
    pal.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    pal.info["transparency"] = 1
    assert (load_rgb(_bytes(pal, "PNG", transparency=1)) == 255).all()
    gray = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4
    out = load_rgb(_bytes(Image.fromarray(gray, "L"), "PNG"))
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], gray)  # no tint: all three channels equal


def test_cmyk_jpeg_becomes_rgb():
    px = _photo(32, 32)
    cmyk = Image.fromarray(px).convert("CMYK")
    out = load_rgb(_bytes(cmyk, "JPEG", quality=95))
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8
    assert np.abs(out.astype(int) - px.astype(int)).mean() < 12


@pytest.mark.parametrize("blob, rule", [
    (b"", "is empty"),
    (b"not an image at all", "not a decodable image"),
    (_bytes(Image.new("RGB", (32, 32)), "PNG")[:60], "not a decodable image"),
])
def test_bad_bytes_name_the_problem(blob, rule):
    with pytest.raises(ImageError, match=rule):
        prepare(blob, Preprocess(mode="keep"))


def test_wire_formats_are_enforced_with_the_same_loader():
    gif = _bytes(Image.new("RGB", (8, 8)), "GIF")
    with pytest.raises(codec.BadInput, match=r"img\[0\]: must be a PNG or JPEG image, got GIF"):
        codec.decode_images([gif], "img", 1 << 20)
    png = _bytes(Image.fromarray(_photo(16, 24)), "PNG")
    np.testing.assert_array_equal(codec.decode_images([png], "img", 1 << 20)[0], load_rgb(png))


def test_size_mode_resizes_the_centre_square():
    px = _photo(48, 64)
    p = prepare(_bytes(Image.fromarray(px), "PNG"), Preprocess(mode="size", size=32, factor=8))
    assert p.pixels.shape == (32, 32, 3)
    assert p.crop == (0, 8, 48, 48) and (p.orig_height, p.orig_width) == (48, 64)
    # the filter may read just outside the box (no dark border), so compare with Pillow's box resize
    expect = np.asarray(Image.fromarray(px).resize((32, 32), Image.Resampling.BICUBIC, box=(8, 0, 56, 48)))
    np.testing.assert_array_equal(p.pixels, expect)
    cropped = np.asarray(Image.fromarray(px[:, 8:56]).resize((32, 32), Image.Resampling.BICUBIC))
    assert np.abs(p.pixels[4:-4, 4:-4].astype(int) - cropped[4:-4, 4:-4]).max() <= 1


def test_jpeg_draft_is_close_to_a_full_decode():
    """Large JPEGs decode at a reduced DCT scale when --size is smaller: near-identical pixels."""
    from skimage import data

    big = np.asarray(Image.fromarray(data.astronaut()).resize((1024, 1024), Image.Resampling.BICUBIC))
    blob = _bytes(Image.fromarray(big), "JPEG", quality=95)
    fast = prepare(blob, Preprocess(mode="size", size=128, factor=8)).pixels
    full = np.asarray(Image.fromarray(load_rgb(blob)).resize((128, 128), Image.Resampling.BICUBIC))
    mse = np.mean((fast.astype(float) - full.astype(float)) ** 2)
    assert 10 * np.log10(255**2 / mse) > 35
    np.testing.assert_array_equal(fast, prepare(blob, Preprocess(mode="size", size=128)).pixels)


def test_exact_mode_refuses_sizes_off_the_factor():
    blob = _bytes(Image.fromarray(_photo(30, 40)), "PNG")
    with pytest.raises(ImageError, match="multiples of the factor 8.*--size.*--keep-size"):
        prepare(blob, Preprocess(mode="exact", factor=8))


def test_preprocess_settings_are_checked():
    with pytest.raises(ValueError, match="multiple of the model's factor 8"):
        Preprocess(mode="size", size=100, factor=8)
    with pytest.raises(ValueError, match="mode must be one of"):
        Preprocess(mode="stretch")


def test_max_pixels_is_checked_from_the_header():
    blob = _bytes(Image.new("RGB", (64, 64)), "PNG")
    with pytest.raises(ImageError, match="more than the limit 1000"):
        prepare(blob, Preprocess(mode="keep", max_pixels=1000))


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 70), w=st.integers(1, 70), factor=st.sampled_from([4, 8, 16]))
def test_keep_mode_crops_to_the_centre_multiple(h, w, factor):
    px = np.random.default_rng(h * 100 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    blob = _bytes(Image.fromarray(px), "PNG")
    pre = Preprocess(mode="keep", factor=factor)
    if h < factor or w < factor:
        with pytest.raises(ImageError, match="smaller than one"):
            prepare(blob, pre)
        return
    p = prepare(blob, pre)
    top, left, ch, cw = p.crop
    assert ch == h // factor * factor and cw == w // factor * factor
    assert 0 <= top <= h - ch and 0 <= left <= w - cw and abs((h - ch) - 2 * top) <= 1
    np.testing.assert_array_equal(p.pixels, px[top:top + ch, left:left + cw])


def test_images_module_never_imports_torch():
    """Decode workers import core/images.py and offline/sources.py; torch there would cost
    seconds per worker and gigabytes across a pool."""
    import subprocess
    import sys

    code = ("import sys, vqserve.core.images, vqserve.offline.sources, vqserve.offline.tasks, "
            "vqserve.offline.pipeline; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert images.RESIZE_MODES == ("exact", "keep", "size")
