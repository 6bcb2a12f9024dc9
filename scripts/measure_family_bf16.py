"""How many tokens a model family flips in bf16/fp16: the original run naively vs served by vqserve.

For each published architecture (diffusers VQModels: tests/fixtures/families; transformers'
Janus / Emu3 / Chameleon VQ-VAEs: their config classes' defaults,
tests/fixtures/transformers/models.py), a random-initialised model (codebook drawn from its
own latents of scikit-image photographs) encodes held-out photographs four ways, each
compared with the original library's own fp32 indices:

* ``naive``: the original model cast wholesale (``model.to(dtype)``), pixels in ``dtype``,
  the library's own quantizer (diffusers' ``cdist``, transformers' squared distances, in
  ``dtype``): what a plain script does;
* ``naive_cast+fp32_island``: the same cast networks, but vqserve's fp32 quantizer island;
* ``vqserve``: vqserve's served path (``EagerRuntime``: fp32 residual stream, only residual
  branch convolutions in ``dtype``, fp32 island).

``--magvit2`` and ``--ibq`` add Open-MAGVIT2's and IBQ's architectures (``measure_magvit2``,
``measure_ibq``), measured the same way.
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
from tests.fixtures.transformers import models as tf_models  # noqa: E402
from vqserve.export.runtimes.loader import EagerRuntime  # noqa: E402
from vqserve.model.precision import parse_dtype  # noqa: E402

# transformers' VQ-VAEs at their published sizes: --transformers name -> config.json model_type
TRANSFORMERS = {"janus": "janus_vqgan", "emu3": "emu3_vqgan", "chameleon": "chameleon_vqgan"}


def load_photos(paths: list[str], size: tuple[int, int]) -> np.ndarray:
    """Files, or ``skimage:NAME`` for a photograph that ships with scikit-image
    (``skimage:stereo_motorcycle`` is its left image)."""
    from PIL import Image

    def open_photo(p: str) -> Image.Image:
        if p.startswith("skimage:"):
            from skimage import data

            image = getattr(data, p.split(":", 1)[1])()
            return Image.fromarray((image[0] if isinstance(image, tuple) else image)[..., :3])
        return Image.open(p)

    return np.stack([np.asarray(open_photo(p).convert("RGB").resize(size, Image.LANCZOS)) for p in paths])


def codebook_photos() -> np.ndarray:
    from skimage import data

    return np.stack([getattr(data, n)()[:64, :64, :3] for n in ("astronaut", "coffee", "chelsea", "rocket")])


def naive_indices(model, photos: np.ndarray, dtype: torch.dtype, island: bool) -> np.ndarray:
    """The original model cast wholesale; its own quantizer, or vqserve's fp32 one."""
    from vqserve.model.quantizers.cdist import CdistVQ

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


def measure_transformers(name: str, photos: np.ndarray, dtypes: list[str], workdir: Path) -> dict:
    """The same four ways for a transformers VQ-VAE (the class's own encode is the oracle)."""
    model_type = TRANSFORMERS[name]
    model = tf_models.random_model(model_type, codebook_photos(), **tf_models.PUBLISHED[model_type])
    path = tf_models.save_model(model, workdir / name)
    ref = np.concatenate([tf_models.oracle_indices(model, model_type, p[None]) for p in photos])
    row = {"model": f"transformers-{name}", "positions": int(ref.size), "distinct_codes_fp32": int(len(np.unique(ref)))}
    for dtype in dtypes:
        torch_dtype = parse_dtype(dtype)
        served = EagerRuntime(path, dtype=dtype)
        ours = np.concatenate([served.encode(p[None]) for p in photos]).astype(np.int64)
        del served
        naive, island = zip(*(tf_models.naive_indices(model, model_type, p[None], torch_dtype) for p in photos),
                            strict=True)
        row[dtype] = {
            "naive_flips": float(np.mean(np.concatenate(naive) != ref)),
            "naive_cast+fp32_island_flips": float(np.mean(np.concatenate(island) != ref)),
            "vqserve_flips": float(np.mean(ours != ref)),
        }
        print(row["model"], dtype, row[dtype], flush=True)
    return row


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


def measure_cosmos(name: str, photos: np.ndarray, dtypes: list[str]) -> dict:
    """A Cosmos DI row: its FSQ never searches a codebook, so "naive" is the original cast to
    ``dtype`` (Cosmos's own FSQ on the cast latent), the island row the same cast network with
    vqserve's fp32 FSQ, and ``latent_cast_only`` the fp32 network with only the latent cast."""
    from vqserve.model.families.cosmos.precision import flip_counts, random_tokenizer

    tokenizer = random_tokenizer(name, seed=0)
    row = {"model": f"cosmos-{name}", "positions": 0, "distinct_codes_fp32": 0}
    for dtype in dtypes:
        counts = flip_counts(tokenizer, torch.from_numpy(photos), dtype)
        rate = {k: v / counts["tokens"] for k, v in counts["flips"].items()}
        row.update(positions=counts["tokens"], distinct_codes_fp32=counts["distinct_fp32_codes"])
        row[dtype] = {"naive_flips": rate["naive"], "naive_cast+fp32_island_flips": rate["vqserve_island_only"],
                      "vqserve_flips": rate["vqserve"], "latent_cast_only_flips": rate["latent_cast_only"],
                      "naive_only": counts["naive_only"], "vqserve_only": counts["vqserve_only"]}
        print(row["model"], dtype, row[dtype], flush=True)
    return row


