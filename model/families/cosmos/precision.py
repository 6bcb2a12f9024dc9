"""How many tokens a Cosmos DI tokenizer flips in bf16: the original cast to bf16 vs vqserve.

"The original cast to bf16" is what Cosmos's own ``ImageTokenizer`` does by default
(``dtype="bfloat16"``): the pixels become bf16, the networks run in bf16, and the FSQ
quantizer receives the bf16 output of ``quant_conv``. Cosmos's FSQ arithmetic itself is then
fp32 (PyTorch promotes ``bf16 latent + fp32 shift`` to fp32), so the damage is done *before*
the quantizer: the latent is rounded to bf16's 8 significant bits, and then rounded again to
an FSQ level. That is failure 2 of docs/DESIGN.md in another place: a bf16 cast before the
rounding that decides the token. vqserve's path keeps ``quant_conv``, the residual stream and
the quantizer in fp32 (only the residual-branch convolutions run in bf16), so the latent
reaches the rounding with fp32 precision.

Paths, each compared with the fp32 indices (which equal Cosmos's, tests/integration/families/test_cosmos.py):

* ``naive``: the whole model in bf16 and Cosmos's FSQ on its bf16 latent (``NaivePath``: its
  indices equal Cosmos's own ``DiscreteImageTokenizer`` cast to bf16, checked by
  scripts/make_cosmos_fixtures.py);
* ``latent_cast_only``: the fp32 network, only the latent rounded to bf16 before Cosmos's FSQ:
  the tokens that the cast before rounding flips on its own;
* ``vqserve_island_only``: the whole network cast to bf16, vqserve's fp32 island;
* ``vqserve``: vqserve's served bf16 path (fp32 stream and island, ``EagerRuntime(dtype="bf16")``).

    python -m vqserve.model.families.cosmos.precision --model DIR [--photos A.jpg ...] [--size 256]
    python -m vqserve.model.families.cosmos.precision --preset DI8x8 --seed 0   # random weights

Without ``--photos`` it uses eight photographs that scikit-image ships (astronaut, chelsea,
coffee, rocket, stereo_motorcycle, hubble_deep_field, immunohistochemistry, retina), resized
(shorter side, bicubic) and centre-cropped to ``--size``.
"""

from __future__ import annotations

import argparse
import copy
import sys

import numpy as np
import torch

from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families.cosmos.family import PRESETS, CosmosTokenizer, deterministic_weights
from vqserve.model.families.flip_measure import VqservePath, add_measure_args, write_json
from vqserve.model.precision import parse_dtype
from vqserve.model.tokenizer import pixels_to_float

SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "stereo_motorcycle", "hubble_deep_field",
                  "immunohistochemistry", "retina")


def original_fsq_indices(z_nchw: torch.Tensor, levels: list[int]) -> torch.Tensor:
    """Cosmos's ``FSQuantizer.forward`` indices for latents in any dtype, written as the
    original computes them: fp32 constants from int32 levels, so ``z + shift`` promotes a
    bf16 ``z`` to fp32 (the FSQ arithmetic is fp32; the damage is in ``z`` itself)."""
    z = z_nchw.permute(0, 2, 3, 1).reshape(z_nchw.shape[0], -1, z_nchw.shape[1])  # b (h w) d
    lv = torch.tensor(levels, dtype=torch.int32)
    basis = torch.cumprod(torch.tensor([1] + levels[:-1]), dim=0, dtype=torch.int32)
    half_l = (lv - 1) * (1 + 1e-3) / 2
    offset = torch.where(lv % 2 == 0, 0.5, 0.0)
    shift = (offset / half_l).atanh()
    bounded = (z + shift).tanh() * half_l - offset
    quantized = bounded + (bounded.round() - bounded)
    half_width = lv // 2
    codes = quantized / half_width
    indices = ((codes * half_width + half_width).float() * basis).sum(dim=-1).to(torch.int32)
    return indices.view(z_nchw.shape[0], *z_nchw.shape[2:]).to(torch.int64)


