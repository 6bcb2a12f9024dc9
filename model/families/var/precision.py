"""How many VAR tokens flip in bf16/fp16, per scale: VAR's code cast naively vs served by vqserve.

"Naively" is what a user of VAR's code gets with ``vae.to(torch.bfloat16)``: the encoder *and*
the residual loop - area downsampling, the ``addmm`` search, the bicubic upsampling, the Phi
convolutions, ``f_hat``/``f_rest`` - run in bf16, so a flip at an early scale moves ``f_rest``
and every later scale with it. vqserve's path runs the encoder in the low dtype (residual
stream in fp32, ``vqserve.model.mixed_precision``) and the whole loop as the fp32 island.
Both are compared with the fp32 tokens (which equal VAR's own, tests/integration/families/test_var.py),
scale by scale, coarse to fine::

    python -m vqserve.model.families.var.precision --model DIR --photos A.jpg B.jpg ... \\
        [--size 256] [--dtype bf16] [--json out.json]

Photos go through VAR's validation transform (``vqserve.model.evaluation.model_sized``).
"""

from __future__ import annotations

import argparse
import copy
import sys

import numpy as np
import torch
import torch.nn.functional as F

from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.evaluation import model_sized
from vqserve.model.families.flip_measure import write_json
from vqserve.model.mixed_precision import low_precision_encoder
from vqserve.model.precision import parse_dtype
from vqserve.model.quantizers.multiscale import phi_index
from vqserve.model.tokenizer import pixels_to_float


class NaivePath:
    """VAR's ``img_to_idxBl`` with the whole model in ``dtype``, the residual loop included."""

    def __init__(self, tokenizer, dtype: str | torch.dtype):
        self.dtype = parse_dtype(dtype)
        self.tokenizer = tokenizer
        self.encoder = copy.deepcopy(tokenizer.encoder).to(self.dtype).eval()
        self.codebook = tokenizer.quantizer.embedding.to(self.dtype)
        self.phi = [copy.deepcopy(p).to(self.dtype) for p in tokenizer.quantizer.phi]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        f = self.encoder(pixels_to_float(images, self.tokenizer.pixel_range))
        schedule = self.tokenizer.schedule_for(f)
        B, C, H, W = f.shape
        e = self.codebook
        f_rest, f_hat, out = f.clone(), torch.zeros_like(f), []
        for si, (ph, pw) in enumerate(schedule):
            last = si == len(schedule) - 1
            z = (f_rest if last else F.interpolate(f_rest, size=(ph, pw), mode="area")).permute(0, 2, 3, 1)
            z = z.reshape(-1, C)
            d = torch.sum(z.square(), dim=1, keepdim=True) + torch.sum(e.square(), dim=1)
            idx = torch.argmin(d.addmm_(z, e.T, alpha=-2, beta=1), dim=1)
            h = F.embedding(idx.view(B, ph, pw), e).permute(0, 3, 1, 2)
            h = h.contiguous() if last else F.interpolate(h, size=(H, W), mode="bicubic").contiguous()
            h = self.phi[phi_index(si, len(schedule), len(self.phi))](h) if self.phi else h
            f_hat.add_(h)
            f_rest.sub_(h)
            out.append(idx.reshape(B, ph * pw))
        return torch.cat(out, 1)


class ServedPath:
    """vqserve's path: the encoder in ``dtype`` as exports and the eager runtime run it, the loop in fp32."""

    def __init__(self, tokenizer, dtype: str | torch.dtype, fp32_stream: bool | None = None):
        self.tokenizer = tokenizer
        self.encoder, _ = low_precision_encoder(tokenizer.encoder, dtype, fp32_stream)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return self.tokenizer.quantize(self.encoder(pixels_to_float(images, self.tokenizer.pixel_range)))[1]


def flip_rates_per_scale(tokenizer, images: torch.Tensor, dtype: str = "bf16") -> dict[str, list[float]]:
    """Per path, each scale's share of tokens that differ from fp32 (images one at a time)."""
    paths = {"naive": NaivePath(tokenizer, dtype), "vqserve_island_only": ServedPath(tokenizer, dtype, False),
             "vqserve": ServedPath(tokenizer, dtype)}
    flips: dict[str, np.ndarray] = {}
    sizes = None
    for image in images.split(1):
        ref = tokenizer.encode(image)
        bounds = tokenizer.token_layout.scale_bounds(ref.shape[1])
        sizes = np.array([e - s for s, e in bounds]) if sizes is None else sizes + [e - s for s, e in bounds]
        for name, path in paths.items():
            diff = (path(image) != ref)[0]
            counts = np.array([int(diff[s:e].sum()) for s, e in bounds])
            flips[name] = flips.get(name, 0) + counts
    return {name: (count / sizes).tolist() for name, count in flips.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vqserve.model.families.var.precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an imported VAR directory (vqserve import var)")
    parser.add_argument("--photos", nargs="+", required=True, help="image files")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    from PIL import Image

    tokenizer = load_tokenizer(args.model)
    images = torch.from_numpy(np.stack([model_sized(tokenizer, np.asarray(Image.open(p).convert("RGB")))
                                        for p in args.photos]))
    rates = flip_rates_per_scale(tokenizer, images, args.dtype)
    for name, per_scale in rates.items():
        print(f"{name:>20} ({args.dtype}): " + " ".join(f"{100 * r:.1f}%" for r in per_scale)
              + "  of tokens differ from fp32, per scale coarse to fine")
    write_json(args.json, {"model": args.model, "dtype": args.dtype, "photos": len(args.photos),
                           "flip_rate_per_scale": rates})
    return 0


if __name__ == "__main__":
    sys.exit(main())