def measure_magvit2(name: str, photos: np.ndarray, dtypes: list[str], workdir: Path) -> dict:
    """An Open-MAGVIT2 architecture, random-initialised (PyTorch's default init, seed 0) by
    vqserve's rebuild, whose fp32 indices equal the original code's
    (scripts/make_magvit2_fixtures.py full-size): the original cast wholesale (its LFQ on
    the cast latents), the same with vqserve's fp32 LFQ, and the served path (EagerRuntime)."""
    from safetensors.torch import save_file

    from vqserve.model.families.imported import write_config
    from vqserve.model.families.magvit2.family import PRESETS, WEIGHTS_NAME, Magvit2Tokenizer
    from vqserve.model.families.magvit2.precision import NaivePath

    torch.manual_seed(0)
    arch = PRESETS[name]
    tok = Magvit2Tokenizer(arch).eval()
    path = workdir / f"magvit2-{name}"
    path.mkdir()
    write_config(arch, {"random_init": "torch default, seed 0"}, path)
    save_file({k: v.contiguous() for k, v in tok.state_dict().items()}, str(path / WEIGHTS_NAME))
    return _flip_row(f"open-magvit2-{name}", tok, path, NaivePath, photos, dtypes)


def _flip_row(model: str, tok, path: Path, naive_path, photos: np.ndarray, dtypes: list[str]) -> dict:
    """One table row for an imported family saved at ``path``: flips against ``tok``'s fp32
    tokens of the original cast wholesale, the same with vqserve's fp32 island, and the served
    path (``EagerRuntime``), one image at a time (``flip_measure.flip_rates_of``)."""
    from vqserve.model.families.flip_measure import flip_rates_of

    images = torch.from_numpy(photos)
    ref = np.concatenate([tok.encode(p[None]).numpy() for p in images])
    row = {"model": model, "positions": int(ref.size), "distinct_codes_fp32": int(len(np.unique(ref)))}
    for dtype in dtypes:
        served = EagerRuntime(path, dtype=dtype)
        row[dtype] = flip_rates_of({
            "naive_flips": naive_path(tok, dtype),
            "naive_cast+fp32_island_flips": naive_path(tok, dtype, True),
            "vqserve_flips": lambda image, rt=served: torch.from_numpy(rt.encode(image.numpy()).astype(np.int64)),
        }, tok, images)
        print(row["model"], dtype, row[dtype], flush=True)
    return row


def measure_ibq(name: str, photos: np.ndarray, dtypes: list[str], workdir: Path) -> dict:
    """An IBQ architecture (``imagenet-262144``, ``imagenet-16384``, ...), random-initialised by
    vqserve's rebuild (PyTorch's default init, the codebook N(0, 1) as IBQ's nn.Embedding;
    seed 0), whose fp32 indices equal the original code's (make_magvit2_fixtures.py
    ibq-full-size): the original cast wholesale (its softmax search in bf16), the same with
    vqserve's fp32 search, and the served path (EagerRuntime)."""
    from safetensors.torch import save_file

    from vqserve.model.families.ibq.family import PRESETS, WEIGHTS_NAME, IbqTokenizer
    from vqserve.model.families.ibq.precision import NaivePath
    from vqserve.model.families.imported import write_config

    torch.manual_seed(0)
    arch = PRESETS[name]
    tok = IbqTokenizer(arch).eval()
    tok.quantizer.embedding.normal_()
    path = workdir / f"ibq-{name}"
    path.mkdir()
    write_config(arch, {"random_init": "torch default, codebook N(0,1), seed 0"}, path)
    save_file({k: v.contiguous() for k, v in tok.state_dict().items()}, str(path / WEIGHTS_NAME))
    return _flip_row(f"ibq-{name}", tok, path, NaivePath, photos, dtypes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", nargs="+", required=True, help="held-out photographs (files)")
    ap.add_argument("--size", default="384x240", help="WxH each photo is resized to (multiples of 16)")
    ap.add_argument("--models", nargs="*", default=list(PUBLISHED), choices=PUBLISHED)
    ap.add_argument("--cosmos", nargs="+", default=[], choices=["DI8x8", "DI16x16"],
                    help="also these Cosmos DI architectures (deterministic random weights; the original's "
                         "bf16 cast vs vqserve, vqserve.model.families.cosmos.precision); --models with no "
                         "name measures only these")
    ap.add_argument("--magvit2", nargs="+", default=[], choices=["imagenet-256", "imagenet-128"],
                    help="also these Open-MAGVIT2 architectures (random weights; its LFQ has no codebook "
                         "to draw); photos may be skimage:NAME")
    ap.add_argument("--transformers", nargs="+", default=[], choices=list(TRANSFORMERS),
                    help="also these transformers VQ-VAEs at their published sizes (random weights, "
                         "codebooks drawn from their own latents; the class's own encode is the oracle)")
    ap.add_argument("--ibq", nargs="+", default=[], choices=["imagenet-262144", "imagenet-16384", "imagenet-1024"],
                    help="also these IBQ architectures (random weights)")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w, h = (int(v) for v in args.size.lower().split("x"))
    photos = load_photos(args.photos, (w, h))
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, photos, args.dtypes, Path(tmp)) for name in args.models]
        rows += [measure_magvit2(name, photos, args.dtypes, Path(tmp)) for name in args.magvit2]
        rows += [measure_ibq(name, photos, args.dtypes, Path(tmp)) for name in args.ibq]
        rows += [measure_transformers(name, photos, args.dtypes, Path(tmp)) for name in args.transformers]
    rows += [measure_cosmos(name, photos, args.dtypes) for name in args.cosmos]
    if args.json:
        Path(args.json).write_text(json.dumps({"photos": args.photos, "size": args.size, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
