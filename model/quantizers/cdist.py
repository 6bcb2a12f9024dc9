"""``CdistVQ``: nearest-code lookup with exactly the index convention of ``torch.cdist`` + argmin.

Models from the field (``diffusers``' ``VectorQuantizer``, the taming-transformers VQGAN it
descends from) pick a code with ``argmin(torch.cdist(z, codebook))``, in whatever dtype the
model runs in. This module is the fp32 island that replaces that search. To give the
*same* index even where two codes are near-equidistant, it performs the very arithmetic
``torch.cdist`` uses for more than 25 rows or codes (its matrix-multiply path): one matmul
of augmented vectors ``[-2z, |z|^2, 1] . [e, 1, |e|^2]``, clamped at 0, square-rooted (the
square root can merge nearly equal distances, and argmin then takes the lowest index).
It is one fp32 GEMM of ``[N, d+2] x [d+2, K]``: a 16,384 x 8 codebook at 256x256 pixels is
milliseconds, never a Python loop. Inference only: there is no codebook training here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import check_indices, check_last_dim, to_fp32

# torch.cdist switches to its matrix-multiply path when either side has more rows than this
CDIST_MM_THRESHOLD = 25


def cdist_distances(flat: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """Euclidean distances ``[N, K]``, bit-identical to ``torch.cdist(flat, embed)`` (fp32,
    K > 25): the augmented single matmul of ATen's ``_euclidean_dist``."""
    flat_sq = flat.pow(2).sum(dim=-1, keepdim=True)
    embed_sq = embed.pow(2).sum(dim=-1, keepdim=True)
    left = torch.cat([flat.mul(-2), flat_sq, torch.ones_like(flat_sq)], dim=-1)
    right = torch.cat([embed, torch.ones_like(embed_sq), embed_sq], dim=-1)
    return (left @ right.mT).clamp_min(0).sqrt()


class CdistVQ(Fp32StateModule):
    """``CdistVQ(codebook [K, d])``: ``z[..., d]`` -> (nearest codes, indices), fp32 inside.

    Same call contract as ``vqserve.model.quantizers.VQ`` (``forward(z, return_aux)``,
    ``indices_to_codes``, ``check_indices``, ``codebook_size``), so exports and runtimes
    treat it like vqserve's own VQ. Codes are the codebook rows themselves (what a decode
    from indices uses), returned in ``z``'s dtype.
    """

    def __init__(self, codebook: torch.Tensor):
        super().__init__()
        if codebook.ndim != 2:
            raise ValueError(f"a codebook must be [codebook_size, dim], got shape {tuple(codebook.shape)}")
        if codebook.shape[0] <= CDIST_MM_THRESHOLD:
            raise ValueError(f"codebooks of {codebook.shape[0]} codes are not supported: torch.cdist "
                             f"uses another kernel below {CDIST_MM_THRESHOLD + 1} codes, so its ties "
                             "could not be reproduced exactly")
        self.codebook_size, self.dim = (int(n) for n in codebook.shape)
        self.register_buffer("embed", codebook.detach().to(torch.float32).clone())

    def extra_repr(self) -> str:
        return f"codebook_size={self.codebook_size}, dim={self.dim}, convention=cdist-argmin"

    def forward(self, z: torch.Tensor, return_aux: bool = False):
        check_last_dim(z, self.dim, "VQ")
        with fp32_island(z.device.type):
            z32 = to_fp32(z)
            embed = to_fp32(self.embed)
            indices = cdist_distances(z32.reshape(-1, self.dim), embed).argmin(dim=-1)
            codes = F.embedding(indices, embed).view_as(z32)
        indices = indices.view(z.shape[:-1])
        codes = codes.to(z.dtype)
        return (codes, indices, {}) if return_aux else (codes, indices)

    def indices_to_codes(self, indices: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return F.embedding(indices.to(torch.int64), to_fp32(self.embed)).to(dtype)

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "VQ")
