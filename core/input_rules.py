"""The tokenizer's input rules and its refusal to decode, without torch: their one home.

The eager model, every exported runtime and the server's request checks give the same
one-line errors from these functions. They import nothing heavy, so a serving front-end
process (which checks requests but runs no model) never loads torch.

* shape rules (``check_image_batch``, ``check_index_shape``): the eager model and every
  runtime;
* array checks (``check_images``, ``check_indices``): every artifact runtime validates numpy
  input before running anything, since exported graphs cannot raise helpful errors (and a
  gather with an out-of-range index is undefined behaviour on some providers);
* request rules (``image_size_rule``, ``index_grid_rule``, ``index_range_rule``): what a
  serving front end (the gRPC engine, the TorchServe handler) checks before a request reaches
  a runtime, with the per-image limit a server sets.
"""

from __future__ import annotations

import numpy as np


def spatial_rule(h: int, w: int, factor: int) -> str | None:
    """The size rule of an image, in its one wording (the model, every runtime, the server)."""
    if h == 0 or w == 0 or h % factor or w % factor:
        return f"H and W must be positive multiples of the downsampling factor {factor}, got {h}x{w}"
    return None


def check_spatial(h: int, w: int, factor: int) -> None:
    rule = spatial_rule(h, w, factor)
    if rule:
        raise ValueError(f"images: {rule}")


def check_image_batch(shape: tuple, is_uint8: bool, dtype_name: str, factor: int, hint: str = "") -> None:
    """The rules for a pixel batch, shared by the eager model and every exported runtime."""
    if len(shape) != 4:
        raise ValueError(f"images must have rank 4 [B,H,W,3], got shape {shape}")
    if shape[-1] != 3:
        raise ValueError(f"images must have 3 channels last [B,H,W,3], got shape {shape}")
    if not is_uint8:
        raise ValueError(f"images must be uint8, got {dtype_name}{hint}")
    if shape[0] == 0:
        raise ValueError("images is an empty batch (B=0)")
    check_spatial(shape[1], shape[2], factor)


def check_index_shape(shape: tuple, codes_per_position: int) -> None:
    """``[B,h,w]`` (``[B,h,w,Q]`` for residual quantizers), nothing empty."""
    q = codes_per_position
    rank = 3 if q == 1 else 4
    shape_txt = "[B,h,w]" if q == 1 else f"[B,h,w,{q}]"
    if len(shape) != rank or (q > 1 and shape[-1] != q):
        raise ValueError(f"indices must have shape {shape_txt}, got shape {shape}")
    if 0 in shape[:3]:
        raise ValueError(f"indices is empty, got shape {shape}")


class DecodeUnsupported(ValueError):
    """Decode asked of an encode-only model (a family whose original has no decoder).

    A ValueError, so every caller that reports bad requests in one line (the CLI's exit 2,
    the server's INVALID_ARGUMENT) reports this one the same way."""


def decode_unsupported(family: str, reason: str = "it has no decoder") -> DecodeUnsupported:
    """The one-line refusal every runtime gives for an encode-only model."""
    return DecodeUnsupported(f"{family} encodes only ({reason}): indices cannot be decoded to pixels")


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
    rule = index_range_rule(indices, codebook_size)
    if rule:
        raise ValueError(f"indices: {rule}")
    return np.ascontiguousarray(indices, dtype=np.int64)


# ---- request rules: one wording for every serving front end ---------------------------------
# The gRPC engine (serve/engine/engine.py) and the TorchServe handler check requests before they
# reach a runtime, with the per-image limit a server sets (--max-pixels). Each returns the
# broken rule as text, or None; the caller names the field in its own protocol's way.
def image_size_rule(h: int, w: int, factor: int, max_pixels: int) -> str | None:
    rule = spatial_rule(h, w, factor)
    if rule:
        return rule
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


def index_range_text(lo: int, hi: int, codebook_size: int) -> str | None:
    """The range rule of token indices, in its one wording, from their least and greatest value
    (the eager model's torch check, every runtime's numpy check and the server's)."""
    if lo < 0 or hi >= codebook_size:
        return (f"every index must lie in [0, {codebook_size - 1}] (codebook size {codebook_size}), "
                f"got values in [{lo}, {hi}]")
    return None


def index_range_rule(indices: np.ndarray, codebook_size: int) -> str | None:
    return index_range_text(int(indices.min()), int(indices.max()), codebook_size)
