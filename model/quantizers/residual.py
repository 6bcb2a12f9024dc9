"""Residual FSQ: a stack of FSQs, each quantizing what the previous ones left over.

Stage i sees the residual scaled up by ``(levels - 1) ** i`` (as in vector-quantize-pytorch),
so later stages resolve finer detail. Indices gain a trailing ``num_quantizers`` axis.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import check_indices, to_fp32
from vqserve.model.quantizers.fsq import FSQ


class ResidualFSQ(Fp32StateModule):
    """``ResidualFSQ(levels, num_quantizers)``: indices ``[..., num_quantizers]``."""

    def __init__(self, levels: Sequence[int], num_quantizers: int):
        super().__init__()
        if num_quantizers < 1:
            raise ValueError(f"num_quantizers must be >= 1, got {num_quantizers}")
        self.levels = [int(level) for level in levels]
        self.num_quantizers = num_quantizers
        self.layers = torch.nn.ModuleList(FSQ(self.levels) for _ in range(num_quantizers))
        self.dim = len(self.levels)
        self.codebook_size = self.layers[0].codebook_size
        levels_t = torch.tensor(self.levels, dtype=torch.int64)
        # integer bases; the fp32 scales are computed inside the island
        self.register_buffer("_levels_minus_1", levels_t - 1, persistent=False)

    def extra_repr(self) -> str:
        return f"levels={self.levels}, num_quantizers={self.num_quantizers}"

    def _scale(self, i: int) -> torch.Tensor:
        return self._levels_minus_1.to(torch.float32) ** (-i)

    def forward(self, z: torch.Tensor, return_aux: bool = False):
        orig_dtype = z.dtype
        with fp32_island(z.device.type):
            residual = to_fp32(z)
            total = torch.zeros_like(residual)
            all_indices = []
            for i, layer in enumerate(self.layers):
                scale = self._scale(i)
                codes, indices = layer(residual / scale)
                codes = codes * scale
                residual = residual - codes.detach()
                total = total + codes
                all_indices.append(indices)
            indices = torch.stack(all_indices, dim=-1)
        codes = total.to(orig_dtype)
        if return_aux:
            return codes, indices, {}
        return codes, indices

    def indices_to_codes(self, indices: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if indices.shape[-1] != self.num_quantizers:
            raise ValueError(
                f"ResidualFSQ expects indices[..., {self.num_quantizers}], got shape {tuple(indices.shape)}"
            )
        total = None
        for i, layer in enumerate(self.layers):
            codes = layer.indices_to_codes(indices[..., i]) * self._scale(i)
            total = codes if total is None else total + codes
        return total.to(dtype)

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "ResidualFSQ")
