"""How many tokens a taming VQGAN (or SBER-MoVQGAN) flips in bf16/fp16: run naively vs through vqserve.

"Naively" is what a user of the original code gets with ``model.to(torch.bfloat16)`` (Meta's
Chameleon ``ImageTokenizer`` casts the VQGAN to the dtype its weights are loaded in): the
encoder *and* ``VectorQuantizer2``'s search, ``sum(z^2) + sum(e^2) - 2 einsum(z, e^T)`` then
argmin, run in bf16, where 8 significant bits leave thousands of codes tied. vqserve keeps the
search in fp32 (``SquaredDistanceVQ``) and, by default, the encoder's residual stream in fp32
too. Each path is compared with the fp32 indices, which equal the original's
(tests/integration/families/test_taming.py, test_movqgan.py)::

    python -m vqserve.model.families.taming.precision --model DIR --photos A.jpg ... [--size 256] [--dtype bf16]

``DIR`` is an imported taming or MoVQGAN directory (the same quantizer, the same naive path).
"""

from __future__ import annotations

import copy
import sys

import torch

from vqserve.model.families.flip_measure import VqservePath, flip_rates_of
from vqserve.model.families.flip_measure import main as measure_main
from vqserve.model.precision import parse_dtype
from vqserve.model.tokenizer import pixels_to_float


def vector_quantizer2_index(z_nchw: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """taming's ``VectorQuantizer2.forward`` search in the dtype of its inputs (no fp32 island)."""
    z = z_nchw.permute(0, 2, 3, 1).contiguous()
    flat = z.view(-1, codebook.shape[1])
    d = torch.sum(flat ** 2, dim=1, keepdim=True) + torch.sum(codebook ** 2, dim=1) - \
        2 * torch.einsum("bd,dn->bn", flat, codebook.t())
    return torch.argmin(d, dim=1).view(z.shape[:-1])


class NaivePath:
    """The encoder cast to ``dtype`` with the original's search on the cast latents and codebook."""

    def __init__(self, tokenizer, dtype: str | torch.dtype):
        dtype = parse_dtype(dtype)
        self.pixel_range = tokenizer.pixel_range
        self.encoder = copy.deepcopy(tokenizer.encoder).to(dtype).eval()
        self.codebook = tokenizer.quantizer.embedding.to(dtype)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return vector_quantizer2_index(self.encoder(pixels_to_float(images, self.pixel_range)), self.codebook)


def flip_rates(tokenizer, images: torch.Tensor, dtype: str | torch.dtype = "bf16") -> dict[str, float]:
    """Fraction of all tokens that differ from fp32 per path, images one at a time: ``naive``,
    ``vqserve_island_only`` (cast encoder, fp32 search), ``vqserve`` (as served)."""
    paths = {"naive": NaivePath(tokenizer, dtype),
             "vqserve_island_only": VqservePath(tokenizer, dtype, fp32_stream=False),
             "vqserve": VqservePath(tokenizer, dtype)}
    return flip_rates_of(paths, tokenizer, images)


def main(argv: list[str] | None = None) -> int:
    return measure_main(argv, "taming", "taming VQGAN / SBER-MoVQGAN", __doc__, flip_rates)


if __name__ == "__main__":
    sys.exit(main())
