"""How many tokens an Open-MAGVIT2 tokenizer flips in bf16/fp16: run naively vs through vqserve.

"Naively" is what a user of the original code gets with ``model.to(torch.bfloat16)``: the
encoder runs in bf16 and Open-MAGVIT2's LFQ takes the signs of bf16 latents. Unlike a
nearest-code search, that sign test loses nothing by itself (rounding never changes a sign;
only fp32 subnormals, below bf16's range, round to zero and lose their bit), so vqserve's
fp32 island removes almost no flips here: what flips LFQ tokens is the bf16 *encoder*
moving a latent across zero. vqserve's served path keeps the encoder's residual stream in
fp32 (only the residual-branch convolutions run in bf16, ``vqserve.model.mixed_precision``),
which is where the difference comes from. Each path is compared with the fp32 indices,
which equal the original code's (tests/integration/families/test_magvit2.py)::

    python -m vqserve.model.families.magvit2.precision --model DIR --photos A.jpg B.jpg ... \\
        [--size 256] [--dtype bf16] [--json out.json]

Photos are resized (shorter side, bicubic) and centre-cropped to ``--size``.
"""

from __future__ import annotations

import copy
import sys

import torch

from vqserve.model.families.flip_measure import VqservePath, flip_rates_of
from vqserve.model.families.flip_measure import main as measure_main
from vqserve.model.precision import parse_dtype
from vqserve.model.tokenizer import pixels_to_float


def original_lfq_indices(latents_nchw: torch.Tensor) -> torch.Tensor:
    """Open-MAGVIT2's ``LFQ.forward`` index arithmetic in the latents' own dtype:
    ``where(z > 0, 1, -1)``, then ``sum((q > 0).int() * 2^k)`` over channels k (int32)."""
    z = latents_nchw.permute(0, 2, 3, 1)
    one = torch.ones((), dtype=z.dtype)
    quantized = torch.where(z > 0, one, -one)
    mask = 2 ** torch.arange(z.shape[-1], dtype=torch.int32)
    return ((quantized > 0).int() * mask).sum(dim=-1).to(torch.int64)


class NaivePath:
    """The whole encoder cast to ``dtype`` and the original LFQ on its ``dtype`` latents
    (``fp32_island=True``: vqserve's fp32 LFQ on the same latents instead)."""

    def __init__(self, tokenizer, dtype: str | torch.dtype, fp32_island: bool = False):
        self.pixel_range = tokenizer.pixel_range
        self.encoder = copy.deepcopy(tokenizer.encoder).to(parse_dtype(dtype)).eval()
        self.quantizer = tokenizer.quantizer if fp32_island else None

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(pixels_to_float(images, self.pixel_range))
        if self.quantizer is not None:
            return self.quantizer(latents.permute(0, 2, 3, 1))[1]
        return original_lfq_indices(latents)


def flip_rates(tokenizer, images: torch.Tensor, dtype: str | torch.dtype = "bf16") -> dict[str, float]:
    """Fraction of all tokens that differ from fp32 for each path (images run one at a time):
    ``naive`` (the original cast wholesale), ``vqserve_island_only`` (the same cast encoder,
    vqserve's fp32 LFQ) and ``vqserve`` (as served: fp32 residual stream, fp32 LFQ)."""
    paths = {"naive": NaivePath(tokenizer, dtype),
             "vqserve_island_only": NaivePath(tokenizer, dtype, fp32_island=True),
             "vqserve": VqservePath(tokenizer, dtype)}
    return flip_rates_of(paths, tokenizer, images)


def main(argv: list[str] | None = None) -> int:
    return measure_main(argv, "magvit2", "Open-MAGVIT2", __doc__, flip_rates)


if __name__ == "__main__":
    sys.exit(main())
