"""Generate the taming-transformers reference fixtures once, by running taming's own modules.

vqserve does not ship taming-transformers' code. This script imports two of its module files
from a scratch checkout outside this repository (``taming/modules/diffusionmodules/model.py``:
``Encoder``, ``Decoder``; ``taming/modules/vqvae/quantize.py``: ``VectorQuantizer2``), so
neither pytorch-lightning nor the rest of taming is needed; ``VQModel``'s four-line
``encode`` / ``decode`` / ``decode_code`` are spelled out below exactly as
``taming/models/vqgan.py`` has them::

    git clone https://github.com/CompVis/taming-transformers /tmp/ref-taming
    git -C /tmp/ref-taming checkout 3ba01b241669f5ade541ce990f7650a3b8f65318
    python scripts/make_taming_fixtures.py --reference /tmp/ref-taming     # einops: vqserve's test extras

writes tests/fixtures/taming/ (README.md there): ``weights.safetensors`` (a small
random-initialised model in taming's layout, every weight on an int8 grid with a power-of-two
scale, so the file holds the exact fp32 values the reference ran with), ``config.yaml`` (its
taming config), ``cases.safetensors`` (inputs and the reference's outputs) and
``published_keys.json`` (tensor names and shapes of the published architectures, built by
the original classes). ``full-size`` runs a published architecture (random weights, seed 0)
next to vqserve on photographs and prints how many indices and pixels agree;
``random-checkpoint --model NAME --out DIR`` writes a published architecture with random
weights as a released ``.ckpt`` + yaml (docs/MODELS.md measures bf16/fp16 on those).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import yaml
from fixture_kit import int8_weights, photo_inputs, to_int8_grid, to_uint8
from PIL import Image
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "tests" / "fixtures" / "taming"
SEED = 0
OWN = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.", "quantize.")
# ch 32, ch_mult [1, 2] (factor 2; widths 32 -> 64, so a 1x1 skip occurs), one block per level,
# attention at the *full* resolution only (attn_resolutions [32] at resolution 32: not where
# LlamaGen/IBQ put it), z 16 -> quant_conv -> 8, 512 codes.
SMALL = dict(ch=32, ch_mult=[1, 2], num_res_blocks=1, z_channels=16, resolution=32, attn_resolutions=[32],
             n_embed=512, embed_dim=8)
PUBLISHED = {
    # configs/imagenet_vqgan.yaml (f16-16384); the f16-1024 model differs in n_embed only
    "imagenet-f16-16384": dict(ch=128, ch_mult=[1, 1, 2, 2, 4], num_res_blocks=2, z_channels=256, resolution=256,
                               attn_resolutions=[16], n_embed=16384, embed_dim=256),
    # Meta's Chameleon vqgan.yaml, as transformers' ChameleonVQVAEConfig documents it
    "chameleon": dict(ch=128, ch_mult=[1, 1, 2, 2, 4], num_res_blocks=2, z_channels=256, resolution=512,
                      attn_resolutions=[], n_embed=8192, embed_dim=256),
}


class Reference(nn.Module):
    """taming's ``VQModel`` without Lightning: the same submodules under the same names."""

    def __init__(self, cfg: dict):
        super().__init__()
        from taming.modules.diffusionmodules.model import Decoder, Encoder
        from taming.modules.vqvae.quantize import VectorQuantizer2

        cfg = dict(cfg)
        n_embed, embed_dim = cfg.pop("n_embed"), cfg.pop("embed_dim")
        ddconfig = dict(double_z=False, in_channels=3, out_ch=3, dropout=0.0, **cfg)
        self.encoder = Encoder(**ddconfig)
        self.decoder = Decoder(**ddconfig)
        self.quantize = VectorQuantizer2(n_embed, embed_dim, beta=0.25)
        self.quant_conv = nn.Conv2d(cfg["z_channels"], embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(embed_dim, cfg["z_channels"], 1)

    def encode(self, x):  # VQModel.encode
        h = self.encoder(x)
        h = self.quant_conv(h)
        return self.quantize(h)

    def decode(self, quant):  # VQModel.decode
        return self.decoder(self.post_quant_conv(quant))


def randomise_on_int8_grid(model: nn.Module, own: tuple[str, ...] = OWN) -> None:
    """GroupNorm affine parameters perturbed (so they matter), every weight rounded to an int8
    grid with a power-of-two scale per tensor, the codebook drawn N(0, 1) as nn.Embedding does."""
    torch.manual_seed(SEED)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.GroupNorm) and m.affine:
                m.weight.add_(0.1 * torch.randn_like(m.weight))
                m.bias.add_(0.1 * torch.randn_like(m.bias))
        for name, p in model.named_parameters():
            if name == "quantize.embedding.weight":
                p.copy_(torch.randn_like(p))
            if name.startswith(own):
                q, e = to_int8_grid(p)
                p.copy_(q.float() * 2.0 ** -e)




