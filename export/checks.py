"""numpy input checks shared by every artifact runtime.

Exported graphs cannot raise helpful errors (and a gather with an out-of-range index is
undefined behaviour on some providers), so runtimes validate before running anything.
The messages match ``Tokenizer.check_images`` / ``check_indices`` of the eager model.
"""

from __future__ import annotations

import numpy as np


def check_images(images, factor: int) -> np.ndarray:
    if not isinstance(images, np.ndarray):
        raise ValueError(f"images must be a numpy array, got {type(images).__name__}")
    if images.ndim != 4:
        raise ValueError(f"images must have rank 4 [B,H,W,3], got shape {tuple(images.shape)}")
    if images.shape[-1] != 3:
        raise ValueError(f"images must have 3 channels last [B,H,W,3], got shape {tuple(images.shape)}")
    if images.dtype != np.uint8:
        raise ValueError(f"images must be uint8, got {images.dtype}")
    if images.shape[0] == 0:
        raise ValueError("images is an empty batch (B=0)")
    h, w = images.shape[1], images.shape[2]
    if h == 0 or w == 0 or h % factor or w % factor:
        raise ValueError(
            f"image height and width must be positive multiples of the downsampling factor {factor}, "
            f"got {h}x{w}"
        )
    return np.ascontiguousarray(images)


def check_indices(indices, codebook_size: int, codes_per_position: int = 1) -> np.ndarray:
    """Integer ``[B,h,w]`` (``[B,h,w,Q]``) with values in ``[0, codebook_size)`` -> int64."""
    if not isinstance(indices, np.ndarray):
        raise ValueError(f"indices must be a numpy array, got {type(indices).__name__}")
    if indices.dtype.kind not in "iu":
        raise ValueError(f"indices must be an integer array, got {indices.dtype}")
    q = codes_per_position
    rank = 3 if q == 1 else 4
    shape_txt = "[B,h,w]" if q == 1 else f"[B,h,w,{q}]"
    if indices.ndim != rank or (q > 1 and indices.shape[-1] != q):
        raise ValueError(f"indices must have shape {shape_txt}, got shape {tuple(indices.shape)}")
    if 0 in indices.shape[:3]:
        raise ValueError(f"indices is empty, got shape {tuple(indices.shape)}")
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= codebook_size:
        raise ValueError(
            f"indices must lie in [0, {codebook_size - 1}], got values in [{lo}, {hi}]"
        )
    return np.ascontiguousarray(indices, dtype=np.int64)
