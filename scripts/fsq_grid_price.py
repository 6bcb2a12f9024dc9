#!/usr/bin/env python3
"""What a finer FSQ code grid would buy in flat colour, and what it would cost in bits/token.

A flat region encodes to one code repeated, so the brightness steps a tokenizer can give a
slow grey gradient are the codes its encoder visits along the grey ramp. A path through an
FSQ grid that is monotone in every channel crosses at most ``1 + sum(L - 1)`` codes (34 for
the default's levels ``[8, 8, 8, 5, 5, 5]``): more flat colours need more levels or an
encoder whose grey path winds through the grid. More levels also make tokens harder to
predict. This script keeps the model's encoder as it is, rounds its latents on other level
layouts, and prints per layout:

* **grey codes** — distinct codes of the 256 flat greys (a 48x48 uniform image each, the
  centre token): the flat greys a decoder can tell apart; more = finer brightness steps;
* **grey steps** — codes visited in turn along the ramp (a code left and entered again counts
  again), beside the monotone-path bound it cannot pass while the path is monotone; steps
  above the codes mean the path wiggles back to a code it had left;
* **held-out bits/token** — `vqserve eval`'s learnability figure (left/up smoothed bigram,
  leave-one-photo-out, ``vqserve.model.learnability``) over the photographs of ``--images``,
  and the unigram's bits.

The rounding is the model's own (``vqserve.model.quantizers.fsq.FSQ``, with its dither), so
the model's own layout gives exactly the tokens ``vqserve tokenize`` writes. Only the
encoder's view is measured: a decoder for another layout would need training. No held-out
photograph is needed; the default ``--images photos:train`` is the training split.

    python scripts/fsq_grid_price.py default --levels 8,8,8,7,7,7 --levels 16,16,16,5,5,5
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np
import torch

GREY_SIDE = 48  # 6x6 tokens at factor 8: the centre token is away from the padded border


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"levels must be comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 3:
        raise argparse.ArgumentTypeError(f"every FSQ level count must be >= 3, got {text!r}")
    return levels


def monotone_path_bound(levels: Sequence[int]) -> int:
    """Most codes a path monotone in every channel can cross: one per rounding boundary, plus one."""
    return 1 + sum(level - 1 for level in levels)


def fsq_latents(tokenizer, images: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """fp32 pre-quantizer latents ``[h, w, d]`` of each image (cropped to a multiple of the factor)."""
    from vqserve.model.tokenizer import pixels_to_float
    from vqserve.training.data import center_crop_multiple

    out = []
    with torch.no_grad():
        for img in images:
            img = torch.tensor(center_crop_multiple(img, tokenizer.factor))  # a copy: sources may be read-only
            x = pixels_to_float(img[None], tokenizer.pixel_range)
            out.append(tokenizer.encode_latents(x)[0].permute(1, 2, 0).float())
    return out


def grey_latents(tokenizer) -> torch.Tensor:
    """fp32 latents ``[256, 1, 1, d]`` of the centre token of each flat grey 0..255."""
    from vqserve.model.tokenizer import pixels_to_float

    greys = torch.arange(256, dtype=torch.uint8)[:, None, None, None].expand(256, GREY_SIDE, GREY_SIDE, 3)
    c = GREY_SIDE // tokenizer.factor // 2
    with torch.no_grad():
        lat = tokenizer.encode_latents(pixels_to_float(greys.contiguous(), tokenizer.pixel_range))
    return lat[:, :, c:c + 1, c:c + 1].permute(0, 2, 3, 1).float()


def price(levels: Sequence[int], dither: str, latents: Sequence[torch.Tensor], greys: torch.Tensor) -> dict:
    """Grey codes and steps, and held-out bits/token, of ``latents`` rounded on ``levels``."""
    from vqserve.model.learnability import held_out_bits, summarise
    from vqserve.model.quantizers.fsq import FSQ

    quantizer = FSQ(levels, dither=dither)
    with torch.no_grad():
        grids = [quantizer(lat)[1].numpy() for lat in latents]
        ramp = quantizer(greys)[1].reshape(-1).numpy()
    row = {"levels": list(levels), "codes": quantizer.codebook_size,
           "grey_codes": len(np.unique(ramp)), "grey_steps": 1 + int((ramp[1:] != ramp[:-1]).sum()),
           "monotone_path_bound": monotone_path_bound(levels), "grids": grids}
    return {**row, **summarise(held_out_bits(grids, quantizer.codebook_size) or [])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="default", help="'default', 'dithered' or a tokenizer directory")
    parser.add_argument("--levels", type=parse_levels, action="append", default=[],
                        help="another FSQ layout to price, e.g. 8,8,8,7,7,7 (repeatable; the model's own is always first)")
    parser.add_argument("--images", default="photos:train",
                        help="photographs for bits/token: 'photos:train', 'photos:select' or a folder (at least two)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    args = parser.parse_args(argv)

    from vqserve.model.checkpoint import load_tokenizer
    from vqserve.model.quantizers.fsq import FSQ
    from vqserve.training.data import open_source

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model).eval()
    own = tokenizer.quantizer
    if not isinstance(own, FSQ):
        parser.error(f"{args.model} quantizes with {type(own).__name__}, not FSQ: there are no levels to change")
    source = open_source(args.images)
    if len(source.images) < 2:
        parser.error(f"--images {args.images} has {len(source.images)} photograph(s); held-out bits need at least two")
    latents, greys = fsq_latents(tokenizer, source.images), grey_latents(tokenizer)
    print(f"{args.model}: encoder as trained, latents rounded on each layout; bits/token over "
          f"{len(source.images)} photographs of {args.images}, leave-one-photo-out")
    print(f"{'levels':24s} {'codes':>9s} {'grey codes':>11s} {'grey steps':>11s} {'monotone bound':>15s} "
          f"{'bits/token':>11s} {'unigram':>8s}")
    for levels in [own.levels, *args.levels]:
        row = price(levels, own.dither, latents, greys)
        print(f"{','.join(map(str, levels)):24s} {row['codes']:9,d} {row['grey_codes']:11d} {row['grey_steps']:11d} "
              f"{row['monotone_path_bound']:15d} {row['bits_per_token']:11.2f} {row['unigram_bits_per_token']:8.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
