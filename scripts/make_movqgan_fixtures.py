"""Generate the SBER-MoVQGAN reference fixtures once, by running MoVQGAN's own modules.

vqserve does not ship MoVQGAN's code. This script imports three of its module files from a
scratch checkout outside this repository (``movqgan/modules/vqvae/vqvae_blocks.py``:
``Encoder``; ``movq_modules.py``: ``MOVQDecoder``; ``quantize.py``: ``VectorQuantizer2``), so
pytorch-lightning and huggingface_hub (``movqgan/__init__.py``) are not needed; ``MOVQ``'s
``encode`` / ``decode`` are spelled out below exactly as ``movqgan/models/vqgan.py`` has them::

    git clone https://github.com/ai-forever/MoVQGAN /tmp/ref-movq
    git -C /tmp/ref-movq checkout f3976d8752826c6ba003cfee8790e91ea23c57e8
    python scripts/make_movqgan_fixtures.py --reference /tmp/ref-movq

writes tests/fixtures/movqgan/ (README.md there), laid out as tests/fixtures/taming/. Pixels
as MoVQGAN's inference notebook feeds them (``arr.astype(np.float32) / 127.5 - 1``) and reads
them back (``show_images``: ``((y + 1) * 127.5).round().clamp(0, 255)``). ``full-size`` runs a
published model's architecture (random weights, seed 0) next to vqserve on photographs;
``random-checkpoint --model NAME --out DIR`` writes one as a ``.ckpt`` + yaml.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import torch
from fixture_kit import SEED, int8_weights, photo_inputs
from make_taming_fixtures import (  # a sibling script, like fixture_kit
    compare_on_photos,
    given_case,
    like_trained,
    published_shapes,
    random_checkpoint,
    randomise_on_int8_grid,
    run_case,
    write,
)
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "tests" / "fixtures" / "movqgan"
# ch 32, ch_mult [1, 2] (factor 2), one block per level, attention at the lowest resolution
# (16 px at resolution 32, as 32 px at 256 in the published models), z 4, 4-dim codes, 512 codes.
SMALL = dict(ch=32, ch_mult=[1, 2], num_res_blocks=1, z_channels=4, resolution=32, attn_resolutions=[16],
             n_embed=512, embed_dim=4)
# movqgan/__init__.py MODELS
PUBLISHED = {
    "67M": dict(ch=128, ch_mult=[1, 2, 2, 4], num_res_blocks=2, z_channels=4, resolution=256,
                attn_resolutions=[32], n_embed=16384, embed_dim=4),
    "102M": dict(ch=128, ch_mult=[1, 2, 2, 4], num_res_blocks=4, z_channels=4, resolution=256,
                 attn_resolutions=[32], n_embed=16384, embed_dim=4),
    "270M": dict(ch=256, ch_mult=[1, 2, 2, 4], num_res_blocks=2, z_channels=4, resolution=256,
                 attn_resolutions=[32], n_embed=16384, embed_dim=4),
}


REFERENCE: list[Path] = []  # the checkout, set by main()


def reference_module(name: str):
    """``movqgan/modules/vqvae/{name}.py`` loaded by path: the package's ``__init__`` imports
    Lightning and huggingface_hub, these module files only torch, numpy and einops."""
    path = REFERENCE[0] / "movqgan" / "modules" / "vqvae" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"movqgan_reference_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Reference(nn.Module):
    """MoVQGAN's ``MOVQ`` without Lightning: the same submodules under the same names."""

    def __init__(self, cfg: dict):
        super().__init__()
        MOVQDecoder = reference_module("movq_modules").MOVQDecoder
        VectorQuantizer2 = reference_module("quantize").VectorQuantizer2
        Encoder = reference_module("vqvae_blocks").Encoder
        cfg = dict(cfg)
        n_embed, embed_dim = cfg.pop("n_embed"), cfg.pop("embed_dim")
        ddconfig = dict(double_z=False, in_channels=3, out_ch=3, dropout=0.0, **cfg)
        self.encoder = Encoder(**ddconfig)
        self.decoder = MOVQDecoder(zq_ch=embed_dim, **ddconfig)
        self.quantize = VectorQuantizer2(n_embed, embed_dim, beta=0.25)
        self.quant_conv = nn.Conv2d(cfg["z_channels"], embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(embed_dim, cfg["z_channels"], 1)

    def encode(self, x):  # MOVQ.encode
        h = self.encoder(x)
        h = self.quant_conv(h)
        return self.quantize(h)

    def decode(self, quant):  # MOVQ.decode
        quant2 = self.post_quant_conv(quant)
        return self.decoder(quant2, quant)


def notebook_pixels(images: np.ndarray) -> torch.Tensor:
    """The inference notebook's ``prepare_image``: ``arr.astype(np.float32) / 127.5 - 1``, NCHW."""
    return torch.from_numpy(images.astype(np.float32) / 127.5 - 1).permute(0, 3, 1, 2).contiguous()


def notebook_uint8(y: torch.Tensor) -> np.ndarray:
    """The notebook's ``show_images``: ``((y + 1) * 127.5).round().clamp(0, 255).to(uint8)``, NHWC."""
    return ((y.detach() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def make_fixtures(out: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = Reference(SMALL).eval()
    randomise_on_int8_grid(model)
    cases: dict[str, torch.Tensor] = {}
    for prefix, images in photo_inputs(32).items():
        cases.update(run_case(model, images, prefix, notebook_pixels, notebook_uint8))
    cases.update(given_case(model, notebook_uint8))
    write(out, int8_weights(model), cases, SMALL, "movqgan.models.vqgan.MOVQ", published_shapes(Reference, PUBLISHED))


def full_size(name: str, photos: list[str], size: int) -> None:
    """A published architecture (random weights by the original classes, ``like_trained``) next
    to vqserve's rebuild on photographs: indices and decoded pixels compared."""
    from vqserve.model.families.movqgan.family import PRESETS, MovqganTokenizer
    from vqserve.model.families.taming.layout import to_vqserve_name

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    model = Reference(PUBLISHED[name]).eval()
    like_trained(model, PUBLISHED[name], notebook_pixels)
    ours = MovqganTokenizer(PRESETS[name]).eval()
    ours.load_state_dict({to_vqserve_name(k, 4): v for k, v in model.state_dict().items()})

    def reference(image: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        quant, _, (_, _, indices) = model.encode(notebook_pixels(image))
        b, d, h, w = quant.shape
        indices = indices.view(b, h, w)
        return indices, notebook_uint8(model.decode(model.quantize.get_codebook_entry(indices.reshape(-1),
                                                                                      (b, h, w, d))))

    compare_on_photos(name, photos, size, reference, ours)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="fixtures", choices=["fixtures", "full-size", "random-checkpoint"])
    ap.add_argument("--reference", required=True, help="a checkout of ai-forever/MoVQGAN")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--model", default="67M", choices=sorted(PUBLISHED), help="full-size: which model")
    ap.add_argument("--photos", nargs="*", default=[], help="full-size: image files")
    ap.add_argument("--size", type=int, default=256, help="full-size: square crop side")
    args = ap.parse_args()
    REFERENCE.append(Path(args.reference).resolve())
    if args.mode == "fixtures":
        make_fixtures(Path(args.out))
    elif args.mode == "random-checkpoint":
        random_checkpoint(Reference(PUBLISHED[args.model]).eval(), PUBLISHED[args.model], "movqgan.models.vqgan.MOVQ",
                          Path(args.out), notebook_pixels)
    else:
        full_size(args.model, args.photos, args.size)


if __name__ == "__main__":
    main()
