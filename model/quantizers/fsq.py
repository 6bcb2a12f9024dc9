"""Finite Scalar Quantization (Mentzer et al. 2023), index-compatible with vector-quantize-pytorch.

Each channel d is bounded with tanh to ``levels[d]`` values and rounded; the index is the
mixed-radix number with the first level as the least significant digit. Everything from
the bound to the index runs in fp32/int64: in bf16 an index such as 1001 cannot even be
represented (failure 2 in docs/DESIGN.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import check_indices, check_last_dim, to_fp32

_EPS = 1e-3  # the same bound slack as vector-quantize-pytorch, so indices agree exactly


class FSQ(Fp32StateModule):
    """``FSQ(levels)``: ``q(z[..., len(levels)]) -> (codes, indices)``.

    Codes are in [-1, 1] (``round(bounded) / (L // 2)``), in z's dtype; indices are int64.
    All constants are integer buffers; the float ones are derived inside the fp32 island,
    so casting the module to bf16/fp16 cannot change them.
    """

    def __init__(self, levels: Sequence[int]):
        super().__init__()
        levels = [int(level) for level in levels]
        if not levels or any(level < 3 for level in levels):
            raise ValueError(f"FSQ levels must each be >= 3, got {levels}")
        self.levels = levels
        self.dim = len(levels)
        self.codebook_size = math.prod(levels)
        if self.codebook_size >= 2**31:
            raise ValueError(f"FSQ codebook of {self.codebook_size} codes is too large (limit 2**31)")
        basis = [1]
        for level in levels[:-1]:
            basis.append(basis[-1] * level)
        self.register_buffer("_levels", torch.tensor(levels, dtype=torch.int64), persistent=False)
        self.register_buffer("_basis", torch.tensor(basis, dtype=torch.int64), persistent=False)

    def extra_repr(self) -> str:
        return f"levels={self.levels}, codebook_size={self.codebook_size}"

    # -- fp32 pieces -------------------------------------------------------------------
    def bound(self, z: torch.Tensor) -> torch.Tensor:
        """Map fp32 ``z`` into the open box of each level: the pre-rounding latent."""
        levels = self._levels.to(torch.float32)
        half_l = (levels - 1) * (1 + _EPS) / 2
        offset = torch.where(self._levels % 2 == 0, 0.5, 0.0).to(torch.float32)
        shift = torch.atanh(offset / half_l)
        return torch.tanh(z + shift) * half_l - offset

    def _half_width(self) -> torch.Tensor:
        return torch.div(self._levels, 2, rounding_mode="floor")

    def level_indices_to_indices(self, level_indices: torch.Tensor) -> torch.Tensor:
        return (level_indices * self._basis).sum(dim=-1)

    def indices_to_level_indices(self, indices: torch.Tensor) -> torch.Tensor:
        indices = indices.to(torch.int64).unsqueeze(-1)
        return torch.remainder(torch.div(indices, self._basis, rounding_mode="floor"), self._levels)

    def quantize_bounded(self, bounded: torch.Tensor, clamp: bool = False):
        """fp32 pre-rounding latents (``bound``'s output) -> (fp32 codes, int64 indices).

        The second half of ``forward``, public so training can perturb the bounded latent
        (low-precision robustness noise) without re-implementing rounding and indexing.
        ``clamp`` keeps a perturbed latent inside the outermost levels.
        """
        rounded = bounded.round()  # integers in [-(L//2), (L-1)//2], held in fp32
        half_width = self._half_width().to(torch.float32)
        if clamp:
            top = self._levels.to(torch.float32) - 1 - half_width
            rounded = torch.maximum(torch.minimum(rounded, top), -half_width)
        # the straight-through estimator only where a gradient can flow (two full passes)
        ste = rounded
        if torch.is_grad_enabled() and bounded.requires_grad:
            ste = bounded + (rounded - bounded).detach()
        codes = ste / half_width
        # level indices come from the exact rounded values (not the STE sum, whose fp32
        # value need not be an exact integer); the mixed-radix sum runs in int32
        # (codebook_size < 2**31, checked in __init__) and is widened once at the end
        level_indices = (rounded + half_width).to(torch.int32)
        indices = (level_indices * self._basis.to(torch.int32)).sum(dim=-1, dtype=torch.int32)
        return codes, indices.to(torch.int64)

    # -- public API --------------------------------------------------------------------
    def forward(self, z: torch.Tensor, return_aux: bool = False):
        check_last_dim(z, self.dim, "FSQ")
        orig_dtype = z.dtype
        with fp32_island(z.device.type):
            codes, indices = self.quantize_bounded(self.bound(to_fp32(z)))
        codes = codes.to(orig_dtype)
        if return_aux:
            return codes, indices, {}
        return codes, indices

    def indices_to_codes(self, indices: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``indices[...]`` -> ``codes[..., d]`` in ``dtype`` (computed in integers and fp32)."""
        level_indices = self.indices_to_level_indices(indices)
        half_width = self._half_width()
        codes = (level_indices - half_width).to(torch.float32) / half_width.to(torch.float32)
        return codes.to(dtype)

    def codes_to_indices(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes[..., d]`` on the FSQ grid -> int64 indices (inverse of ``indices_to_codes``)."""
        half_width = self._half_width()
        scaled = (to_fp32(codes) * half_width.to(torch.float32)).round().to(torch.int64)
        return self.level_indices_to_indices(scaled + half_width)

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "FSQ")
