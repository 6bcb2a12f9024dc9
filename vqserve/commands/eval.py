"""Measure a tokenizer: PSNR, SSIM, codebook use, and bf16/fp16 index agreement with fp32.

Each image is centre-cropped to a multiple of the factor, encoded and decoded in fp32
eager (PSNR, SSIM, codebook utilization / entropy / perplexity), and encoded again in
bf16 and fp16 (quantizer fp32, as always) two ways: the encoder as serving and exports run
it (the residual stream stays fp32 in bf16 and fp16, vqserve.model.mixed_precision) and the whole
encoder under autocast, as training runs it. Agreement is the fraction of tokens identical
to the fp32 ones. The baseline is area-downsample x factor then bicubic upsample of the
same images.

`--images builtin` uses the validation photographs of the built-in split (never trained on).

Examples:
  vqserve eval --model default --images builtin
  vqserve eval --model runs/mine/final --images ~/photos --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' or a checkpoint directory")
    parser.add_argument("--images", default="builtin",
                        help="an image folder (recursive), 'builtin' (validation photographs) "
                             "or 'builtin:train'")
    parser.add_argument("--precisions", default="bf16,fp16",
                        help="low precisions to compare with fp32 (comma-separated; '' for none)")
    parser.add_argument("--limit", type=int, default=0, help="evaluate at most this many images")
    parser.add_argument("--max-side", type=int, default=0,
                        help="centre-crop images to at most this many pixels per side (0: whole image)")
    parser.add_argument("--no-channels-last", action="store_true",
                        help="run convolutions in contiguous (NCHW) layout instead of channels_last")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _load_images(spec: str, limit: int, max_side: int):
    from vqserve.model.data import open_source

    src = open_source(spec, split="val")
    images, names = src.images, src.names
    if max_side:
        images = [_centre(img, max_side) for img in images]
    if limit:
        images, names = images[:limit], names[:limit]
    if not images:
        raise ValueError(f"no readable images in {spec!r} ({len(src.skipped)} skipped)")
    return images, names, src.skipped


def _centre(img, side: int):
    h, w = img.shape[:2]
    hh, ww = min(h, side), min(w, side)
    y, x = (h - hh) // 2, (w - ww) // 2
    return img[y : y + hh, x : x + ww]


def run(args: argparse.Namespace) -> int:
    import torch

    from vqserve.model import load_tokenizer
    from vqserve.model.evaluation import evaluate_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for p in precisions:
        if p not in ("bf16", "fp16"):
            raise ValueError(f"--precisions takes bf16 and/or fp16, got {p!r}")
    tok = load_tokenizer(args.model, device=args.device)
    images, names, skipped = _load_images(args.images, args.limit, args.max_side)
    result = evaluate_tokenizer(tok, images, names, precisions=precisions,
                                channels_last=not args.no_channels_last)
    result["model"] = str(args.model)
    result["images_source"] = args.images
    result["skipped_images"] = len(skipped)
    result["channels_last"] = not args.no_channels_last
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=False, default=_num))
        return 0
    _print_table(result, precisions, sys.stdout)
    return 0


def _num(v):
    return float(v)


def _print_table(r: dict, precisions: list[str], out) -> None:
    cb = r["codebook"]
    print(f"model {r['model']}  images {r['images']} ({r['images_source']}, "
          f"{r['skipped_images']} skipped)  factor {r['factor']}  codebook {r['codebook_size']}", file=out)
    rows = [("PSNR (fp32 eager)", f"{r['psnr']:.2f} dB"),
            ("baseline area x{f} + bicubic".format(f=r["factor"]), f"{r['baseline_psnr']:.2f} dB"),
            ("SSIM", f"{r['ssim']:.4f}"),
            ("codebook utilization", f"{cb['utilization']:.2%} ({cb['used_codes']} of {cb['codebook_size']} "
                                     f"codes, {cb['positions']} tokens)"),
            ("entropy", f"{cb['entropy_bits']:.2f} of {cb['max_entropy_bits']:.2f} bits"),
            ("perplexity", f"{cb['perplexity']:.0f}")]
    for p in precisions:
        a = r["agreement"][p]
        rows.append((f"{p} vs fp32 index agreement", f"{a:.3%} ({_flips(a, cb['positions'])} tokens differ; "
                                                     "as served and exported)"))
    for p in precisions:
        a = r["agreement_autocast"][p]
        rows.append((f"{p} autocast vs fp32", f"{a:.3%} ({_flips(a, cb['positions'])} tokens differ; "
                                             "whole encoder under autocast, as in training)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)
    print(f"  {'per image':<{width}}", file=out)
    for img in r["per_image"]:
        extra = "  ".join(f"{p} {img[f'agreement_{p}']:.2%}" for p in precisions)
        print(f"    {img['name'][-40:]:<40} {img['width']}x{img['height']}  PSNR {img['psnr']:.2f}  "
              f"(baseline {img['baseline_psnr']:.2f})  SSIM {img['ssim']:.3f}  {extra}", file=out)


def _flips(agreement: float, n: int) -> int:
    return int(round((1 - agreement) * n)) if not math.isnan(agreement) else -1
