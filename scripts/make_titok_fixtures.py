"""Generate the TiTok reference fixtures once, by running bytedance/1d-tokenizer's own ``TiTok``.

vqserve does not ship TiTok's code. This script loads its module files by path from a scratch
checkout outside this repository (``modeling/titok.py`` and what it imports:
``modules/base_model.py``, ``modules/blocks.py``, ``modules/maskgit_vqgan.py``,
``quantizer/quantizer.py``), the packages stubbed so ``modeling/__init__.py`` (torchvision,
the generators) is never run; those modules need ``einops``, ``omegaconf``, ``accelerate`` and
``huggingface_hub``, installed into a scratch folder::

    git clone https://github.com/bytedance/1d-tokenizer /tmp/ref-titok
    git -C /tmp/ref-titok checkout 942a96fbdd873780179d1b78d5462911528bf8c8
    pip install --target /tmp/titok-deps --no-deps einops omegaconf antlr4-python3-runtime==4.9.3 \\
        accelerate huggingface_hub
    python scripts/make_titok_fixtures.py --reference /tmp/ref-titok --deps /tmp/titok-deps

writes tests/fixtures/titok/ (README.md there): a folder per small model, ``legacy/`` and
``vq8k/``, each laid out as every family's fixtures are: ``weights.safetensors`` (the released
layout's tensors, int8 grid as tests/fixtures/taming), ``config.json`` (what
``TiTok.save_pretrained`` writes) and ``cases.safetensors`` (``square_*`` inputs and the
reference's outputs, ``given_*``); and ``published_keys.json`` (the released architectures'
tensor names and shapes, and the six released VQ configs).

Small models: the original's size tables (``{"small": 512, "base": 768, "large": 1024}`` for
the width, layers and heads, inside ``TiTokEncoder`` / ``TiTokDecoder.__init__``) get one more
entry, ``"tiny"`` (width 32, 2 layers, 2 heads), by a text substitution made when
``blocks.py`` is loaded, and ``TiTok``'s fixed MaskGIT-VQGAN pixel decoder is built with a
small config (``SMALL_PIXEL``) for the legacy model; no other line changes. ``full-size``
builds the released architecture (random weights, codebook from its own latents) next to
vqserve's on photographs; ``random-checkpoint --out DIR`` writes it with the class's own
``save_pretrained`` (``config.json`` + ``model.safetensors``) for ``--model`` / ``vqserve eval``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from make_taming_fixtures import (  # noqa: E402  (a sibling script)
    SEED,
    compare_on_photos,
    int8_weights,
    randomise_on_int8_grid,
)

OUT = ROOT / "tests" / "fixtures" / "titok"
OWN = ("encoder.", "decoder.", "quantize.", "latent_tokens", "pixel_quantize.", "pixel_decoder.")
TINY = {"width": 32, "layers": 2, "heads": 2}
# MaskGIT-VQGAN's decoder, small: factor 4 (the 8x8 decoder grid to 32x32 pixels), one block per level
SMALL_PIXEL = {"channel_mult": [1, 1, 1], "num_resolutions": 3, "dropout": 0.0, "hidden_channels": 32,
               "num_channels": 3, "num_res_blocks": 1, "resolution": 32, "z_channels": 16}
SMALL = {
    # S/B/L-like: legacy reshape, 12-dim l2-normalised codes, the MaskGIT-VQGAN pixel decoder
    "legacy": {"codebook_size": 512, "token_size": 12, "use_l2_norm": True, "commitment_cost": 0.25,
               "vit_enc_model_size": "tiny", "vit_dec_model_size": "tiny", "vit_enc_patch_size": 8,
               "vit_dec_patch_size": 4, "num_latent_tokens": 8, "finetune_decoder": True},
    # BL/SL VQ-8k-like: no legacy, raw 16-dim codes, pixels from the ViT decoder
    "vq8k": {"codebook_size": 256, "token_size": 16, "use_l2_norm": False, "commitment_cost": 0.25,
             "vit_enc_model_size": "tiny", "vit_dec_model_size": "tiny", "vit_enc_patch_size": 8,
             "vit_dec_patch_size": 8, "num_latent_tokens": 16, "finetune_decoder": False, "is_legacy": False},
}
# configs/infer/TiTok/titok_*.yaml, model.vq_model (the released VQ tokenizers; crop_size 256)
RELEASED = ("l32", "b64", "s128", "bl64_vq8k", "bl128_vq8k", "sl256_vq8k")
PUBLISHED_KEYS = ("l32", "bl64_vq8k")  # tensor names of one legacy and one VQ-8k architecture


def load_reference(checkout: Path, deps: Path | None, tiny: bool):
    """``modeling.titok`` from the checkout, its packages stubbed; with ``tiny`` the size tables
    get the ``"tiny"`` entry (the only change)."""
    if deps is not None:
        sys.path.insert(0, str(deps))
    for package in ("modeling", "modeling.modules", "modeling.quantizer"):
        stub = types.ModuleType(package)
        stub.__path__ = [str(checkout / package.replace(".", "/"))]
        sys.modules[package] = stub
    for name in ("modules.base_model", "modules.blocks", "modules.maskgit_vqgan", "quantizer.quantizer", "titok"):
        file = checkout / "modeling" / f"{name.replace('.', '/')}.py"
        source = file.read_text()
        if tiny and name == "modules.blocks":
            for line, key in (('"small": 512,', "width"), ('"small": 8,', "layers")):
                assert source.count(line) == (2 if key == "width" else 4), line
                source = source.replace(line, f'{line} "tiny": {TINY[key]},')  # layers == heads == 2
        module = types.ModuleType(f"modeling.{name}")
        module.__file__ = str(file)
        sys.modules[f"modeling.{name}"] = module
        exec(compile(source, str(file), "exec"), module.__dict__)  # noqa: S102 - the reference, by path
    return sys.modules["modeling.titok"]


def small_pixel_decoder(titok_module) -> None:
    """``TiTok``'s MaskGIT-VQGAN pixel decoder and codebook built with ``SMALL_PIXEL``."""
    from omegaconf import OmegaConf

    vqgan = sys.modules["modeling.modules.maskgit_vqgan"]
    titok_module.Pixel_Decoder = lambda conf: vqgan.Decoder(OmegaConf.create(SMALL_PIXEL))
    titok_module.Pixel_Quantizer = lambda num_embeddings, embedding_dim, commitment_cost: vqgan.VectorQuantizer(
        num_embeddings, SMALL_PIXEL["z_channels"], commitment_cost)


