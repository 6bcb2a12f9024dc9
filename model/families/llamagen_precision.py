"""How many tokens a LlamaGen tokenizer flips in bf16/fp16: run naively vs through vqserve.

"Naively" is what a user of the original code gets with ``model.to(torch.bfloat16)``: every
network *and* LlamaGen's quantizer run in bf16, so the l2 normalisation, the distance
matrix and the argmin all see 8 significant bits; on a unit sphere holding 16,384 codes in
8 dimensions, neighbouring codes are closer than that. vqserve's path keeps the quantizer
in fp32 (the island) and, by default, the encoder's residual stream in fp32 too
(``vqserve.model.mixed_precision``). Both are compared with the fp32 indices, which equal
the original code's (tests/test_family_llamagen.py).

    python -m vqserve.model.families.llamagen_precision --model DIR --photos A.jpg B.jpg ... \
        [--size 256] [--dtype bf16] [--json out.json]

Photos are resized (shorter side, bicubic) and centre-cropped to ``--size``, the way
LlamaGen's scripts crop (``center_crop_arr``); use photographs you did not select anything
on. The naive path here is LlamaGen's own arithmetic in the low dtype, op for op; it was
checked to give the same indices as LlamaGen's original ``VQModel`` cast to bf16 on the
test fixtures (docs/MODELS.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F

from vqserve.model.mixed_precision import low_precision_encoder
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


def flip_rates(tokenizer, images: torch.Tensor, dtype: str | torch.dtype = "bf16") -> dict[str, float]:
    """Fraction of all tokens that differ from fp32 for each path (images run one at a time)."""
    paths = {"naive": NaivePath(tokenizer, dtype),
             "vqserve_island_only": VqservePath(tokenizer, dtype, fp32_stream=False),
             "vqserve": VqservePath(tokenizer, dtype)}
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vqserve.model.families.llamagen_precision",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an imported LlamaGen directory (vqserve import llamagen)")
    parser.add_argument("--photos", nargs="+", required=True, help="image files")
    parser.add_argument("--size", type=int, default=256, help="square crop side in pixels (default 256)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="low precision (default bf16)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    from vqserve.model.checkpoint import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    images = torch.from_numpy(np.stack([load_photo(p, args.size) for p in args.photos]))
    rates = flip_rates(tokenizer, images, args.dtype)
    result = {"model": args.model, "dtype": args.dtype, "photos": len(args.photos), "size": args.size,
              "tokens": int(images.shape[0] * (args.size // tokenizer.factor) ** 2), "flip_rate": rates}
    for name, rate in rates.items():
        print(f"{name:>22}: {100 * rate:.2f}% of tokens differ from fp32 ({args.dtype})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