class NaivePath:
    """The whole model cast to ``dtype`` (``model.to(dtype)``), Cosmos's FSQ on its latent."""

    def __init__(self, tokenizer, dtype: str | torch.dtype):
        self.pixel_range = tokenizer.pixel_range
        self.encoder = copy.deepcopy(tokenizer.encoder).to(parse_dtype(dtype)).eval()
        self.levels = list(tokenizer.quantizer.levels)

    @torch.no_grad()
    def latents(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder(pixels_to_float(images, self.pixel_range))

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return original_fsq_indices(self.latents(images), self.levels)


class LatentCastPath:
    """The fp32 network; only its latent rounded to ``dtype`` before Cosmos's FSQ."""

    def __init__(self, tokenizer, dtype: str | torch.dtype):
        self.tokenizer, self.dtype = tokenizer, parse_dtype(dtype)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        latents = self.tokenizer.encode_latents(pixels_to_float(images, self.tokenizer.pixel_range))
        return original_fsq_indices(latents.to(self.dtype), list(self.tokenizer.quantizer.levels))


def flip_counts(tokenizer, images: torch.Tensor, dtype: str | torch.dtype = "bf16") -> dict:
    """Tokens that differ from fp32 for each path (images one at a time), and how the naive
    path's flips split against vqserve's: ``{"tokens", "distinct_fp32_codes", "flips": {...},
    "naive_only", "vqserve_only"}``."""
    paths = {"naive": NaivePath(tokenizer, dtype), "latent_cast_only": LatentCastPath(tokenizer, dtype),
             "vqserve_island_only": VqservePath(tokenizer, dtype, fp32_stream=False),
             "vqserve": VqservePath(tokenizer, dtype)}
    flips = dict.fromkeys(paths, 0)
    total = naive_only = vqserve_only = 0
    codes: set[int] = set()
    for image in images.split(1):
        ref = tokenizer.encode(image)
        codes.update(ref.unique().tolist())
        total += ref.numel()
        got = {name: path(image) != ref for name, path in paths.items()}
        for name, differs in got.items():
            flips[name] += int(differs.sum())
        naive_only += int((got["naive"] & ~got["vqserve"]).sum())
        vqserve_only += int((got["vqserve"] & ~got["naive"]).sum())
    return {"tokens": total, "distinct_fp32_codes": len(codes), "flips": flips,
            "naive_only": naive_only, "vqserve_only": vqserve_only}


def flip_rates(tokenizer, images: torch.Tensor, dtype: str | torch.dtype = "bf16") -> dict[str, float]:
    """Fraction of all tokens that differ from fp32, per path."""
    counts = flip_counts(tokenizer, images, dtype)
    return {name: n / counts["tokens"] for name, n in counts["flips"].items()}


def square_crop(image: np.ndarray, size: int) -> np.ndarray:
    """Resize the shorter side to ``size`` (bicubic) and centre-crop a square."""
    from PIL import Image

    img = Image.fromarray(np.ascontiguousarray(image[..., :3]))
    scale = size / min(img.size)
    img = img.resize((max(size, round(img.width * scale)), max(size, round(img.height * scale))), Image.BICUBIC)
    left, top = (img.width - size) // 2, (img.height - size) // 2
    return np.asarray(img.crop((left, top, left + size, top + size)))


def skimage_photos(size: int, names: tuple[str, ...] = SKIMAGE_PHOTOS) -> np.ndarray:
    """Photographs scikit-image ships, as uint8 ``[N, size, size, 3]``."""
    from skimage import data

    photos = []
    for name in names:
        image = getattr(data, name)()
        photos.append(square_crop(image[0] if isinstance(image, tuple) else image, size))
    return np.stack(photos)


def load_photos(paths: list[str], size: int) -> np.ndarray:
    from PIL import Image

    out = []
    for path in paths:
        with Image.open(path) as img:
            out.append(square_crop(np.asarray(img.convert("RGB")), size))
    return np.stack(out)


def random_tokenizer(preset: str, seed: int = 0):
    """A published architecture with ``deterministic_weights`` (no trained weights needed)."""

    tokenizer = CosmosTokenizer(PRESETS[preset])
    tokenizer.load_state_dict(deterministic_weights(PRESETS[preset], seed))
    return tokenizer.eval()


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(prog="python -m vqserve.model.families.cosmos.precision",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="an imported Cosmos directory (vqserve import cosmos)")
    which.add_argument("--preset", choices=sorted(PRESETS), help="a published architecture with random weights")
    parser.add_argument("--seed", type=int, default=0, help="weights seed for --preset (default 0)")
    parser.add_argument("--photos", nargs="+", default=None, help="image files (default: scikit-image's photographs)")
    add_measure_args(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.model:

        tokenizer = load_tokenizer(args.model)
    else:
        tokenizer = random_tokenizer(args.preset, args.seed)
    photos = load_photos(args.photos, args.size) if args.photos else skimage_photos(args.size)
    counts = flip_counts(tokenizer, torch.from_numpy(photos), args.dtype)
    result = {"model": args.model or f"{args.preset} (random weights, seed {args.seed})", "dtype": args.dtype,
              "photos": args.photos or list(SKIMAGE_PHOTOS), "size": args.size, **counts}
    for name, n in counts["flips"].items():
        print(f"{name:>20}: {n:6d} / {counts['tokens']} tokens differ from fp32 ({100 * n / counts['tokens']:.2f}%, {args.dtype})")
    print(f"{'naive only':>20}: {counts['naive_only']} tokens the original's cast flips and vqserve does not; "
          f"vqserve only: {counts['vqserve_only']}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
