"""Lookup-Free Quantization (Yu et al. 2023), index-compatible with vector-quantize-pytorch.

Each of ``dim`` channels becomes one bit (z > 0). Which channel is the most significant
bit is a property of the island (``bit_order``), because published LFQ tokenizers disagree:
vector-quantize-pytorch, vqserve's own models and Show-o/MMaDA's MAGVIT-v2 put channel 0 in
the most significant bit (``"msb_first"``, the default); Open-MAGVIT2 puts it in the least
(``"lsb_first"``). The same latents give other integers under the other order, so the order
travels with the family, never with the caller. The entropy auxiliary loss (low per-sample entropy, high codebook
entropy) is computed in fp32 against a codebook derived from integers: the original
failure 1 was an einsum of bf16 activations with an fp32 codebook.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import (
    check_indices,
    check_last_dim,
    straight_through,
    to_fp32,
)

BIT_ORDERS = ("msb_first", "lsb_first")


def bit_weights(dim: int, bit_order: str) -> torch.Tensor:
    """int64 ``2^k`` per channel: ``[2^(dim-1), ..., 1]`` for ``msb_first``, ``[1, ..., 2^(dim-1)]``
    for ``lsb_first``."""
    if bit_order not in BIT_ORDERS:
        raise ValueError(f"LFQ bit_order must be one of {list(BIT_ORDERS)}, got {bit_order!r}")
    powers = torch.arange(dim - 1, -1, -1, dtype=torch.int64) if bit_order == "msb_first" \
        else torch.arange(dim, dtype=torch.int64)
    return 2 ** powers


def _entropy(prob: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return -(prob * prob.clamp(min=eps).log()).sum(dim=-1)


class LFQ(Fp32StateModule):
    """``LFQ(dim)``: codebook of ``2**dim`` codes in {-1, 1}^dim.

    ``entropy_loss_weight`` and ``diversity_gamma`` shape the aux loss (returned with
    ``return_aux=True`` while training); ``commitment_loss_weight`` adds an L2 pull.
    ``bit_order`` (``"msb_first"`` or ``"lsb_first"``) says which channel is the most
    significant bit of the index (module docstring).
    """

    def __init__(
        self,
        dim: int,
        entropy_loss_weight: float = 0.1,
        diversity_gamma: float = 1.0,
        commitment_loss_weight: float = 0.25,
        inv_temperature: float = 100.0,
        max_entropy_codebook: int = 2**16,
        bit_order: str = "msb_first",
    ):
        super().__init__()
        if not 1 <= dim <= 30:
            raise ValueError(f"LFQ dim must be in [1, 30], got {dim}")
        self.dim = dim
        self.codebook_size = 2**dim
        self.entropy_loss_weight = entropy_loss_weight
        self.diversity_gamma = diversity_gamma
        self.commitment_loss_weight = commitment_loss_weight
        self.inv_temperature = inv_temperature
        self.bit_order = bit_order
        self.register_buffer("mask", bit_weights(dim, bit_order), persistent=False)
        if self.codebook_size <= max_entropy_codebook:
            codebook = self.indices_to_codes(torch.arange(self.codebook_size))
            self.register_buffer("codebook", codebook, persistent=False)
        else:
            self.codebook = None  # entropy loss needs the full codebook; skipped when huge

    def extra_repr(self) -> str:
        return f"dim={self.dim}, codebook_size={self.codebook_size}, bit_order={self.bit_order}"

    def forward(self, z: torch.Tensor, return_aux: bool = False):
        check_last_dim(z, self.dim, "LFQ")
        orig_dtype = z.dtype
        aux: dict[str, torch.Tensor] = {}
        with fp32_island(z.device.type):
            z32 = to_fp32(z)
            positive = self.bits(z32)
            quantized = torch.where(positive, 1.0, -1.0).to(torch.float32)
            indices = (positive.to(torch.int64) * self.mask).sum(dim=-1)
            codes = straight_through(z32, quantized) if self.training else quantized
            if return_aux and self.training:
                aux = self._aux_losses(z32, quantized)
        codes = codes.to(orig_dtype)
        if return_aux:
            return codes, indices, aux
        return codes, indices

    def bits(self, z32: torch.Tensor) -> torch.Tensor:
        """Which channels are bit 1: ``z > 0`` (0, -0 and NaN give 0). A family whose original
        tests another fp32 expression overrides only this."""
        return z32 > 0

    def _aux_losses(self, z32: torch.Tensor, quantized: torch.Tensor) -> dict[str, torch.Tensor]:
        aux: dict[str, torch.Tensor] = {}
        flat = z32.reshape(-1, self.dim)
        if self.codebook is not None and self.entropy_loss_weight > 0:
            codebook = to_fp32(self.codebook)  # fp32 whatever dtype the buffer was given
            logits = 2 * flat @ codebook.t() * self.inv_temperature
            prob = logits.softmax(dim=-1)
            per_sample = _entropy(prob).mean()
            codebook_entropy = _entropy(prob.mean(dim=0))
            aux["entropy"] = self.entropy_loss_weight * (per_sample - self.diversity_gamma * codebook_entropy)
        if self.commitment_loss_weight > 0:
            aux["commitment"] = self.commitment_loss_weight * F.mse_loss(z32, quantized.detach())
        return aux

    def indices_to_codes(self, indices: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        bits = (indices.to(torch.int64).unsqueeze(-1) & self.mask) != 0
        return torch.where(bits, 1.0, -1.0).to(dtype)

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "LFQ")
