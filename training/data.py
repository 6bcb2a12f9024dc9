"""Training data: image folders and the photographs that ship inside scikit-image.

Two sources, one interface (``ImageSource.images``: a list of uint8 ``[H,W,3]`` arrays):

* ``ImageFolder(path)`` - every ``.jpg/.jpeg/.png/.webp`` below ``path`` (recursive, sorted).
  A file that cannot be decoded is skipped with a warning and counted in ``skipped``;
  it never stops a run.
* ``builtin_source("train" | "val")`` - the photographs bundled with scikit-image
  (``skimage.data``, no download), with a FIXED split (see ``BUILTIN_TRAIN`` /
  ``BUILTIN_VAL`` and docs/TRAINING.md). Grayscale photographs are repeated to RGB.
* ``photos:train`` / ``photos:select`` - the scikit-image split plus the pinned Debian
  package photographs (``vqserve.training.datasets``; ``make data`` fetches them), and
  ``heldout`` / ``heldout:pip`` - the evaluation-only test photographs (training refuses them).

``RandomCrops`` draws batches of random crops with random horizontal flips; the batch for
step ``s`` depends only on ``(seed, s)``, so a resumed run sees exactly the batches an
uninterrupted one would. ``tile_crops`` cuts the fixed, non-overlapping validation crops.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vqserve.model.photos import (  # noqa: F401 - re-exported: the data API in one place
    BUILTIN_TRAIN,
    BUILTIN_VAL,
    DataError,
    load_builtin_photo,
    tile_grid,
    to_rgb_uint8,
)
from vqserve.training.datasets import package_images, pip_heldout_images, role_photos

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")

@dataclass
class ImageSource:
    """A list of uint8 RGB images plus what was skipped on the way."""

    images: list[np.ndarray]
    names: list[str]
    skipped: list[str] = field(default_factory=list)
    description: str = ""

    def __len__(self) -> int:
        return len(self.images)

    @property
    def num_pixels(self) -> int:
        return int(sum(img.shape[0] * img.shape[1] for img in self.images))


def builtin_source(split: str = "train") -> ImageSource:
    if split not in ("train", "val"):
        raise DataError(f"builtin split must be 'train' or 'val', got {split!r}")
    names = list(BUILTIN_TRAIN if split == "train" else BUILTIN_VAL)
    return ImageSource([load_builtin_photo(n) for n in names], names,
                       description=f"skimage.data photographs ({split} split)")


def find_images(root: str | os.PathLike) -> list[Path]:
    root = Path(root)
    if not root.exists():
        raise DataError(f"image folder {str(root)!r} does not exist")
    if root.is_file():
        return [root] if root.suffix.lower() in IMAGE_EXTENSIONS else []
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def read_image(path: str | os.PathLike) -> np.ndarray:
    """Decode one file fully to uint8 RGB (raises on a corrupt or truncated file)."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        return to_rgb_uint8(np.asarray(im.convert("RGB")))


def image_folder(root: str | os.PathLike, min_size: int = 1) -> ImageSource:
    """Load every image below ``root``; unreadable files are skipped, warned about, counted."""
    paths = find_images(root)
    images, names, skipped = [], [], []
    for p in paths:
        try:
            img = read_image(p)
        except Exception as exc:  # any decoder failure: skip, never crash the run
            skipped.append(str(p))
            warnings.warn(f"skipping unreadable image {p}: {type(exc).__name__}: {exc}", stacklevel=2)
            continue
        if min(img.shape[:2]) < min_size:
            skipped.append(str(p))
            warnings.warn(f"skipping image {p}: {img.shape[1]}x{img.shape[0]} is smaller than {min_size}",
                          stacklevel=2)
            continue
        images.append(img)
        names.append(str(p))
    if skipped:
        warnings.warn(f"{len(skipped)} of {len(paths)} image files in {root} were skipped", stacklevel=2)
    return ImageSource(images, names, skipped, description=f"image folder {root}")


HELDOUT_SPECS = ("heldout", "heldout:pip")
PHOTO_SPECS = ("photos:train", "photos:select")


def photos_source(role: str) -> ImageSource:
    """scikit-image's split plus the package photographs of ``role`` ("train" or "select")."""
    images, names = role_photos(role)
    return ImageSource(images, names, description=f"scikit-image + Debian package photographs ({role})")


def heldout_source(spec: str) -> ImageSource:
    """The test photographs: KDE wallpapers (``heldout``) plus matplotlib's and scikit-learn's."""
    images, names = pip_heldout_images()
    if spec == "heldout":
        kde, kde_names = package_images("test")
        images, names = kde + images, kde_names + names
    return ImageSource(images, names, description=f"held-out test photographs ({spec})")


def open_source(spec: str, split: str = "train", min_size: int = 1) -> ImageSource:
    """``"builtin"`` (or ``"builtin:val"``), ``"photos:train|select"``, ``"heldout[:pip]"``
    or a folder path."""
    if spec in HELDOUT_SPECS:
        return heldout_source(spec)
    if spec in PHOTO_SPECS:
        return photos_source(spec.partition(":")[2])
    if spec.startswith("photos") or spec.startswith("heldout:"):
        raise DataError(f"unknown image set {spec!r}; known: {', '.join(PHOTO_SPECS + HELDOUT_SPECS)}")
    if spec.startswith("builtin"):
        _, _, explicit = spec.partition(":")
        return builtin_source(explicit or split)
    return image_folder(spec, min_size=min_size)


