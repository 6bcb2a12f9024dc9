"""The photographs that ship inside scikit-image, and the project's fixed split of them.

Not training code: export measures parity on the validation split, training crops the
training split, and both must see the same photographs cut the same way. scikit-image is
an optional dependency (extras ``train``/``export``/``test``), imported on first use.
"""

from __future__ import annotations

import numpy as np

# The fixed split. Validation photographs are never seen in training; the two
# stereo_motorcycle views (near-duplicates) are both in train.
BUILTIN_TRAIN: tuple[str, ...] = (
    "astronaut", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
    "stereo_motorcycle_left", "stereo_motorcycle_right",
    # grayscale photographs / textures, repeated to RGB
    "camera", "brick", "grass", "gravel", "moon", "clock", "coins",
)
BUILTIN_VAL: tuple[str, ...] = ("chelsea", "coffee")


class DataError(ValueError):
    """No usable images (empty folder, every file corrupt, unknown source)."""


def to_rgb_uint8(img: np.ndarray) -> np.ndarray:
    """Any grayscale / RGB / RGBA / bool / float image -> contiguous uint8 ``[H,W,3]``."""
    img = np.asarray(img)
    if img.dtype == bool:
        img = img.astype(np.uint8) * 255
    if img.dtype != np.uint8:
        img = np.clip(img, 0, 255).astype(np.uint8)
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    if img.ndim != 3:
        raise ValueError(f"expected an image [H,W] or [H,W,C], got shape {img.shape}")
    if img.shape[2] == 1:
        img = np.repeat(img, 3, axis=2)
    return np.ascontiguousarray(img[:, :, :3])


def load_builtin_photo(name: str) -> np.ndarray:
    """One scikit-image photograph by name, as uint8 RGB ``[H,W,3]``."""
    try:
        from skimage import data as skdata
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "the built-in photographs come from scikit-image: "
            "pip install 'vqserve[export]' (or 'vqserve[train]', or scikit-image)"
        ) from exc
    if name.startswith("stereo_motorcycle_"):
        left, right, _ = skdata.stereo_motorcycle()
        return to_rgb_uint8(left if name.endswith("left") else right)
    loader = getattr(skdata, name, None)
    if loader is None:
        raise DataError(f"skimage.data has no photograph {name!r}")
    return to_rgb_uint8(loader())


def tile_grid(img: np.ndarray, size: int) -> list[np.ndarray]:
    """Fixed non-overlapping ``size x size`` tiles of one image on a centred grid, row-major."""
    h, w = img.shape[:2]
    ny, nx = h // size, w // size
    y0, x0 = (h - ny * size) // 2, (w - nx * size) // 2
    return [img[y0 + i * size : y0 + (i + 1) * size, x0 + j * size : x0 + (j + 1) * size]
            for i in range(ny) for j in range(nx)]
