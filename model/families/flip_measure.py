"""The shared half of the ``*_precision`` modules: how many tokens a family flips in bf16/fp16.

Each imported family has its own *naive* path (the original code cast with
``model.to(dtype)``, quantizer included), because that is where families differ; what they
share is vqserve's served path (``VqservePath``), the count against the fp32 indices
(``flip_rates_of``), the photo crop (``load_photo``) and the command line (``main``), so the
figures in docs/MODELS.md are measured the same way for every family.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import numpy as np
import torch

from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.mixed_precision import low_precision_encoder
from vqserve.model.tokenizer import pixels_to_float

FlipRates = Callable[[torch.nn.Module, torch.Tensor, str], dict[str, float]]


class VqservePath:
    """vqserve's path: the encoder in ``dtype`` (residual stream in fp32 unless
    ``fp32_stream=False``), the quantizer in fp32, as exports and the eager runtime run it."""

    def __init__(self, tokenizer, dtype: str | torch.dtype, fp32_stream: bool | None = None):
        self.pixel_range = tokenizer.pixel_range
        self.encoder, _ = low_precision_encoder(tokenizer.encoder, dtype, fp32_stream)
        self.quantizer = tokenizer.quantizer

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        latents = self.encoder(pixels_to_float(images, self.pixel_range))
        return self.quantizer(latents.permute(0, 2, 3, 1))[1]


def flip_rates_of(paths: dict[str, Callable[[torch.Tensor], torch.Tensor]], tokenizer,
                  images: torch.Tensor) -> dict[str, float]:
    """Fraction of all tokens that differ from ``tokenizer.encode`` (fp32) for each path;
    images run one at a time, as a server batch of one would."""
    flips = dict.fromkeys(paths, 0)
    total = 0
    for image in images.split(1):
        ref = tokenizer.encode(image)
        total += ref.numel()
        for name, path in paths.items():
            flips[name] += int((path(image) != ref).sum())
    return {name: count / total for name, count in flips.items()}


def load_photo(path: str, size: int) -> np.ndarray:
    """Resize the shorter side to ``size`` (bicubic) and centre-crop a square, like LlamaGen."""
    from PIL import Image

    with Image.open(path) as img:
        img = img.convert("RGB")
        scale = size / min(img.size)
        img = img.resize((max(size, round(img.width * scale)), max(size, round(img.height * scale))),
                         Image.BICUBIC)
        left, top = (img.width - size) // 2, (img.height - size) // 2
        return np.asarray(img.crop((left, top, left + size, top + size)))


def add_measure_args(parser: argparse.ArgumentParser) -> None:
    """``--size``, ``--dtype`` and ``--json``: the same for every family's measurement."""
    parser.add_argument("--size", type=int, default=256, help="square crop side in pixels (default 256)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="low precision (default bf16)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def main(argv: list[str] | None, family: str, label: str, description: str | None,
         flip_rates: FlipRates) -> int:
    """``python -m vqserve.model.families.{family}_precision --model DIR --photos ...``: print
    (and with ``--json`` write) each path's flip rate on an imported ``label`` directory."""
    parser = argparse.ArgumentParser(prog=f"python -m vqserve.model.families.{family}_precision",
                                     description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"an imported {label} directory (vqserve import {family})")
    parser.add_argument("--photos", nargs="+", required=True, help="image files")
    add_measure_args(parser)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    images = torch.from_numpy(np.stack([load_photo(p, args.size) for p in args.photos]))
    rates = flip_rates(tokenizer, images, args.dtype)
    result = {"model": args.model, "dtype": args.dtype, "photos": len(args.photos), "size": args.size,
              "tokens": int(images.shape[0] * (args.size // tokenizer.factor) ** 2), "flip_rate": rates}
    for name, rate in rates.items():
        print(f"{name:>22}: {100 * rate:.2f}% of tokens differ from fp32 ({args.dtype})")
    write_json(args.json, result)
    return 0
