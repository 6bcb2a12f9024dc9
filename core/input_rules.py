"""The tokenizer's input rules and its refusal to decode, without torch.

The eager model, every exported runtime and the server's request checks give the same
one-line errors from these functions. They import nothing heavy, so a serving front-end
process (which checks requests but runs no model) never loads torch.
"""

from __future__ import annotations


def check_spatial(h: int, w: int, factor: int) -> None:
    if h == 0 or w == 0 or h % factor or w % factor:
        raise ValueError(
            f"image height and width must be positive multiples of the downsampling factor {factor}, "
            f"got {h}x{w}"
        )


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
