"""Measure a tokenizer: PSNR, SSIM, codebook use, and bf16/fp16 index agreement with fp32.

Each image is centre-cropped to a multiple of the factor (a multi-scale model such as VAR: resized
and centre-cropped to its 256x256 schedule, VAR's own validation transform, with agreement also
reported per scale, coarse to fine), encoded and decoded in fp32
eager (PSNR, SSIM, codebook utilization / entropy / perplexity), and encoded again in
bf16 and fp16 (quantizer fp32, as always) two ways: the encoder as serving and exports run
it (the residual stream stays fp32 in bf16 and fp16, vqserve.model.mixed_precision) and the whole
encoder under autocast, as training runs it. Agreement is the fraction of tokens identical
to the fp32 ones. The baseline is area-downsample x factor then bicubic upsample of the
same images.

The decision margins (vqserve.model.ties: for FSQ the bounded latent's distance to the
nearest rounding boundary in levels, relative score gaps otherwise) give the share of tokens
below 1e-4 and 1e-5: tokens two correct fp32 machines may round differently.

Each image is also encoded as independent 128-pixel tiles (`--tile`): a tokenizer whose
output depends on the image size scores differently whole and tiled. The mean colour error
per channel (mean of reconstruction minus mean of original, in levels) shows a colour cast
that PSNR hides; the tint on flat areas (skies, walls: 32-px squares that vary by at most 4
levels) shows the hue change a viewer sees there even when the photograph's mean barely
moves. `--out DIR` writes one PNG per image: original | reconstruction | bicubic.
Batch invariance (`--batch N`, default 4): the images, cropped to one size (at most 256
px a side), encoded one at a time and as one batch of N must give identical tokens; the
count of tokens that differ is printed (0 when invariant). The encode speed (images and
megapixels per second, one image per call, in fp32 and each precision as served) names the
CPU and thread count it was measured on.
The issue-17 targets (PSNR 0.5 dB over the baseline, colour error under 3 levels on every
photo, whole within 0.2 dB of tiled, bf16 agreement 99.5 %) are checked at the end.

Image sets: `builtin` (scikit-image's chelsea + coffee, never trained on), `photos:select`
(the model-selection set: those two + two MATE photographs; `make data`), `heldout` (the
test set: KDE photographs from `make data` + matplotlib's and scikit-learn's sample
photographs; never trained or selected on), `heldout:pip` (only the pip packages' three),
or a folder.

Examples:
  vqserve eval --model default --images heldout --out /tmp/eval-default
  vqserve eval --model runs/mine/final --images ~/photos --json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (the shipped tokenizer), 'dithered' (the shipped dithered one) or a model directory (vqserve checkpoint, "
                        "diffusers VQModel, imported LlamaGen: docs/MODELS.md)")
    parser.add_argument("--images", default="builtin",
                        help="an image folder (recursive), 'builtin' (validation photographs), "
                             "'builtin:train', 'photos:select' (model selection), 'heldout' (test set: "
                             "KDE + matplotlib + scikit-learn photographs) or 'heldout:pip'")
    parser.add_argument("--tile", type=int, default=128,
                        help="also encode each image as independent tiles of this size (0: skip)")
    parser.add_argument("--out", help="write original | reconstruction | bicubic PNGs (and eval.json) "
                                      "into this folder (created if needed)")
    parser.add_argument("--overwrite", action="store_true", help="replace files already in --out")
    parser.add_argument("--precisions", default="bf16,fp16",
                        help="low precisions to compare with fp32 (comma-separated; '' for none)")
    parser.add_argument("--limit", type=int, default=0, help="evaluate at most this many images")
    parser.add_argument("--max-side", type=int, default=0,
                        help="centre-crop images to at most this many pixels per side (0: whole image)")
    parser.add_argument("--no-channels-last", action="store_true",
                        help="run convolutions in contiguous (NCHW) layout instead of channels_last")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    parser.add_argument("--no-learnability", action="store_true",
                        help="skip the learnability figures (shift equivariance at 1-3 token shifts, "
                             "token-grid crop cost, per-photo perplexity, held-out bits per token: "
                             "3 extra encodes and 2 decodes per image)")
    parser.add_argument("--batch", type=int, default=4,
                        help="check batch invariance: tokens at batch 1 and at this batch must be identical "
                             "(0: skip)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _load_images(spec: str, limit: int, max_side: int):
    from vqserve.training.data import open_source

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
    if args.batch < 0:
        raise ValueError(f"--batch must be 0 (skip) or a batch size, got {args.batch}")
    tok = load_tokenizer(args.model, device=args.device)
    if args.tile < 0 or (args.tile and args.tile % tok.factor):
        raise ValueError(f"--tile must be 0 or a positive multiple of the factor {tok.factor}, got {args.tile}")
    images, names, skipped = _load_images(args.images, args.limit, args.max_side)
    out = _prepare_out(args.out, names, args.overwrite) if args.out else None
    result = evaluate_tokenizer(tok, images, names, precisions=precisions,
                                channels_last=not args.no_channels_last, tile=args.tile,
                                on_image=_png_writer(out, names) if out else None,
                                learnability=not args.no_learnability, invariance_batch=args.batch)
    result["model"] = str(args.model)
    result["images_source"] = args.images
    result["skipped_images"] = len(skipped)
    result["channels_last"] = not args.no_channels_last
    if out:
        (out / "eval.json").write_text(json.dumps(result, indent=2, default=_num) + "\n")
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=False, default=_num))
        return 0
    _print_table(result, precisions, sys.stdout)
    return 0


def _num(v):
    return float(v)


def _png_name(index: int, name: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).stem)[-48:]
    return f"{index:02d}-{stem}.png"


def _prepare_out(folder: str, names: list[str], overwrite: bool) -> Path:
    """Create ``folder``; refuse (before any work) to replace files unless ``overwrite``."""
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {folder!r} exists and is not a folder")
    targets = [out / _png_name(i, n) for i, n in enumerate(names)] + [out / "eval.json"]
    existing = [p for p in targets if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"--out {folder!r} already holds {existing[0].name} (and {len(existing) - 1} more of "
                         "this run's files); pass --overwrite or choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _png_writer(out: Path, names: list[str]):
    from PIL import Image

    from vqserve.model.evaluation import side_by_side

    index = {n: i for i, n in enumerate(names)}

    def write(name, original, reconstruction, baseline):
        panels = [original, reconstruction] + ([baseline] if baseline is not None else [])
        Image.fromarray(side_by_side(*panels)).save(out / _png_name(index[name], name))

    return write


def _print_table(r: dict, precisions: list[str], out) -> None:
    cb = r["codebook"]
    print(f"model {r['model']}  images {r['images']} ({r['images_source']}, "
          f"{r['skipped_images']} skipped)  factor {r['factor']}  codebook {r['codebook_size']}"
          + (f"  dither {r['dither']}" if r.get("dither", "none") != "none" else ""), file=out)
    if r.get("decodes") is False:  # an encode-only model: no reconstruction figures
        print("  encode-only model: no decoder, so no PSNR, SSIM or colour figures", file=out)
        rows = []
    else:
        rows = [("PSNR (fp32 eager)", f"{r['psnr']:.2f} dB"),
                ("baseline area x{f} + bicubic".format(f=r["factor"]), f"{r['baseline_psnr']:.2f} dB"),
                ("SSIM", f"{r['ssim']:.4f} (baseline {r['baseline_ssim']:.4f})")]
    if "tiled_psnr" in r:
        rows.append((f"PSNR as {r['tile']}-px tiles", f"{r['tiled_psnr']:.2f} dB (whole minus tiled "
                                                      f"{r['psnr'] - r['tiled_psnr']:+.2f} dB)"))
    if "max_abs_mean_error" in r:
        rows += [("worst mean colour error", f"{r['max_abs_mean_error']:.1f} levels (largest |recon - original| "
                                               "channel mean over the images)"),
                 ("worst tint on flat areas", f"{r['max_flat_tint']:.1f} levels (skies, walls: 90th percentile over "
                                              "flat 32-px squares of a hue change; brightness excluded)")]
    rows += [("codebook utilization", f"{cb['utilization']:.2%} ({cb['used_codes']} of {cb['codebook_size']} "
                                     f"codes, {cb['positions']} tokens)"),
            ("entropy", f"{cb['entropy_bits']:.2f} of {cb['max_entropy_bits']:.2f} bits"),
            ("perplexity", f"{cb['perplexity']:.0f}")]
    for p in precisions:
        a = r["agreement"][p]
        rows.append((f"{p} vs fp32 index agreement", f"{a:.3%} ({_flips(a, cb['positions'])} tokens differ; "
                                                     "as served and exported)"))
    for key, shares in (r.get("agreement_per_scale") or {}).items():  # a pyramid, coarse to fine
        if not key.endswith("_autocast"):
            rows.append((f"{key} per scale", " ".join(f"{a:.2%}" for a in shares)))
    for p in precisions:
        a = r["agreement_autocast"][p]
        rows.append((f"{p} autocast vs fp32", f"{a:.3%} ({_flips(a, cb['positions'])} tokens differ; "
                                             "whole encoder under autocast, as in training)"))
    if "margins" in r:
        m = r["margins"]
        rows.append(("tokens near a boundary", ", ".join(
            f"{m['below'][k]} ({m['share_below'][k]:.2e}) below {k}" for k in m["below"])
            + f" of {m['tokens']}; smallest margin {m['min']:.1e} (fp32 ties: another machine may "
              "round these otherwise)"))
    rows += _invariance_and_speed_rows(r)
    rows += _learnability_rows(r.get("learnability") or {})
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)
    print(f"  {'per image':<{width}}  " + ("index agreement per precision" if r.get("decodes") is False else
          "PSNR (baseline, tiled)  SSIM (baseline)  mean colour error R,G,B  tint on flat areas (their share)"),
          file=out)
    for img in r["per_image"]:
        extra = "  ".join(f"{p} {img[f'agreement_{p}']:.2%}" for p in precisions)
        if "psnr" not in img:  # an encode-only model
            print(f"    {img['name'][-32:]:<32} {img['width']}x{img['height']}  {extra}{_learn_cell(img)}", file=out)
            continue
        tiled = f", {img['tiled_psnr']:.2f}" if "tiled_psnr" in img else ""
        colour = ",".join(f"{v:+.1f}" for v in img["mean_error_rgb"])
        print(f"    {img['name'][-32:]:<32} {img['width']}x{img['height']}  {img['psnr']:.2f} "
              f"({img['baseline_psnr']:.2f}{tiled})  {img['ssim']:.3f} ({img['baseline_ssim']:.3f})  "
              f"{colour}  tint {img['flat_tint']:.1f} ({img['flat_share']:.0%})  {extra}{_learn_cell(img)}",
              file=out)
    print("  targets (issue 17; they are set for whole held-out photographs):", file=out)
    for name, t in r["targets"].items():
        print(f"    {'ok  ' if t['ok'] else 'MISS'} {name} = {t['value']:.4g}", file=out)


def _invariance_and_speed_rows(r: dict) -> list[tuple[str, str]]:
    """Batch invariance (yes/no and the count), speed per precision on this machine."""
    rows = []
    b = r.get("batch_invariance")
    if b:
        verdict = "yes" if b["identical"] else f"NO: {b['differing_tokens']} of {b['tokens']} tokens differ"
        rows.append(("batch invariant (fp32)", f"{verdict} (batch 1 vs batch {b['batch']}, "
                                               f"{b['width']}x{b['height']})"))
    speed = r.get("images_per_second") or {}
    if speed:
        mpx = r.get("megapixels_per_second") or {}
        m = r.get("machine") or {}
        rows.append(("encode speed", ", ".join(f"{k} {v:.2f} img/s ({mpx.get(k, 0):.2f} MP/s)"
                                               for k, v in speed.items())
                     + f"; one image per call on {m.get('cpu', '?')}, {m.get('threads', '?')} threads"))
    return rows


def _learn_cell(img: dict) -> str:
    shift = img.get("shift_equivariance", {}).get("1")
    bits = img.get("bits_per_token")
    return ((f"  shift1 {shift:.1%}" if shift is not None else "")
            + (f"  {bits:.2f} bits/token" if bits is not None else ""))


def _learnability_rows(learn: dict) -> list[tuple[str, str]]:
    """The learnability totals (model/learnability.py) as table rows; none when not measured."""
    rows = []
    for s, v in (learn.get("shift_equivariance") or {}).items():
        rows.append((f"unchanged by a {s}-token shift", f"{v['mean']:.1%} of interior tokens (worst photo "
                                                        f"{v['min']:.1%})"))
    for k, v in (learn.get("crop_cost_db") or {}).items():
        rows.append((f"grid cropped by {k} token(s)", f"{v['mean']:+.2f} dB (worst {v['worst']:+.2f}) vs "
                                                      "cropping the decoded image"))
    if "bits_per_token" in learn:
        rows.append(("held-out bits per token", f"{learn['bits_per_token']:.2f} (left/up bigram, leave one "
                                                f"photo out; context saves {learn['context_saves_bits']:.2f})"))
    return rows


def _flips(agreement: float, n: int) -> int:
    return int(round((1 - agreement) * n)) if not math.isnan(agreement) else -1