def taming_pixels(images: np.ndarray) -> torch.Tensor:
    """taming's data pipeline (``taming/data/base.py``): ``(image / 127.5 - 1.0).astype(float32)``, NCHW."""
    return torch.from_numpy((images / 127.5 - 1.0).astype(np.float32)).permute(0, 3, 1, 2).contiguous()




@torch.no_grad()
def run_case(model, images: np.ndarray, prefix: str, pixels=taming_pixels, to_pixels=to_uint8) -> dict:
    """Latents, indices (``encode``), the decode of the codebook rows of those indices
    (``get_codebook_entry`` -> ``decode``), whole batch and one image at a time."""
    x = pixels(images)
    d = model.quantize.e_dim
    latents = model.quant_conv(model.encoder(x))
    quant, _, (_, _, indices) = model.encode(x)
    b, _, h, w = quant.shape
    indices = indices.view(b, h, w)
    decoded = model.decode(model.quantize.get_codebook_entry(indices.reshape(-1), (b, h, w, d)))
    per_image = [model.decode(model.quantize.get_codebook_entry(indices[i].reshape(-1), (1, h, w, d)))
                 for i in range(b)]
    return {f"{prefix}_images": torch.from_numpy(images), f"{prefix}_latents": latents.contiguous(),
            f"{prefix}_indices": indices.clone(),
            f"{prefix}_decoded_uint8": torch.from_numpy(to_pixels(decoded)),
            f"{prefix}_decoded1_uint8": torch.from_numpy(np.concatenate([to_pixels(p) for p in per_image]))}


@torch.no_grad()
def given_case(model, to_pixels=to_uint8) -> dict:
    """The decode of fixed random indices: a batch of two 6x5 grids."""
    g = torch.Generator().manual_seed(SEED + 1)
    d = model.quantize.e_dim
    given = torch.randint(0, model.quantize.n_e, (2, 6, 5), generator=g)
    out = model.decode(model.quantize.get_codebook_entry(given.reshape(-1), (2, 6, 5, d)))
    return {"given_indices": given, "given_decoded_uint8": torch.from_numpy(to_pixels(out))}


def config_yaml(cfg: dict, target: str) -> dict:
    cfg = dict(cfg)
    n_embed, embed_dim = cfg.pop("n_embed"), cfg.pop("embed_dim")
    return {"model": {"base_learning_rate": 4.5e-06, "target": target,
                      "params": {"embed_dim": embed_dim, "n_embed": n_embed,
                                 "ddconfig": dict(double_z=False, in_channels=3, out_ch=3, dropout=0.0, **cfg),
                                 "lossconfig": {"target": "taming.modules.losses.vqperceptual.DummyLoss"}}}}


def write(out: Path, tensors: dict, cases: dict, cfg: dict, target: str, published: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "weights.safetensors"))
    save_file({k: v.contiguous() for k, v in cases.items()}, str(out / "cases.safetensors"))
    (out / "config.yaml").write_text(yaml.safe_dump(config_yaml(cfg, target), sort_keys=False))
    (out / "published_keys.json").write_text(
        "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                           for k, v in published.items()) + "\n}\n")
    print(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in sorted(out.iterdir())))


