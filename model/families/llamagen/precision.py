"""How many tokens a LlamaGen tokenizer flips in bf16/fp16: run naively vs through vqserve.

"Naively" is what a user of the original code gets with ``model.to(torch.bfloat16)``: every
network *and* LlamaGen's quantizer run in bf16, so the l2 normalisation, the distance
matrix and the argmin all see 8 significant bits; on a unit sphere holding 16,384 codes in
8 dimensions, neighbouring codes are closer than that. vqserve's path keeps the quantizer
in fp32 (the island) and, by default, the encoder's residual stream in fp32 too
(``vqserve.model.mixed_precision``). Both are compared with the fp32 indices, which equal
the original code's (tests/integration/families/test_llamagen.py).

    python -m vqserve.model.families.llamagen.precision --model DIR --photos A.jpg B.jpg ... \
        [--size 256] [--dtype bf16] [--json out.json]

Photos are resized (shorter side, bicubic) and centre-cropped to ``--size``, the way
LlamaGen's scripts crop (``center_crop_arr``); use photographs you did not select anything
on. The naive path here is LlamaGen's own arithmetic in the low dtype, op for op; it was
checked to give the same indices as LlamaGen's original ``VQModel`` cast to bf16 on the
test fixtures (docs/MODELS.md).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F

from vqserve.model.families.flip_measure import (  # load_photo: re-exported, fixture scripts use it
    VqservePath,
    flip_rates_of,
    load_photo,  # noqa: F401
)
from vqserve.model.families.flip_measure import main as measure_main
from vqserve.model.precision import parse_dtype
from vqserve.model.tokenizer import pixels_to_float


def naive_nearest(z_nhwc: torch.Tensor, embedding: torch.Tensor, l2_norm: bool) -> torch.Tensor:
    """LlamaGen's ``VectorQuantizer`` search in the dtype of its inputs (no fp32 island)."""
    flat = z_nhwc.reshape(-1, embedding.shape[1])
    if l2_norm:
        flat = F.normalize(flat, p=2, dim=-1)
        embedding = F.normalize(embedding, p=2, dim=-1)
    d = flat.pow(2).sum(dim=1, keepdim=True) + embedding.pow(2).sum(dim=1) - 2 * (flat @ embedding.t())
    return d.argmin(dim=1).view(z_nhwc.shape[:-1])


class NaivePath:
    """The whole model cast to ``dtype``, quantizer included, as ``model.to(dtype)`` does."""

    def __init__(self, tokenizer, dtype: str | torch.dtype):
        dtype = parse_dtype(dtype)
        self.pixel_range = tokenizer.pixel_range
        self.encoder = copy.deepcopy(tokenizer.encoder).to(dtype).eval()
        self.embedding = tokenizer.quantizer.embedding.to(dtype)
        self.l2_norm = tokenizer.quantizer.l2_norm

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(pixels_to_float(images, self.pixel_range))
        return naive_nearest(latents.permute(0, 2, 3, 1), self.embedding, self.l2_norm)


def flip_rates(tokenizer, images: torch.Tensor, dtype: str | torch.dtype = "bf16") -> dict[str, float]:
    """Fraction of all tokens that differ from fp32 for each path (images run one at a time)."""
    paths = {"naive": NaivePath(tokenizer, dtype),
             "vqserve_island_only": VqservePath(tokenizer, dtype, fp32_stream=False),
             "vqserve": VqservePath(tokenizer, dtype)}
    return flip_rates_of(paths, tokenizer, images)


def main(argv: list[str] | None = None) -> int:
    return measure_main(argv, "llamagen", "LlamaGen", __doc__, flip_rates)


if __name__ == "__main__":
    sys.exit(main())
