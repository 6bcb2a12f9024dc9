"""LlamaGen's nearest-code quantizer as a vqserve fp32 island: same indices, in any compute dtype.

LlamaGen's ``VectorQuantizer`` (inference path) l2-normalises the latent and every codebook
row (``F.normalize``, p=2, eps 1e-12), computes ``d = (|z|^2 + |e|^2) - 2 z.e`` and takes
the first minimum (``argmin``). It does this in whatever dtype the model runs in, and on a
unit sphere with 16,384 codes in 8 dimensions neighbouring codes are close: a bf16 latent or
distance matrix flips tokens. Here the same formula, in the same order of operations, always
runs in fp32 with autocast off, whatever the input dtype, so indices equal the original
model's fp32 indices; codes are the normalised rows, as LlamaGen's ``get_codebook_entry``
returns them.

Speed: the search is one fused matrix product (``addmm``: rows x dim @ dim x codes, added
to the squared norms), never a Python loop over codes. In eager mode the rows are processed
in fixed chunks of about 2**20 distances (64 rows for 16,384 codes), so the distance matrix
stays in cache and memory does not grow with the image (about 2x faster than one product
at 1,024+ positions, docs/MODELS.md); traced/exported graphs compute all rows in one product (a traced loop
would be unrolled to the example's size). Every product has at least two rows: a one-row
product takes a matrix-vector path that rounds differently, which would make the token of
a one-position image depend on how it was batched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import check_indices, check_last_dim, to_fp32

CHUNK_DISTANCES = 2**20  # distances per eager chunk (4 MB of fp32)


def in_graph_capture() -> bool:
    """Inside torch.jit.trace or torch.compile/export: one product, no Python loop to unroll."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def first_argmin_in_chunks(flat: torch.Tensor, codebook_size: int, argmin, *tables: torch.Tensor) -> torch.Tensor:
    """``argmin(rows, *tables)`` (a nearest-code search) for every row of ``flat``, in eager
    mode over fixed chunks of about ``CHUNK_DISTANCES`` distances, in traced / exported graphs
    in one product; every product has at least two rows (the module docstring says why).
    Shared by the imported families' searches, which differ only in their distance expression."""
    n = flat.shape[0]
    padded = torch.cat([flat, flat[:1]])
    if in_graph_capture():
        return argmin(padded, *tables)[:n]
    rows = max(2, CHUNK_DISTANCES // codebook_size)
    chunks = list(padded.split(rows))
    if chunks[-1].shape[0] == 1:  # keep every product at >= 2 rows
        chunks[-2:] = [torch.cat(chunks[-2:])]
    return torch.cat([argmin(c, *tables) for c in chunks])[:n]


class L2NearestCode(Fp32StateModule):
    """``L2NearestCode(codebook_size, dim, l2_norm=True)``: LlamaGen's nearest code of ``z[..., dim]``.

    ``embedding`` holds the codebook as the checkpoint stores it (not normalised); the
    normalisation is recomputed in fp32 on every call, exactly as the original does.
    Inference only: there is no training path (imported models are served, not trained).
    """

    def __init__(self, codebook_size: int, dim: int, l2_norm: bool = True):
        super().__init__()
        if codebook_size < 2 or dim < 1:
            raise ValueError(f"L2NearestCode needs codebook_size >= 2 and dim >= 1, got {codebook_size}, {dim}")
        self.codebook_size = int(codebook_size)
        self.dim = int(dim)
        self.l2_norm = bool(l2_norm)
        self.register_buffer("embedding", torch.zeros(self.codebook_size, self.dim))

    def extra_repr(self) -> str:
        return f"codebook_size={self.codebook_size}, dim={self.dim}, l2_norm={self.l2_norm}"

    def codebook(self) -> torch.Tensor:
        """The codebook as the distances see it: fp32, l2-normalised when ``l2_norm``."""
        embed = to_fp32(self.embedding)
        return F.normalize(embed, p=2, dim=-1) if self.l2_norm else embed

    def nearest(self, flat: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
        """First index of the minimum of ``(|z|^2 + |e|^2) - 2 z.e`` per row of ``flat`` (fp32)."""
        return first_argmin_in_chunks(flat, self.codebook_size, self._argmin, codebook.pow(2).sum(dim=1),
                                      codebook.t())

    @staticmethod
    def _argmin(flat: torch.Tensor, code_norms: torch.Tensor, codebook_t: torch.Tensor) -> torch.Tensor:
        # (|z|^2 + |e|^2) + (-2)(z @ e^T) in one fused product: scaling by -2 is exact, so each
        # distance is rounded exactly as the original's ``(a + b) - 2 * (z @ e^T)``
        # (tests/integration/families/test_llamagen.py compares with the unfused formula), with one
        # [rows, codes] tensor written instead of three
        return torch.addmm(flat.pow(2).sum(dim=1, keepdim=True) + code_norms, flat, codebook_t,
                           alpha=-2).argmin(dim=1)

    def forward(self, z: torch.Tensor, return_aux: bool = False):
        """channel-last ``z[..., dim]`` -> (codes in z's dtype, int64 indices ``z.shape[:-1]``[, {}])."""
        check_last_dim(z, self.dim, "L2NearestCode")
        with fp32_island(z.device.type):
            flat = to_fp32(z).reshape(-1, self.dim)
            if self.l2_norm:
                flat = F.normalize(flat, p=2, dim=-1)
            codebook = self.codebook()
            indices = self.nearest(flat, codebook)
            codes = F.embedding(indices, codebook)
        indices = indices.view(z.shape[:-1])
        codes = codes.view(z.shape).to(z.dtype)
        return (codes, indices, {}) if return_aux else (codes, indices)

    def indices_to_codes(self, indices: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """integer indices -> codebook rows (normalised when ``l2_norm``), channel-last, in ``dtype``."""
        return F.embedding(indices.to(torch.int64), self.codebook()).to(dtype)

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "L2NearestCode")
