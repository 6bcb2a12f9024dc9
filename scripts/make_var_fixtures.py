"""Generate the VAR reference fixtures once, by running VAR's own code.

vqserve does not ship VAR's code. This script imports ``models/vqvae.py`` (and the
``quant.py`` / ``basic_vae.py`` / ``dist.py`` it needs) from a scratch clone of
FoundationVision/VAR outside this repository (commit in tests/fixtures/var/README.md)::

    git clone https://github.com/FoundationVision/VAR /tmp/ref-var
    git -C /tmp/ref-var checkout 78b95394fc5896192e3a003e4b295f8ea743c48f
    python scripts/make_var_fixtures.py --reference /tmp/ref-var

It writes into tests/fixtures/var/:

* ``weights.pth``: a small random-initialised ``VQVAE`` (the original class: ``ch=32``,
  ``ch_mult=(1, 2)`` - factor 2 - one block per level, 8-dimensional codes, 64 of them,
  4 partially shared Phi convolutions, the released layout's tensor names) saved as VAR
  saves ``vae_ch160v4096z32.pth``: a plain ``torch.save(state_dict)``, its values rounded to
  fp16 before the reference ran and stored as fp16 (the same numbers, half the bytes);
* ``cases.safetensors``: inputs and the reference's outputs: for 32x32 images (scales
  1,2,3,4,5,6,8,10,13,16: VAR's own 256 schedule, on a 16x16 latent) and 16x16 images (scales
  1,2,4,8), the float pixels in [-1, 1] (VAR's ``x * 2 - 1``), the uint8 images they came from,
  ``torch.cat(img_to_idxBl(x), 1)`` and ``idxBl_to_img(..., same_shape=True, last_one=True)``;
* ``published_keys.json``: every tensor name and shape of the released architecture
  (``VQVAE(vocab_size=4096, z_channels=32, ch=160, share_quant_resi=4)``, as ``build_vae_var``
  builds it), so the import's key checks are tested against the real layout.

The codebook is rescaled to the spread of the random encoder's latents, so every scale's
search is a real choice among many codes (not one code nearest everything).

``full-size --photo P --out F.pth`` writes the released architecture with random weights
(not committed), for the per-scale bf16/fp16 agreement of docs/MODELS.md::

    python scripts/make_var_fixtures.py full-size --reference /tmp/ref-var --photo chelsea.png
    vqserve import var /tmp/var-full-size.pth --out /tmp/var-full
    python scripts/make_var_fixtures.py compare --reference /tmp/ref-var --model /tmp/var-full PHOTO...
    vqserve eval --model /tmp/var-full --images PHOTOS --no-learnability
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "var"
SEED = 0
SMALL = dict(vocab_size=64, z_channels=8, ch=32, share_quant_resi=4)
SMALL_CH_MULT = (1, 2)
SCHEDULES = {32: (1, 2, 3, 4, 5, 6, 8, 10, 13, 16), 16: (1, 2, 4, 8)}
BATCH = {32: 3, 16: 2}


def reference_vqvae(reference: Path, v_patch_nums, ch_mult=SMALL_CH_MULT, **kwargs):
    """VAR's VQVAE with the encoder/decoder ``ch_mult`` and one block per level (VAR hard-codes
    (1,1,2,2,4) and 2: the small fixture patches its ddconfig the way another config would)."""
    sys.path.insert(0, str(reference))
    import models.basic_vae as basic_vae
    from models.vqvae import VQVAE

    if tuple(ch_mult) == (1, 1, 2, 2, 4):
        return VQVAE(v_patch_nums=v_patch_nums, test_mode=True, **kwargs)
    enc, dec = basic_vae.Encoder.__init__, basic_vae.Decoder.__init__

    def patched(init):
        def call(self, **cfg):
            cfg["ch_mult"], cfg["num_res_blocks"] = tuple(ch_mult), 1
            init(self, **cfg)
        return call
    basic_vae.Encoder.__init__, basic_vae.Decoder.__init__ = patched(enc), patched(dec)
    try:
        model = VQVAE(v_patch_nums=v_patch_nums, test_mode=True, **kwargs)
    finally:
        basic_vae.Encoder.__init__, basic_vae.Decoder.__init__ = enc, dec
    model.downsample = 2 ** (len(ch_mult) - 1)
    return model


def randomise(model: nn.Module, images: torch.Tensor) -> None:
    """GroupNorm affine parameters perturbed; the codebook scaled to the latents' spread."""
    torch.manual_seed(SEED)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.add_(0.1 * torch.randn_like(m.weight))
                m.bias.add_(0.1 * torch.randn_like(m.bias))
        f = model.quant_conv(model.encoder(images))
        emb = model.quantize.embedding.weight
        emb.copy_(torch.randn_like(emb) * f.std() * 0.7 + f.mean())
        for t in model.state_dict().values():  # fp16-exact values: the file stores them in half the bytes
            if t.is_floating_point():
                t.copy_(t.half().float())


