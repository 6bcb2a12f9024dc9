#!/usr/bin/env python3
"""How faithfully a tokenizer reproduces *flat* colours: the cause of tints on smooth skies.

A uniform region encodes to one code repeated, and decodes to one flat colour, so the
colours a tokenizer can give a smooth sky are a staircase: the flat colours its code grid
offers. This script encodes a 64x64 uniform image of every grey (0..255) and of
``--colours`` random colours (fixed seed), decodes them, and reports the error of the
centre 32x32 pixels (away from the borders the convolutions pad):

* mean / max |error| per channel: how far the staircase steps are apart;
* tint (``vqserve.model.evaluation.hue_departure``, as `vqserve eval`'s flat-area tint): how
  far a colour moves *off its hue*, what the eye sees as a cast, where a pure brightness
  error is barely noticed.

``--palette`` also decodes every code as a flat 64x64 image (one code repeated) to get
the code grid's *palette*, and reports the same figures for the nearest palette colour of
each test colour: the best any code could do. Close to the encoder's own figures, the code
grid (with this decoder) lacks the colours; far below them, the encoder picks badly. (The
64,000-code default takes ~2 min on 2 vCPU.)

No photograph is involved, so these figures can be used to choose a model without touching
the held-out test photographs.

    python scripts/flat_colours.py default runs/mine/final [--colours 512] [--palette] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch


def flat_images(colours: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(N, 3) uint8 colours (every grey, then random colours) and their 64x64 images."""
    greys = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, 1)
    rand = np.random.default_rng(seed).integers(0, 256, size=(colours, 3), dtype=np.uint8)
    rgb = np.concatenate([greys, rand])
    return rgb, np.broadcast_to(rgb[:, None, None, :], (len(rgb), 64, 64, 3)).copy()


def centre_means(decode_batch, n: int, half: int, batch: int) -> np.ndarray:
    """Mean colour of the centre ``2 * half`` square of ``decode_batch(start, stop)``'s uint8
    NHWC images, for items ``0..n`` in batches; float (n, 3)."""
    out = []
    with torch.no_grad():
        for i in range(0, n, batch):
            rec = decode_batch(i, min(n, i + batch))
            cy, cx = rec.shape[1] // 2, rec.shape[2] // 2
            out.append(rec[:, cy - half:cy + half, cx - half:cx + half].double().mean(dim=(1, 2)).numpy())
    return np.concatenate(out)


def reproduce(tokenizer, images: np.ndarray, batch: int = 32) -> np.ndarray:
    """Mean colour of the centre 32x32 pixels of each decoded image, float (N, 3)."""
    return centre_means(lambda i, j: tokenizer.decode(tokenizer.encode(torch.from_numpy(images[i:j]))),
                        len(images), 16, batch)


def code_palette(tokenizer, grid: int = 8, batch: int = 256) -> np.ndarray:
    """The flat colour of every code: the mean of the centre 16x16 pixels of a ``grid`` x
    ``grid`` map of that one code, decoded; float (codebook_size, 3)."""
    if tokenizer.config.codes_per_position != 1:
        raise SystemExit("--palette needs one code per position (not a residual quantizer)")
    return centre_means(lambda i, j: tokenizer.decode(torch.arange(i, j)[:, None, None].expand(-1, grid, grid)),
                        tokenizer.codebook_size, 8, batch)


def nearest(palette: np.ndarray, rgb: np.ndarray) -> np.ndarray:
    """The palette colour nearest (Euclidean, RGB) to each of ``rgb``."""
    dist = torch.cdist(torch.from_numpy(rgb.astype(np.float64)), torch.from_numpy(palette))
    return palette[dist.argmin(dim=1).numpy()]


def summarise(rgb: np.ndarray, rec: np.ndarray) -> dict:
    from vqserve.model.evaluation import hue_departure

    err = rec - rgb.astype(np.float64)
    tint = hue_departure(err)
    return {"mean_abs_error_rgb": np.abs(err).mean(axis=0).round(2).tolist(),
            "max_abs_error": round(float(np.abs(err).max()), 1),
            "mean_tint": round(float(tint.mean()), 2),
            "max_tint": round(float(tint.max()), 1),
            "tint_over_3": round(float((tint > 3).mean()), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="'default' or tokenizer directories")
    parser.add_argument("--colours", type=int, default=512, help="random colours besides the 256 greys")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--palette", action="store_true",
                        help="also report the nearest colour of the code grid's flat palette (the best any code can do)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per model")
    args = parser.parse_args(argv)
    from vqserve.model.checkpoint import load_tokenizer

    torch.set_num_threads(args.threads)
    rgb, images = flat_images(args.colours)
    for model in args.models:
        tokenizer = load_tokenizer(model).eval()
        rec = reproduce(tokenizer, images)
        row = {"model": model, "greys": summarise(rgb[:256], rec[:256]),
               "colours": summarise(rgb[256:], rec[256:])}
        parts = ["greys", "colours"]
        if args.palette:
            best = nearest(code_palette(tokenizer), rgb)
            row["palette_greys"] = summarise(rgb[:256], best[:256])
            row["palette_colours"] = summarise(rgb[256:], best[256:])
            parts += ["palette_greys", "palette_colours"]
        if args.json:
            print(json.dumps(row))
            continue
        print(model)
        for part in parts:
            s = row[part]
            print(f"  {part:15s} mean |error| R,G,B {s['mean_abs_error_rgb']}  max {s['max_abs_error']}"
                  f"  tint mean {s['mean_tint']} max {s['max_tint']} (>3 levels: {s['tint_over_3']:.1%})")
        for v in (60, 120, 180, 240):
            print(f"    grey {v:3d} -> {rec[v].round(1).tolist()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