def make_fixtures(out: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = Reference(SMALL).eval()
    randomise_on_int8_grid(model)
    cases: dict[str, torch.Tensor] = {}
    for prefix, images in photo_inputs(32).items():
        cases.update(run_case(model, images, prefix))
    cases.update(given_case(model))
    write(out, int8_weights(model), cases, SMALL, "taming.models.vqgan.VQModel", published_shapes(Reference, PUBLISHED))


def published_shapes(reference: type, published: dict) -> dict[str, dict[str, list[int]]]:
    """Every tensor name and shape of each published architecture, as the reference class
    builds it (on the meta device: no memory, no values)."""
    shapes = {}
    for name, cfg in published.items():
        with torch.device("meta"):
            ref = reference(cfg)
        shapes[name] = {k: list(v.shape) for k, v in ref.state_dict().items()}
    return shapes


def full_size(name: str, photos: list[str], size: int) -> None:
    """A published architecture (random weights by the original classes, ``like_trained``) next
    to vqserve's rebuild on photographs: indices and decoded pixels compared."""
    from vqserve.model.families.taming.family import PRESETS, TamingTokenizer
    from vqserve.model.families.taming.layout import to_vqserve_name

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    model = Reference(PUBLISHED[name]).eval()
    like_trained(model, PUBLISHED[name])
    ours = TamingTokenizer(PRESETS[name]).eval()
    ours.load_state_dict({to_vqserve_name(k, 5): v for k, v in model.state_dict().items()})

    def reference(image: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        quant, _, (_, _, indices) = model.encode(taming_pixels(image))
        b, d, h, w = quant.shape
        indices = indices.view(b, h, w)
        return indices, to_uint8(model.decode(model.quantize.get_codebook_entry(indices.reshape(-1), (b, h, w, d))))

    compare_on_photos(name, photos, size, reference, ours)


@torch.no_grad()
def compare_on_photos(name: str, photos: list[str], size: int, reference, ours) -> None:
    """``reference(image) -> (indices [1, h, w], uint8 NHWC pixels)`` of the original next to
    vqserve's tokenizer ``ours`` on each photograph (square crop of side ``size``): how many
    indices and decoded pixels are equal, printed per photograph and in total."""
    from vqserve.model.families.llamagen.precision import load_photo

    same = total = px_same = px_total = 0
    for path in photos:
        image = load_photo(path, size)[None]
        indices, ref_px = reference(image)
        got = ours.encode(torch.from_numpy(image))
        got_px = ours.decode(indices).numpy()
        n = int((got == indices).sum())
        same, total = same + n, total + indices.numel()
        px_same, px_total = px_same + int((got_px == ref_px).sum()), px_total + ref_px.size
        print(f"{Path(path).name}: {n}/{indices.numel()} indices ({len(torch.unique(indices))} distinct codes), "
              f"{int((got_px == ref_px).sum())}/{ref_px.size} pixels", flush=True)
    print(f"{name}: indices {same}/{total} equal; decoded uint8 {px_same}/{px_total} equal")


@torch.no_grad()
def random_checkpoint(model: nn.Module, cfg: dict, target: str, out: Path, pixels=taming_pixels) -> None:
    """A published architecture with random weights (``like_trained``), written in the released
    layout (a Lightning-style ``{"state_dict": ...}`` .ckpt + its yaml) for `vqserve import` / `eval`."""
    like_trained(model, cfg, pixels)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": model.state_dict()}, out / "model.ckpt")
    (out / "config.yaml").write_text(yaml.safe_dump(config_yaml(cfg, target), sort_keys=False))
    print(f"wrote {out / 'model.ckpt'} and {out / 'config.yaml'}")


@torch.no_grad()
def like_trained(model: nn.Module, cfg: dict, pixels=taming_pixels) -> None:
    """Random weights where tokens mean something: GroupNorm affine parameters perturbed, the
    codebook drawn from the model's own latents of two scikit-image photographs plus noise, so
    neighbouring codes compete as after training (seed 0)."""
    from skimage import data as skdata

    torch.manual_seed(SEED)
    for m in model.modules():
        if isinstance(m, nn.GroupNorm) and m.affine:
            m.weight.add_(0.1 * torch.randn_like(m.weight))
            m.bias.add_(0.1 * torch.randn_like(m.bias))
    images = np.stack([np.asarray(Image.fromarray(getattr(skdata, n)()[..., :3]).resize((256, 256), Image.BICUBIC))
                       for n in ("rocket", "astronaut")])
    flat = model.quant_conv(model.encoder(pixels(images))).permute(0, 2, 3, 1).reshape(-1, cfg["embed_dim"])
    codebook = model.quantize.embedding.weight
    pick = torch.randint(0, flat.shape[0], (codebook.shape[0],))
    codebook.copy_(flat[pick] + torch.randn_like(codebook) * flat.std(dim=0) * 0.25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="fixtures", choices=["fixtures", "full-size", "random-checkpoint"])
    ap.add_argument("--reference", required=True, help="a checkout of CompVis/taming-transformers")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--model", default="chameleon", choices=sorted(PUBLISHED), help="full-size: which architecture")
    ap.add_argument("--photos", nargs="*", default=[], help="full-size: image files")
    ap.add_argument("--size", type=int, default=256, help="full-size: square crop side")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.reference).resolve()))
    if args.mode == "fixtures":
        make_fixtures(Path(args.out))
    elif args.mode == "random-checkpoint":
        random_checkpoint(Reference(PUBLISHED[args.model]).eval(), PUBLISHED[args.model],
                          "taming.models.vqgan.VQModel", Path(args.out))
    else:
        full_size(args.model, args.photos, args.size)


if __name__ == "__main__":
    main()