def fixtures(reference: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    ref = {size: reference_vqvae(reference, SCHEDULES[size], **SMALL) for size in SCHEDULES}
    gen = torch.Generator().manual_seed(SEED)
    uint8 = {size: torch.randint(0, 256, (BATCH[size], 3, size, size), generator=gen, dtype=torch.uint8)
             for size in SCHEDULES}
    # smooth images too (a photograph's latents are not noise): a blurred half of each batch
    for size, u in uint8.items():
        blurred = nn.functional.avg_pool2d(u.float(), 5, stride=1, padding=2, count_include_pad=False)
        u[: BATCH[size] // 2 + 1] = blurred[: BATCH[size] // 2 + 1].round().to(torch.uint8)
    pm1 = {size: (lambda x: x.add(x).add_(-1))(u.float().div(255)) for size, u in uint8.items()}
    first = ref[32]
    randomise(first, pm1[32])
    state = first.state_dict()
    for model in ref.values():
        model.load_state_dict({k: v.clone() for k, v in state.items()})
        model.eval()
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, OUT / "weights.pth")
    cases = {}
    with torch.no_grad():
        for size, model in ref.items():
            x = pm1[size]
            idx = torch.cat(model.img_to_idxBl(x), 1)
            img = model.idxBl_to_img(model.img_to_idxBl(x), same_shape=True, last_one=True)
            cases[f"s{size}.images_uint8"] = uint8[size].permute(0, 2, 3, 1).contiguous()
            cases[f"s{size}.x_pm1"] = x.contiguous()
            cases[f"s{size}.indices"] = idx.contiguous()
            cases[f"s{size}.decoded"] = img.contiguous()
            print(f"{size}x{size}: indices {tuple(idx.shape)}, {len(idx.unique())} distinct codes")
    save_file(cases, str(OUT / "cases.safetensors"))
    full = reference_vqvae(reference, (1, 2, 3, 4, 5, 6, 8, 10, 13, 16),
                           ch_mult=(1, 1, 2, 2, 4), vocab_size=4096, z_channels=32, ch=160, share_quant_resi=4)
    keys = {k: list(v.shape) for k, v in full.state_dict().items()}
    (OUT / "published_keys.json").write_text(json.dumps(keys, indent=0, sort_keys=True) + "\n")
    print(f"wrote {OUT}: {len(state)} tensors small, {len(keys)} in the released layout")


def full_size(reference: Path, out: Path, photo: Path) -> None:
    """The released architecture (``vae_ch160v4096z32``'s layout) with random weights, saved as
    VAR saves it, for ``vqserve import var`` + ``vqserve eval`` (not committed: 436 MB). The
    codebook is scaled to the latents of ``photo`` (256x256 centre crop) as in the fixtures."""
    from PIL import Image

    torch.manual_seed(SEED)
    model = reference_vqvae(reference, (1, 2, 3, 4, 5, 6, 8, 10, 13, 16), ch_mult=(1, 1, 2, 2, 4),
                            vocab_size=4096, z_channels=32, ch=160, share_quant_resi=4)
    img = Image.open(photo).convert("RGB")
    side = min(img.size)
    img = img.crop(((img.width - side) // 2, (img.height - side) // 2,
                    (img.width - side) // 2 + side, (img.height - side) // 2 + side)).resize((256, 256))
    x = torch.from_numpy(np.asarray(img)).permute(2, 0, 1)[None].float().div(255)
    randomise(model, x.add(x).add_(-1))
    torch.save(model.state_dict(), out)
    print(f"wrote {out}: {sum(v.numel() for v in model.state_dict().values()) / 1e6:.1f}M values")


def compare(reference: Path, pth: Path, model_dir: Path, photos: list[Path]) -> None:
    """VAR's own ``img_to_idxBl`` / ``idxBl_to_img`` on ``pth`` (the full-size layout) against
    ``vqserve import var``'s directory ``model_dir`` on whole photographs (VAR's validation
    transform to 256x256): prints whether indices and decoded pixels are identical."""
    from PIL import Image

    from vqserve.model import load_tokenizer
    from vqserve.model.evaluation import model_sized
    from vqserve.model.tokenizer import float_to_pixels

    model = reference_vqvae(reference, (1, 2, 3, 4, 5, 6, 8, 10, 13, 16), ch_mult=(1, 1, 2, 2, 4),
                            vocab_size=4096, z_channels=32, ch=160, share_quant_resi=4)
    model.load_state_dict(torch.load(pth, weights_only=True))
    model.eval()
    tok = load_tokenizer(model_dir)
    for photo in photos:
        u = torch.from_numpy(model_sized(tok, np.asarray(Image.open(photo).convert("RGB"))).copy())[None]
        x = u.permute(0, 3, 1, 2).float().div(255)
        x = x.add(x).add_(-1)
        with torch.no_grad():
            ref_idx = torch.cat(model.img_to_idxBl(x), 1)
            ref_img = model.idxBl_to_img(model.img_to_idxBl(x), same_shape=True, last_one=True)
        ours = tok.encode(u)
        print(f"{photo.name}: {tuple(ours.shape)} indices equal {bool(torch.equal(ours, ref_idx))}, decoded "
              f"pixels equal {bool(torch.equal(tok.decode(ours), float_to_pixels(ref_img)))}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=["fixtures", "full-size", "compare"], default="fixtures")
    parser.add_argument("--reference", type=Path, required=True, help="a checkout of FoundationVision/VAR")
    parser.add_argument("--out", type=Path, default=Path("/tmp/var-full-size.pth"), help="full-size: the .pth")
    parser.add_argument("--photo", type=Path, help="full-size: the photograph the codebook is scaled to")
    parser.add_argument("--model", type=Path, help="compare: the `vqserve import var` directory of --out")
    parser.add_argument("photos", nargs="*", type=Path, help="compare: whole photographs")
    args = parser.parse_args(argv)
    if args.what == "compare":
        compare(args.reference, args.out, args.model, args.photos)
        return 0
    if args.what == "full-size":
        if args.photo is None:
            parser.error("full-size needs --photo")
        full_size(args.reference, args.out, args.photo)
    else:
        fixtures(args.reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
