"""Small tensor helpers shared by the quantizers."""

from __future__ import annotations

import torch

from vqserve.core.input_rules import index_range_text
from vqserve.model.precision import QUANTIZER_DTYPE


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round with a straight-through gradient."""
    return x + (x.round() - x).detach()


def straight_through(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """Forward value of ``quantized``, gradient of ``x``."""
    return x + (quantized - x).detach()


def to_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == QUANTIZER_DTYPE else x.to(QUANTIZER_DTYPE)


def check_last_dim(z: torch.Tensor, dim: int, who: str) -> None:
    if not torch.is_tensor(z):
        raise TypeError(f"{who} expects a tensor, got {type(z).__name__}")
    if z.ndim < 1 or z.shape[-1] != dim:
        raise ValueError(
            f"{who} expects channel-last input z[..., {dim}], got shape {tuple(z.shape)}"
        )
    if not z.is_floating_point():
        raise ValueError(f"{who} expects a floating-point input, got {z.dtype}")


def check_indices(indices: torch.Tensor, codebook_size: int, who: str) -> None:
    """Reject float/bool indices and values outside [0, codebook_size)."""
    if not torch.is_tensor(indices):
        raise TypeError(f"{who} expects a tensor of indices, got {type(indices).__name__}")
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise ValueError(f"{who}: indices must be an integer tensor, got {indices.dtype}")
    if indices.numel() and not torch.jit.is_tracing() and not torch.compiler.is_compiling():
        rule = index_range_text(int(indices.min()), int(indices.max()), codebook_size)
        if rule:
            raise ValueError(f"{who}: {rule}")