def full_config(vq: dict, crop: int) -> dict:
    return {"experiment": {}, "model": {"vq_model": dict(vq)}, "dataset": {"preprocessing": {"crop_size": crop}}}


def released_configs(checkout: Path) -> dict[str, dict]:
    from omegaconf import OmegaConf

    out = {}
    for name in RELEASED:
        cfg = OmegaConf.to_container(OmegaConf.load(checkout / "configs" / "infer" / "TiTok" / f"titok_{name}.yaml"),
                                     resolve=True)
        out[name] = full_config({k: v for k, v in cfg["model"]["vq_model"].items()},
                                cfg["dataset"]["preprocessing"]["crop_size"])
    return out


def totensor_pixels(images: np.ndarray) -> torch.Tensor:
    """The README's ``torch.from_numpy(...astype(float32)).permute(2, 0, 1) / 255.0``, batched."""
    return torch.from_numpy(images.astype(np.float32)).permute(0, 3, 1, 2) / 255.0


def to_uint8(y: torch.Tensor) -> np.ndarray:
    """The README's ``clamp(0, 1)``, ``* 255``, ``.to(uint8)``, NHWC."""
    return (torch.clamp(y, 0.0, 1.0) * 255.0).permute(0, 2, 3, 1).to(torch.uint8).numpy()


