"""Finite Scalar Quantization (Mentzer et al. 2023), index-compatible with vector-quantize-pytorch.

Each channel d is bounded with tanh to ``levels[d]`` values and rounded; the index is the
mixed-radix number with the first level as the least significant digit. Everything from
the bound to the index runs in fp32/int64: in bf16 an index such as 1001 cannot even be
represented (failure 2 in docs/DESIGN.md).

``dither="bayer4"`` makes the rounding a *subtractive ordered dither*: each latent position
(y, x) adds its own offset in (-1/2, 1/2) of a level before rounding (a 4x4 Bayer pattern,
shifted differently for each channel), and the code handed to the decoder is the rounded
value *minus* that offset. A flat region between two levels then alternates codes instead
of snapping to one, so a slow gradient no longer decodes as a staircase of bands
(docs/TRAINING.md, "the flat-colour staircase"). The price: a code's value depends on its
position modulo 4, so tokens are read with the grid's top-left at (0, 0) and a crop of a
token grid decodes the same only when cut at multiples of 4 positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vqserve.model.config import DITHERS
from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import check_indices, check_last_dim, to_fp32

_EPS = 1e-3  # the same bound slack as vector-quantize-pytorch, so indices agree exactly

_BAYER4 = ((0, 8, 2, 10), (12, 4, 14, 6), (3, 11, 1, 9), (15, 7, 13, 5))  # ranks 0..15
# per-channel (row, column) shifts of the pattern, so channels do not dither in step
_CHANNEL_SHIFTS = ((0, 0), (2, 2), (1, 3), (3, 1), (0, 2), (2, 0), (1, 1), (3, 3))


def bayer4_ranks(dim: int) -> torch.Tensor:
    """int64 ``[4, 4, dim]``: the Bayer rank (0..15) of each position for each channel."""
    base = torch.tensor(_BAYER4, dtype=torch.int64)
    shifts = [_CHANNEL_SHIFTS[c % len(_CHANNEL_SHIFTS)] for c in range(dim)]
    return torch.stack([torch.roll(base, shifts=s, dims=(0, 1)) for s in shifts], dim=-1)


class FSQ(Fp32StateModule):
    """``FSQ(levels)``: ``q(z[..., len(levels)]) -> (codes, indices)``.

    Codes are in [-1, 1] (``round(bounded) / (L // 2)``), in z's dtype; indices are int64.
    All constants are integer buffers; the float ones are derived inside the fp32 island,
    so casting the module to bf16/fp16 cannot change them.
    """

    def __init__(self, levels: Sequence[int], dither: str = "none"):
        super().__init__()
        if dither not in DITHERS:
            raise ValueError(f"FSQ dither must be one of {DITHERS}, got {dither!r}")
        self.dither = dither
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
        self.register_buffer("_dither_ranks", bayer4_ranks(self.dim), persistent=False)

    def extra_repr(self) -> str:
        extra = f", dither={self.dither}" if self.dither != "none" else ""
        return f"levels={self.levels}, codebook_size={self.codebook_size}{extra}"

    def dither_offsets(self, like: torch.Tensor) -> torch.Tensor:
        """fp32 ``[h, w, d]`` dither offsets for ``like[..., h, w, d]`` (callers apply them
        only when ``dither != "none"``).

        Computed from the positions with integer ops (arange, remainder, gather), so every
        exported format rebuilds the pattern for whatever size it is given."""
        if like.dim() < 3:
            raise ValueError(f"a dithered FSQ needs positions: [..., h, w, {self.dim}], got shape {tuple(like.shape)}")
        h, w = like.shape[-3], like.shape[-2]
        ys = torch.remainder(torch.arange(h, device=like.device), 4)
        xs = torch.remainder(torch.arange(w, device=like.device), 4)
        ranks = self._dither_ranks[ys][:, xs]  # [h, w, d]
        return (ranks.to(torch.float32) + 0.5) / 16.0 - 0.5

    # -- fp32 pieces -------------------------------------------------------------------
    def bound(self, z: torch.Tensor) -> torch.Tensor:
        """Map fp32 ``z`` into the open box of each level: the pre-rounding latent (with the
        dither offset added, so rounding boundaries and margins are where rounding is)."""
        levels = self._levels.to(torch.float32)
        half_l = (levels - 1) * (1 + _EPS) / 2
        offset = torch.where(self._levels % 2 == 0, 0.5, 0.0).to(torch.float32)
        shift = torch.atanh(offset / half_l)
        bounded = torch.tanh(z + shift) * half_l - offset
        if self.dither != "none":
            bounded = bounded + self.dither_offsets(z)
        return bounded

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
        if clamp or self.dither != "none":
            top = self._levels.to(torch.float32) - 1 - half_width
            rounded = torch.maximum(torch.minimum(rounded, top), -half_width)
        # the straight-through estimator only where a gradient can flow (two full passes)
        ste = rounded
        if torch.is_grad_enabled() and bounded.requires_grad:
            ste = bounded + (rounded - bounded).detach()
        if self.dither != "none":
            ste = ste - self.dither_offsets(bounded)  # subtractive: the decoder sees no offset
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
        values = (level_indices - half_width).to(torch.float32)
        if self.dither != "none":
            values = values - self.dither_offsets(values)
        codes = values / half_width.to(torch.float32)
        return codes.to(dtype)

    def codes_to_indices(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes[..., d]`` on the FSQ grid -> int64 indices (inverse of ``indices_to_codes``)."""
        half_width = self._half_width()
        values = to_fp32(codes) * half_width.to(torch.float32)
        if self.dither != "none":
            values = values + self.dither_offsets(values)
        scaled = values.round().to(torch.int64)
        return self.level_indices_to_indices(scaled + half_width)

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "FSQ")
