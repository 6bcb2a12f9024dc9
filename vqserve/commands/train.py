"""Train a tokenizer from a YAML/JSON config, with command-line overrides.

Precision is handled by the one precision policy: bf16 trains under autocast with no
GradScaler, fp16 under autocast with a GradScaler, fp32 plain; the quantizer is fp32 in
all three. Checkpoints go to OUT/last atomically; `--resume` continues from there.

Examples:
  vqserve train --config configs/default.yaml                  # the first default (v1)
  vqserve train --config configs/default.yaml --device cuda    # same recipe on a GPU
  vqserve train --data ~/photos --crop-size 128 --steps 20000 --precision bf16 --out runs/mine
  vqserve train --config configs/default.yaml --resume          # continue a killed run
  vqserve train --config configs/default-v6-decoder.yaml --init-from default --data ~/photos \
      --device cpu --steps 2000 --lr 1e-4 --out runs/tuned       # fine-tune the default's decoder
                                                                 # on your photos: tokens stay the same
"""

from __future__ import annotations

import argparse
import json


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or JSON training config (CLI flags override it; "
                                          "flags left out keep its values, else the built-in "
                                          "defaults of TrainConfig in vqserve.training.config)")
    g = parser.add_argument_group("data")
    g.add_argument("--data", help="'builtin' (skimage.data train split), 'photos:train' (plus the "
                                  "Debian package photographs: `make data`) or an image folder (recursive)")
    g.add_argument("--val-data", help="'builtin:val', 'photos:select', an image folder, or '' for no validation")
    g.add_argument("--crop-size", type=int, help="training crop size (multiple of the factor)")
    g.add_argument("--batch-size", type=int, help="training crops per step")
    g.add_argument("--sampling", choices=["uniform", "area"],
                   help="draw training images in proportion to their area (default) or equally often")
    g.add_argument("--smooth-fraction", type=float,
                   help="share of training crops replaced by synthetic smooth patches (a flat colour "
                        "with a gentle gradient and grain, in the crop's mean colour), e.g. 0.25")
    g = parser.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, help="optimiser steps to train for")
    g.add_argument("--lr", type=float, help="peak learning rate (AdamW)")
    g.add_argument("--lr-schedule", choices=["cosine", "constant", "linear"],
                   help="learning-rate decay after warm-up")
    g.add_argument("--warmup-steps", type=int, help="steps of linear learning-rate warm-up")
    g.add_argument("--block-mean-weight", type=float,
                   help="weight of the L1 loss on factor x factor block means (colour fidelity)")
    g.add_argument("--block-chroma-weight", type=float,
                   help="weight of an extra L1 on the block means' chroma (R-G, B-(R+G)/2): "
                        "makes a tint on neutral areas cost more than a brightness error")
    g.add_argument("--init-from", help="fine-tune: start from this tokenizer's weights ('default' or a "
                                       "checkpoint directory with the same model settings); the "
                                       "optimizer and schedule start fresh")
    g.add_argument("--freeze-encoder", action="store_true", default=None,
                   help="with --init-from: train only the decoder, so every image keeps exactly the "
                        "tokens the starting tokenizer gives (a better decoder for existing tokens)")
    g.add_argument("--change-dither", action="store_true", default=None,
                   help="with --init-from a tokenizer rounded with another dither: do it anyway, "
                        "knowing its tokens will mean something else (refused otherwise)")
    g = parser.add_argument_group("model")
    g.add_argument("--quantizer", choices=["fsq", "lfq", "vq", "rfsq"],
                   help="finite scalar, lookup-free, vector or residual FSQ quantization")
    g.add_argument("--levels", type=_int_list, help="FSQ levels, e.g. 8,8,8,5,5,5")
    g.add_argument("--channels", type=_int_list,
                   help="encoder/decoder widths per stage, e.g. 64,128,256 (factor = patch_size * 2**stages)")
    g.add_argument("--factor", type=int, choices=[4, 8, 16],
                   help="downsampling factor; trims or extends --channels to log2(factor) stages")
    g.add_argument("--num-res-blocks", type=int, help="residual blocks per encoder/decoder stage")
    g.add_argument("--patch-size", type=int, choices=[1, 2, 4],
                   help="pixel-unshuffle stem: factor = patch_size * 2**len(channels)")
    g.add_argument("--norm", choices=["group", "pixel"],
                   help="GroupNorm (whole-image statistics) or per-pixel norm (size-independent)")
    g.add_argument("--dither", choices=["none", "bayer4"],
                   help="FSQ rounding: plain, or through a subtractive 4x4 ordered dither so slow "
                        "gradients do not band (tokens then depend on position modulo 4)")
    g = parser.add_argument_group("low-precision robustness (FSQ)")
    g.add_argument("--margin", type=float,
                   help="keep bounded latents this far from rounding boundaries (e.g. 0.15)")
    g.add_argument("--margin-weight", type=float, help="weight of the margin term (0 disables)")
    g.add_argument("--margin-start", type=float,
                   help="fraction of training before the margin term switches on (e.g. 0.5)")
    g.add_argument("--margin-ramp", type=float, help="fraction of training to ramp its weight up")
    g.add_argument("--quant-noise", type=float, help="uniform noise half-width before rounding")
    g.add_argument("--latent-tv-weight", type=float,
                   help="rate proxy: weight of the L1 between neighbouring bounded latents, so "
                        "neighbouring tokens agree more often and cost a prior fewer bits (0 = off)")
    g = parser.add_argument_group("runtime")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="training precision (autocast; the quantizer always runs in fp32)")
    g.add_argument("--device", help="cpu or cuda")
    g.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    g.add_argument("--seed", type=int, help="random seed (weights, crops, order)")
    g.add_argument("--out", help="run directory (checkpoints, metrics.jsonl, plots)")
    g.add_argument("--val-every", type=int, help="validate every N steps")
    g.add_argument("--ckpt-every", type=int, help="checkpoint to OUT/last every N steps")
    g.add_argument("--ckpt-minutes", type=float,
                   help="also checkpoint when this many minutes have passed")
    g.add_argument("--log-every", type=int, help="append to metrics.jsonl every N steps")
    g.add_argument("--resume", action="store_true", help="continue from OUT/last if it exists")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--json", action="store_true", help="print the final summary as JSON")


