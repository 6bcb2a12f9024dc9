"""How many tokens an IBQ tokenizer flips in bf16: run naively vs through vqserve.

"Naively" is ``model.to(torch.bfloat16)``: the encoder runs in bf16 *and* IBQ's index rule
(``max(softmax(z . codebook))``) runs in bf16. With 8 significant bits, the probabilities of
many codes round to the same value and ``max`` keeps the lowest index among them, so the
search itself flips tokens. vqserve keeps the rule in fp32 (``SoftmaxMaxVQ``) and, by
default, the encoder's residual stream in fp32. Each path is compared with the fp32 indices,
which equal the original code's (tests/integration/families/test_ibq.py)::

    python -m vqserve.model.families.ibq.precision --model DIR --photos A.jpg B.jpg ... [--size 256]
"""

from __future__ import annotations

import copy
import sys

import torch

from vqserve.model.families.flip_measure import VqservePath, flip_rates_of
from vqserve.model.families.flip_measure import main as measure_main
from vqserve.model.precision import parse_dtype
from vqserve.model.quantizers.softmax_max import softmax_max_index
from vqserve.model.tokenizer import pixels_to_float


class NaivePath:
    """The whole encoder cast to ``dtype``, and IBQ's rule on the cast latents and codebook
    (``fp32_island=True``: vqserve's fp32 rule on the same latents instead)."""

    def __init__(self, tokenizer, dtype: str | torch.dtype, fp32_island: bool = False):
        dtype = parse_dtype(dtype)
        self.pixel_range = tokenizer.pixel_range
        self.encoder = copy.deepcopy(tokenizer.encoder).to(dtype).eval()
        self.quantizer = tokenizer.quantizer
        self.codebook = tokenizer.quantizer.embedding.to(dtype)
        self.fp32_island = fp32_island

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(pixels_to_float(images, self.pixel_range))
        if self.fp32_island:
            return self.quantizer(latents.permute(0, 2, 3, 1))[1]
        return softmax_max_index(latents, self.codebook)


def flip_rates(tokenizer, images: torch.Tensor, dtype: str | torch.dtype = "bf16") -> dict[str, float]:
    """Fraction of all tokens that differ from fp32 per path, images one at a time:
    ``naive``, ``vqserve_island_only`` (cast encoder, fp32 rule), ``vqserve`` (as served)."""
    paths = {"naive": NaivePath(tokenizer, dtype), "vqserve_island_only": NaivePath(tokenizer, dtype, True),
             "vqserve": VqservePath(tokenizer, dtype)}
    return flip_rates_of(paths, tokenizer, images)


def main(argv: list[str] | None = None) -> int:
    return measure_main(argv, "ibq", "IBQ", __doc__, flip_rates)


if __name__ == "__main__":
    sys.exit(main())