@torch.no_grad()
def encode(model, images: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(the encoder's output, the README's ``encode(x)[1]["min_encoding_indices"]`` as ``[B, L]``)."""
    x = totensor_pixels(images)
    latents = model.encoder(pixel_values=x, latent_tokens=model.latent_tokens)
    indices = model.encode(x)[1]["min_encoding_indices"]
    return latents, indices.reshape(indices.shape[0], -1)


def test_images(size: int = 32) -> np.ndarray:
    """scikit-image's astronaut and coffee resized, and uniform noise (seed 0)."""
    from PIL import Image
    from skimage import data as skdata

    rng = np.random.default_rng(SEED)
    photos = [np.asarray(Image.fromarray(getattr(skdata, n)()[..., :3]).resize((size, size), Image.BICUBIC))
              for n in ("astronaut", "coffee")]
    return np.stack([*photos, rng.integers(0, 256, (size, size, 3), dtype=np.uint8)])


@torch.no_grad()
def randomise(model: nn.Module) -> None:
    """LayerNorm affine parameters perturbed (so they matter), then ``randomise_on_int8_grid``."""
    torch.manual_seed(SEED)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.weight.add_(0.1 * torch.randn_like(m.weight))
            m.bias.add_(0.1 * torch.randn_like(m.bias))
    randomise_on_int8_grid(model, OWN)


@torch.no_grad()
def run_case(model, images: np.ndarray) -> dict:
    """``square_*`` (TiTok takes its one size only: no ``rect`` case) and ``given_*``, under the
    names every family's fixtures use."""
    latents, indices = encode(model, images)
    decoded = model.decode_tokens(indices.unsqueeze(1))
    g = torch.Generator().manual_seed(SEED + 1)
    given = torch.randint(0, model.config.model.vq_model.codebook_size, (2, indices.shape[1]), generator=g)
    return {"square_images": torch.from_numpy(images), "square_latents": latents.contiguous(),
            "square_indices": indices.contiguous(), "square_decoded_uint8": torch.from_numpy(to_uint8(decoded)),
            # one image per call: what a server that batches requests its own way must give
            "square_decoded1_uint8": torch.from_numpy(np.concatenate(
                [to_uint8(model.decode_tokens(indices[i:i + 1].unsqueeze(1))) for i in range(len(indices))])),
            "given_indices": given,
            "given_decoded_uint8": torch.from_numpy(to_uint8(model.decode_tokens(given.unsqueeze(1))))}


def saved_config(model) -> dict:
    """``config.json`` as ``TiTok.save_pretrained`` writes it (``_save_pretrained``), read back."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())


def make_fixtures(checkout: Path, deps: Path | None, out: Path) -> None:
    torch.set_num_threads(1)
    titok = load_reference(checkout, deps, tiny=True)
    small_pixel_decoder(titok)
    images = test_images()
    for name, vq in SMALL.items():
        torch.manual_seed(SEED)
        model = titok.TiTok(full_config(vq, 32)).eval()
        randomise(model)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone().contiguous() for k, v in run_case(model, images).items()},
                  str(folder / "cases.safetensors"))
        save_file(int8_weights(model), str(folder / "weights.safetensors"))
        (folder / "config.json").write_text(json.dumps(saved_config(model), indent=4) + "\n")
    configs = released_configs(checkout)
    shapes = {}
    titok = load_reference(checkout, deps, tiny=False)  # the original's own pixel decoder again
    for name in PUBLISHED_KEYS:
        with torch.device("meta"):
            shapes[name] = {k: list(v.shape) for k, v in titok.TiTok(configs[name]).state_dict().items()}
    (out / "published_keys.json").write_text(json.dumps({"configs": configs, "keys": shapes}) + "\n")
    print(f"wrote {out}: " + ", ".join(f"{p.relative_to(out)} {p.stat().st_size:,} B"
                                       for p in sorted(out.rglob("*")) if p.is_file()))


@torch.no_grad()
def like_trained(model, photos: np.ndarray) -> None:
    """Random weights where tokens mean something: the codebook drawn from the model's own
    latents of ``photos`` (flipped and shifted copies too) plus noise, so neighbouring codes compete."""
    torch.manual_seed(SEED)
    variants = np.concatenate([photos, photos[:, :, ::-1], np.roll(photos, 8, axis=1)])
    latents, _ = encode(model, np.ascontiguousarray(variants))
    flat = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
    codebook = model.quantize.embedding.weight
    pick = torch.randint(0, flat.shape[0], (codebook.shape[0],))
    codebook.copy_(flat[pick] + torch.randn_like(codebook) * flat.std(dim=0) * 0.25)


def seed_photos(size: int = 256) -> np.ndarray:
    from PIL import Image
    from skimage import data as skdata

    return np.stack([np.asarray(Image.fromarray(getattr(skdata, n)()[..., :3]).resize((size, size), Image.BICUBIC))
                     for n in ("rocket", "chelsea")])


def released_model(checkout: Path, deps: Path | None, variant: str):
    titok = load_reference(checkout, deps, tiny=False)
    torch.manual_seed(SEED)
    model = titok.TiTok(released_configs(checkout)[variant]).eval()
    like_trained(model, seed_photos())
    return model


def full_size(checkout: Path, deps: Path | None, variant: str, photos: list[str]) -> None:
    """The released architecture (random weights, ``like_trained``) next to vqserve on
    photographs (256x256 crops): indices and decoded pixels compared."""
    from vqserve.model.families.titok.family import PRESETS, TitokTokenizer, to_vqserve_names

    torch.set_num_threads(2)
    model = released_model(checkout, deps, variant)
    ours = TitokTokenizer(PRESETS[variant]).eval()
    ours.load_state_dict(to_vqserve_names(model.state_dict()))

    def reference(image: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        _, indices = encode(model, image)
        return indices, to_uint8(model.decode_tokens(indices.unsqueeze(1)))

    compare_on_photos(f"TiTok-{variant}", photos, 256, reference, ours)


def random_checkpoint(checkout: Path, deps: Path | None, variant: str, out: Path) -> None:
    model = released_model(checkout, deps, variant)
    model.save_pretrained(str(out))
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="fixtures", choices=["fixtures", "full-size", "random-checkpoint"])
    ap.add_argument("--reference", required=True, help="a checkout of bytedance/1d-tokenizer")
    ap.add_argument("--deps", default=None, help="a folder with einops, omegaconf, accelerate, huggingface_hub")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--variant", default="l32", choices=RELEASED, help="full-size / random-checkpoint")
    ap.add_argument("--photos", nargs="*", default=[], help="full-size: image files")
    args = ap.parse_args()
    checkout, deps = Path(args.reference).resolve(), Path(args.deps).resolve() if args.deps else None
    if args.mode == "fixtures":
        make_fixtures(checkout, deps, Path(args.out))
    elif args.mode == "random-checkpoint":
        random_checkpoint(checkout, deps, args.variant, Path(args.out))
    else:
        full_size(checkout, deps, args.variant, args.photos)


if __name__ == "__main__":
    main()
