"""The nearest-code search of transformers' VQ-VAE classes, as a vqserve fp32 island.

transformers' ``JanusVQVAEVectorQuantizer``, ``ChameleonVQVAEVectorQuantizer`` and
``Emu3VQVAEVectorQuantizer`` (transformers 5.x) all pick

    argmin_k  (sum(z**2) + sum(e_k**2)) - 2 * (z . e_k)

over the raw codebook (no l2 normalisation of either side in the search), the first minimum
on ties (``torch.argmin``), in whatever dtype the model runs in. Janus and Chameleon form the
product with ``torch.einsum("bd,dn->bn", z, e.T)``, Emu3 with ``torch.matmul(z, e.T)``; the
order of the additions is the same. ``SquaredDistanceVQ`` performs exactly those ops, in
fp32 with autocast off whatever the input dtype, so its indices are the class's fp32
indices. Not ``addmm``: fusing the ``-2`` into the product rounds differently once the
codes are long (256 dimensions for Chameleon, measured), so the original's three steps stay.

Decoding: Janus' ``get_codebook_entry`` l2-normalises the looked-up codes
(``F.normalize(p=2, dim=-1)``) before ``post_quant_conv``, although its search did not
normalise (LlamaGen's and DeepSeek's own Janus code normalise both); Emu3 decodes the raw
rows; Chameleon has no decoder. ``decode_l2_norm`` reproduces that, so codes (and the
training path's codes) are what the class's ``decode`` feeds its decoder.

Speed and memory: the distance matrix is rows x codes (an Emu3 image of 512x512 pixels is
4,096 positions x 32,768 codes, 512 MB in one product), so eager mode searches fixed chunks
of about 2**20 distances; every row's distances are the same numbers in any chunk (checked
against one product in tests/integration/families/test_transformers.py). Every product has at least two
rows: a one-row product takes a matrix-vector path that may round differently, which would
make a one-position image's token depend on its batch. Traced / exported graphs compute all
rows in one product (a traced loop would be unrolled to the example's size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import check_indices, check_last_dim, to_fp32
from vqserve.model.quantizers.l2_nearest import first_argmin_in_chunks

PRODUCTS = ("einsum", "matmul")


class SquaredDistanceVQ(Fp32StateModule):
    """``SquaredDistanceVQ(codebook_size, dim, product, decode_l2_norm)``: nearest code of ``z[..., dim]``.

    ``embedding`` holds the codebook as the checkpoint stores it (``quantize.embedding.weight``).
    Same call contract as ``vqserve.model.quantizers.VQ``. Inference only.
    """

    def __init__(self, codebook_size: int, dim: int, product: str = "einsum", decode_l2_norm: bool = False):
        super().__init__()
        if codebook_size < 2 or dim < 1:
            raise ValueError(f"SquaredDistanceVQ needs codebook_size >= 2 and dim >= 1, got {codebook_size}, {dim}")
        if product not in PRODUCTS:
            raise ValueError(f"product must be one of {PRODUCTS}, got {product!r}")
        self.codebook_size = int(codebook_size)
        self.dim = int(dim)
        self.product = product
        self.decode_l2_norm = bool(decode_l2_norm)
        self.register_buffer("embedding", torch.zeros(self.codebook_size, self.dim))

    def extra_repr(self) -> str:
        return (f"codebook_size={self.codebook_size}, dim={self.dim}, product={self.product}, "
                f"decode_l2_norm={self.decode_l2_norm}")

    def _argmin(self, flat: torch.Tensor, code_sq: torch.Tensor, codebook_t: torch.Tensor) -> torch.Tensor:
        # the class's own expression, op for op: (|z|^2 + |e|^2) - 2 (z . e)
        flat_sq = torch.sum(flat**2, dim=1, keepdim=True)
        if self.product == "einsum":
            products = torch.einsum("bd,dn->bn", flat, codebook_t)
        else:
            products = torch.matmul(flat, codebook_t)
        return torch.argmin(flat_sq + code_sq - 2 * products, dim=1)

    def nearest(self, flat: torch.Tensor) -> torch.Tensor:
        """First index of the minimal squared distance for each row of ``flat`` (fp32)."""
        codebook = to_fp32(self.embedding)
        return first_argmin_in_chunks(flat, self.codebook_size, self._argmin, torch.sum(codebook**2, dim=1),
                                      codebook.transpose(0, 1))

    def forward(self, z: torch.Tensor, return_aux: bool = False):
        """channel-last ``z[..., dim]`` -> (codes in z's dtype, int64 indices ``z.shape[:-1]``[, {}])."""
        check_last_dim(z, self.dim, "SquaredDistanceVQ")
        with fp32_island(z.device.type):
            indices = self.nearest(to_fp32(z).reshape(-1, self.dim))
            codes = self.indices_to_codes(indices)
        indices = indices.view(z.shape[:-1])
        codes = codes.view(z.shape).to(z.dtype)
        return (codes, indices, {}) if return_aux else (codes, indices)

    def indices_to_codes(self, indices: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """integer indices -> the codes the class's ``decode`` feeds its decoder, channel-last, in ``dtype``."""
        with fp32_island(indices.device.type):
            codes = F.embedding(indices.to(torch.int64), to_fp32(self.embedding))
            if self.decode_l2_norm:
                codes = F.normalize(codes, p=2, dim=-1)
        return codes.to(dtype)

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "SquaredDistanceVQ")