def to_float(batch: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> fp32 NCHW in [-1, 1]."""
    t = torch.as_tensor(np.ascontiguousarray(batch)) if isinstance(batch, np.ndarray) else batch
    return t.permute(0, 3, 1, 2).to(torch.float32) / 127.5 - 1.0


class RandomCrops:
    """Batches of random ``crop x crop`` crops with random horizontal flips.

    ``sampling="area"`` (the default) draws images in proportion to their pixel count, so
    every pixel is equally likely to be in a crop; ``"uniform"`` draws each image equally
    often. On the built-in split, area weighting makes the 1411x1411 retina fundus a third
    of the crops, yet it scored better on the validation photographs than uniform
    (19.4 vs 16.4 dB at step 800, docs/TRAINING.md). An image smaller than the crop is
    reflect-padded. Batch ``step`` is a pure function of ``(seed, step)``.

    ``smooth_fraction`` replaces that share of the crops by a synthetic smooth patch
    (``smooth_patch``) in the drawn crop's own mean colour: photographs hold few truly flat
    regions, so without them training barely sees the skies on which a tint or banding shows.
    """

    def __init__(self, source: ImageSource, crop: int, batch_size: int, seed: int = 0,
                 flip: bool = True, sampling: str = "area", smooth_fraction: float = 0.0):
        if len(source) == 0:
            raise DataError(f"no usable images in {source.description or 'the data source'}"
                            f" ({len(source.skipped)} skipped)")
        if crop < 1 or batch_size < 1:
            raise ValueError(f"crop and batch_size must be >= 1, got {crop} and {batch_size}")
        self.images = [self._pad(img, crop) for img in source.images]
        self.crop, self.batch_size, self.seed, self.flip = crop, batch_size, seed, flip
        if not 0.0 <= smooth_fraction <= 1.0:
            raise ValueError(f"smooth_fraction must be in [0, 1], got {smooth_fraction}")
        self.smooth_fraction = smooth_fraction
        if sampling not in ("uniform", "area"):
            raise ValueError(f"sampling must be 'uniform' or 'area', got {sampling!r}")
        if sampling == "area":
            weights = np.array([img.shape[0] * img.shape[1] for img in self.images], dtype=np.float64)
        else:
            weights = np.ones(len(self.images), dtype=np.float64)
        self.p = weights / weights.sum()

    @staticmethod
    def _pad(img: np.ndarray, crop: int) -> np.ndarray:
        h, w = img.shape[:2]
        if h >= crop and w >= crop:
            return img
        ph, pw = max(0, crop - h), max(0, crop - w)
        return np.pad(img, ((0, ph), (0, pw), (0, 0)), mode="symmetric")

    def batch_uint8(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([int(self.seed), int(step)])
        c = self.crop
        out = np.empty((self.batch_size, c, c, 3), dtype=np.uint8)
        picks = rng.choice(len(self.images), size=self.batch_size, p=self.p)
        for i, k in enumerate(picks):
            img = self.images[k]
            y = int(rng.integers(0, img.shape[0] - c + 1))
            x = int(rng.integers(0, img.shape[1] - c + 1))
            crop = img[y : y + c, x : x + c]
            if self.flip and rng.random() < 0.5:
                crop = crop[:, ::-1]
            out[i] = crop
            if self.smooth_fraction and rng.random() < self.smooth_fraction:
                out[i] = smooth_patch(rng, c, crop.reshape(-1, 3).mean(axis=0))
        return out

    def batch(self, step: int) -> torch.Tensor:
        return to_float(self.batch_uint8(step))


def smooth_patch(rng: np.random.Generator, size: int, colour: np.ndarray) -> np.ndarray:
    """A ``size x size`` uint8 patch of ``colour`` (made neutral grey one time in four), with a
    linear gradient of random direction and up to 32 levels across the patch and Gaussian grain
    of up to 1.5 levels: a sky, a wall, a studio backdrop."""
    colour = np.asarray(colour, dtype=np.float64)
    if rng.random() < 0.25:
        colour = np.full(3, colour.mean())
    angle = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:size, 0:size] / max(1, size - 1) - 0.5
    ramp = (np.cos(angle) * xx + np.sin(angle) * yy)[..., None] * rng.uniform(0, 32) * rng.uniform(-1, 1, 3)
    grain = rng.normal(0, rng.uniform(0, 1.5), (size, size, 3))
    return np.clip(np.rint(colour + ramp + grain), 0, 255).astype(np.uint8)


def tile_crops(images: Sequence[np.ndarray], size: int, max_per_image: int | None = None) -> np.ndarray:
    """Fixed non-overlapping ``size x size`` tiles (centred grid) of each image: uint8 NHWC."""
    tiles = []
    for img in images:
        found = tile_grid(img, size)
        tiles.extend(found[:max_per_image] if max_per_image else found)
    if not tiles:
        raise DataError(f"no image is at least {size}x{size}; cannot cut validation crops")
    return np.ascontiguousarray(np.stack(tiles))


def center_crop_multiple(img: np.ndarray, factor: int) -> np.ndarray:
    """Centre crop so height and width are multiples of ``factor``."""
    h, w = img.shape[:2]
    hh, ww = h - h % factor, w - w % factor
    y0, x0 = (h - hh) // 2, (w - ww) // 2
    return np.ascontiguousarray(img[y0 : y0 + hh, x0 : x0 + ww])
