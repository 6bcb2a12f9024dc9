"""How many tokens a diffusers VQModel flips in bf16/fp16: run naively vs served by vqserve.

For each published architecture (tests/fixtures/families), a random-initialised VQModel
(codebook drawn from its own latents of scikit-image photographs, tests/diffusers_models.py)
encodes held-out photographs four ways, each compared with diffusers' own fp32 indices:

* ``naive``: the original model cast wholesale (``model.to(dtype)``), pixels in ``dtype``,
  diffusers' own quantizer (its ``cdist`` in ``dtype``): what a plain script does;
* ``naive_cast+fp32_island``: the same cast networks, but vqserve's fp32 quantizer island;
* ``vqserve``: vqserve's served path (``EagerRuntime``: fp32 residual stream, only residual
  branch convolutions in ``dtype``, fp32 island).

Random weights make this a demonstration of the mechanism, not a figure for trained
weights. Usage (docs/MODELS.md)::

    python scripts/measure_family_bf16.py --photos DIR/*/contents/images/2560x1600.jpg \
        --size 384x240 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.diffusers_models import (  # noqa: E402
    PUBLISHED,
    oracle_indices,
    published_config,
    random_vqmodel,
    save_vqmodel,
    to_diffusers_pixels,
)
from vqserve.export.runtime import EagerRuntime  # noqa: E402
from vqserve.model.precision import parse_dtype  # noqa: E402


def load_photos(paths: list[str], size: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.open(p).convert("RGB").resize(size, Image.LANCZOS)) for p in paths])


def codebook_photos() -> np.ndarray:
    from skimage import data

    return np.stack([getattr(data, n)()[:64, :64, :3] for n in ("astronaut", "coffee", "chelsea", "rocket")])


def naive_indices(model, photos: np.ndarray, dtype: torch.dtype, island: bool) -> np.ndarray:
    """The original model cast wholesale; its own quantizer, or vqserve's fp32 one."""
    from vqserve.model.families.codebook import CdistVQ

    cast = model.to(dtype)
    out = []
    with torch.no_grad():
        for image in photos:
            h = cast.encode(to_diffusers_pixels(image[None]).to(dtype)).latents
            if island:
                vq = CdistVQ(model.quantize.embedding.weight.float())
                idx = vq(h.permute(0, 2, 3, 1))[1]
            else:
                idx = cast.quantize(h)[2][2].view(h.shape[0], h.shape[2], h.shape[3])
            out.append(idx.numpy())
    model.float()
    return np.concatenate(out)


def measure(name: str, photos: np.ndarray, dtypes: list[str], workdir: Path) -> dict:
    model = random_vqmodel(published_config(name), codebook_photos())
    path = save_vqmodel(model, workdir / name)
    ref = np.concatenate([oracle_indices(model, p[None]) for p in photos])
    row = {"model": name, "positions": int(ref.size), "distinct_codes_fp32": int(len(np.unique(ref)))}
    for dtype in dtypes:
        torch_dtype = parse_dtype(dtype)
        served = EagerRuntime(path, dtype=dtype)
        ours = np.concatenate([served.encode(p[None]) for p in photos]).astype(np.int64)
        row[dtype] = {
            "naive_flips": float(np.mean(naive_indices(model, photos, torch_dtype, False) != ref)),
            "naive_cast+fp32_island_flips": float(np.mean(naive_indices(model, photos, torch_dtype, True) != ref)),
            "vqserve_flips": float(np.mean(ours != ref)),
        }
        print(name, dtype, row[dtype], flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", nargs="+", required=True, help="held-out photographs (files)")
    ap.add_argument("--size", default="384x240", help="WxH each photo is resized to (multiples of 16)")
    ap.add_argument("--models", nargs="+", default=list(PUBLISHED), choices=PUBLISHED)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w, h = (int(v) for v in args.size.lower().split("x"))
    photos = load_photos(args.photos, (w, h))
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, photos, args.dtypes, Path(tmp)) for name in args.models]
    if args.json:
        Path(args.json).write_text(json.dumps({"photos": args.photos, "size": args.size, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
