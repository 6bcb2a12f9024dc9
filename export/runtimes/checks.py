"""numpy input checks shared by every artifact runtime.

Exported graphs cannot raise helpful errors (and a gather with an out-of-range index is
undefined behaviour on some providers), so runtimes validate before running anything.
The messages match ``Tokenizer.check_images`` / ``check_indices`` of the eager model.
"""

from __future__ import annotations

import numpy as np

from vqserve.core.input_rules import check_image_batch, check_index_shape


def check_images(images, factor: int) -> np.ndarray:
    if not isinstance(images, np.ndarray):
        raise ValueError(f"images must be a numpy array, got {type(images).__name__}")
    check_image_batch(tuple(images.shape), images.dtype == np.uint8, str(images.dtype), factor)
    return np.ascontiguousarray(images)


def check_indices(indices, codebook_size: int, codes_per_position: int = 1) -> np.ndarray:
    """Integer ``[B,h,w]`` (``[B,h,w,Q]``) with values in ``[0, codebook_size)`` -> int64."""
    if not isinstance(indices, np.ndarray):
        raise ValueError(f"indices must be a numpy array, got {type(indices).__name__}")
    if indices.dtype.kind not in "iu":
        raise ValueError(f"indices must be an integer array, got {indices.dtype}")
    check_index_shape(tuple(indices.shape), codes_per_position)
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= codebook_size:
        raise ValueError(
            f"indices must lie in [0, {codebook_size - 1}], got values in [{lo}, {hi}]"
        )
    return np.ascontiguousarray(indices, dtype=np.int64)


# ---- request rules: one wording for every serving front end ---------------------------------
# The gRPC engine (serve/engine/engine.py) and the TorchServe handler check requests before they
# reach a runtime, with the per-image limit a server sets (--max-pixels). Each returns the
# broken rule as text, or None; the caller names the field in its own protocol's way.
def image_size_rule(h: int, w: int, factor: int, max_pixels: int) -> str | None:
    if h == 0 or w == 0 or h % factor or w % factor:
        return f"H and W must be positive multiples of the downsampling factor {factor}, got {h}x{w}"
    if h * w > max_pixels:
        return f"{h}x{w} = {h * w} pixels per image exceeds the limit {max_pixels}"
    return None


def index_grid_rule(h: int, w: int, factor: int, max_pixels: int) -> str | None:
    if h == 0 or w == 0:
        return f"h and w must be positive, got {h}x{w}"
    f = factor
    if h * w * f * f > max_pixels:
        return (f"{h}x{w} indices decode to {h * f}x{w * f} = {h * w * f * f} pixels per image, "
                f"more than the limit {max_pixels}")
    return None


def index_range_rule(indices: np.ndarray, codebook_size: int) -> str | None:
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= codebook_size:
        return (f"every index must lie in [0, {codebook_size - 1}] (codebook size {codebook_size}), "
                f"got values in [{lo}, {hi}]")
    return None