_FLAT = ["data", "val_data", "crop_size", "sampling", "smooth_fraction", "batch_size", "steps", "lr", "lr_schedule", "warmup_steps",
         "init_from", "freeze_encoder", "change_dither", "block_mean_weight", "block_chroma_weight",
         "margin", "margin_weight", "margin_start", "margin_ramp", "quant_noise", "latent_tv_weight", "precision", "device", "threads", "seed", "out",
         "val_every", "ckpt_every", "ckpt_minutes", "log_every"]
_MODEL = ["quantizer", "levels", "channels", "num_res_blocks", "patch_size", "norm", "dither"]


def build_config(args: argparse.Namespace):
    from vqserve.training.config import TrainConfig, load_config_file

    data = load_config_file(args.config) if args.config else {}
    model = dict(data.pop("model", {}) or {})
    for key in _FLAT:
        value = getattr(args, key, None)
        if value is not None:
            data[key] = value
    for key in _MODEL:
        value = getattr(args, key, None)
        if value is not None:
            model[key] = value
    if args.factor is not None:
        patch = int(model.get("patch_size") or 1)
        if args.factor < 2 * patch:
            raise ValueError(f"--factor {args.factor} needs at least one stage after the patch-size {patch} "
                             f"stem (factor >= {2 * patch})")
        stages = (args.factor // patch).bit_length() - 1  # log2: factor = patch * 2**stages
        channels = list(model.get("channels") or TrainConfig().model["channels"])
        while len(channels) < stages:
            channels.append(channels[-1])
        model["channels"] = channels[:stages]
    if args.no_progress:
        data["progress"] = False
    data["model"] = model
    return TrainConfig.from_dict(data)


def run(args: argparse.Namespace) -> int:
    from vqserve.training.trainer import Trainer

    cfg = build_config(args)
    trainer = Trainer(cfg, resume=args.resume)
    if trainer.skipped:
        print(f"[train] skipped {len(trainer.skipped)} unreadable image file(s)")
    summary = trainer.run()
    summary["skipped_images"] = len(trainer.skipped)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"trained {summary['step']} steps in {summary['train_seconds']:.0f} s; "
              f"val PSNR {summary.get('val_psnr', float('nan')):.2f} dB, "
              f"utilization {summary.get('val_utilization', 0):.1%}; saved {summary['final']}")
    return 0
