#!/usr/bin/env python3
"""Why a tokenizer's whole-photo output differs from its tiled output (issue 17 diagnostics).

For each photograph of an image set (default: the model-selection set), prints JSON lines:

* PSNR of the same pixels encoded whole and as independent 64 / 128 / 256-px tiles, and the
  bicubic baseline;
* the same whole image with every GroupNorm's statistics taken over 64 / 128-px regions
  instead of the whole image (``normstats``: if the size effect were only the statistics,
  this would recover the tiled figure);
* the inner 64-px squares decoded as a tile, with 32 / 64 px of real context, and inside the
  whole image (``context``: separates the border effect from the statistics);
* the mean colour error (R, G, B levels) whole and as 64-px tiles; PSNR on smooth and on
  textured 8x8 blocks against bicubic.

    python scripts/diagnose_size_colour.py --model default --images photos:select --threads 1

Never run it on the test set (``heldout``): choices made from it would leak into the test.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch

from vqserve.model import load_tokenizer
from vqserve.model.evaluation import (
    downsample_bicubic_baseline,
    mean_colour_error,
    psnr,
    tiled_round_trip,
)
from vqserve.model.networks import GroupNorm, PixelNorm
from vqserve.training.data import open_source

_STATS = {"size": None, "height": None}   # GroupNorm statistics over size-px regions (None: whole)
_group_forward = GroupNorm.forward


def _regional_group_norm(self: GroupNorm, x: torch.Tensor) -> torch.Tensor:
    size = _STATS["size"]
    if size is None or isinstance(self, PixelNorm):
        return _group_forward(self, x)
    b, c, h, w = x.shape
    k = max(1, size // (_STATS["height"] // h))   # feature pixels per region side
    if h % k or w % k:
        return _group_forward(self, x)
    g = self.num_groups
    xt = x.reshape(b, g, c // g, h // k, k, w // k, k)
    mean = xt.mean(dim=(2, 4, 6), keepdim=True)
    var = xt.var(dim=(2, 4, 6), keepdim=True, unbiased=False)
    y = ((xt - mean) / torch.sqrt(var + self.eps)).reshape(b, c, h, w)
    return y * self.weight[None, :, None, None] + self.bias[None, :, None, None]


def round_trip(tok, img: np.ndarray, stats: int | None = None) -> np.ndarray:
    _STATS["size"], _STATS["height"] = stats, img.shape[0]
    try:
        batch = torch.from_numpy(np.ascontiguousarray(img))[None]
        return tok.decode(tok.encode(batch))[0].numpy()
    finally:
        _STATS["size"] = None


def _crop(img: np.ndarray, multiple: int, side: int) -> np.ndarray:
    h, w = (min(s, side) // multiple * multiple for s in img.shape[:2])
    y, x = (img.shape[0] - h) // 2, (img.shape[1] - w) // 2
    return np.ascontiguousarray(img[y : y + h, x : x + w])


def _db(sq: float) -> float:
    return round(10 * math.log10(255**2 / sq), 2)


def diagnose(tok, name: str, img: np.ndarray) -> dict:
    img = _crop(img, 256 if min(img.shape[:2]) >= 256 else 64, 1024)
    b = torch.from_numpy(img)[None]
    o = img.astype(np.float64)
    whole = round_trip(tok, img)
    base = downsample_bicubic_baseline(b, tok.factor)[0].numpy()
    r: dict = {"name": name, "size": f"{img.shape[1]}x{img.shape[0]}", "whole": round(psnr(b, whole[None]), 2),
               "bicubic": round(psnr(b, base[None]), 2)}
    for t in (64, 128, 256):
        if img.shape[0] % t == 0 and img.shape[1] % t == 0:
            tiled = tiled_round_trip(tok, b, t)
            r[f"tiles{t}"] = round(psnr(b, tiled), 2)
            if t == 64:
                r["mean_error_tiles64"] = [round(v, 1) for v in mean_colour_error(b, tiled)]
    r["normstats"] = {t: round(psnr(b, round_trip(tok, img, t)[None]), 2) for t in (64, 128)}
    r["mean_error_whole"] = [round(v, 1) for v in mean_colour_error(b, whole[None])]
    ctx = {"tile": [], "ctx32": [], "ctx64": [], "whole": []}
    for y in range(64, img.shape[0] - 128, 64):
        for x in range(64, img.shape[1] - 128, 64):
            ref = o[y : y + 64, x : x + 64]
            ctx["whole"].append(((whole[y : y + 64, x : x + 64] - ref) ** 2).mean())
            for m, key in ((0, "tile"), (32, "ctx32"), (64, "ctx64")):
                out = round_trip(tok, img[y - m : y + 64 + m, x - m : x + 64 + m])[m : m + 64, m : m + 64]
                ctx[key].append(((out - ref) ** 2).mean())
    if ctx["tile"]:
        r["context"] = {k: _db(float(np.mean(v))) for k, v in ctx.items()}
    sd = o.mean(-1)[: img.shape[0] // 8 * 8, : img.shape[1] // 8 * 8]
    sd = sd.reshape(img.shape[0] // 8, 8, img.shape[1] // 8, 8).std(axis=(1, 3))
    smooth = np.repeat(np.repeat(sd < 4, 8, 0), 8, 1)
    for label, mask in (("smooth", smooth), ("textured", ~smooth)):
        if mask.any():
            r[label] = {"fraction": round(float(mask.mean()), 3),
                        "psnr": _db(float(((whole - o) ** 2)[mask].mean())),
                        "bicubic": _db(float(((base - o) ** 2)[mask].mean()))}
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--images", default="photos:select", help="never 'heldout'")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.images.startswith("heldout"):
        parser.error("the held-out test photographs are for reporting, not for diagnosis")
    torch.set_num_threads(args.threads)
    GroupNorm.forward = _regional_group_norm
    tok = load_tokenizer(args.model).eval()
    src = open_source(args.images, split="val")
    pairs = list(zip(src.names, src.images, strict=True))[: args.limit or None]
    with torch.no_grad():
        for name, img in pairs:
            print(json.dumps(diagnose(tok, name, img)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
