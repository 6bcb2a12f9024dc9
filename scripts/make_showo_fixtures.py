"""Generate the Show-o MAGVIT-v2 reference fixtures once, by running Show-o's own code.

vqserve does not ship Show-o's code. This script imports ``models/modeling_magvitv2.py`` and
``models/common_modules.py`` from a scratch copy of showlab/Show-o (commit in
tests/fixtures/showo/README.md), outside this repository::

    git clone https://github.com/showlab/Show-o /tmp/ref-showo
    python scripts/make_showo_fixtures.py --reference /tmp/ref-showo            # fixtures
    python scripts/make_showo_fixtures.py --reference /tmp/ref-showo full-size --photos A.jpg B.jpg

Two modules Show-o's file imports hold no arithmetic and pull in diffusers, omegaconf and
jaxtyping, so they are replaced by stand-ins: ``modeling_utils`` (a copy of diffusers'
``ModelMixin`` / ``ConfigMixin`` / ``register_to_config``: saving and loading plumbing; the
stand-ins are ``nn.Module``, ``object`` and the identity) and ``misc`` (type aliases). Every
network, quantizer and index operation is Show-o's code, unchanged.

``fixtures`` writes tests/fixtures/showo/:

* ``weights.safetensors``: a small random-initialised ``MAGVITv2`` (Show-o's own
  ``VQGANEncoder`` / ``VQGANDecoder`` / ``LFQuantizer`` classes at a small size), its encoder
  and decoder parameters as int8 with a power-of-two exponent per tensor (``NAME#exp``; the
  weights were rounded to those values before the reference ran, so the file holds the exact
  fp32 values). The quantizer's buffers are not stored: the test rebuilds them as Show-o's
  ``LFQuantizer`` does and the importer checks them;
* ``cases.safetensors``: inputs and the reference's outputs (README.md);
* ``published_keys.json``: the state-dict names and shapes of ``MAGVITv2()`` (the one
  published architecture, showlab/magvitv2), buffers included.

``full-size`` builds ``MAGVITv2()`` at full size, random-initialised by Show-o's code (seed 0),
runs it next to vqserve's rebuild (weights copied through ``vqserve import showo``'s renames) on
photographs resized (shorter side, bicubic) and centre-cropped to ``--size``, and prints how
many indices and decoded pixels agree.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from fixture_kit import int8_weights, photo_inputs, to_int8_grid
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "showo"
SEED = 0
# The small configuration (factor 4, 10 bits = 1,024 codes): width changes in both directions
# in the encoder (32 -> 64 -> 32) and one in the decoder, per-level block counts that differ,
# and the decoder not a mirror of the encoder, as in the published model.
SMALL = dict(ch=32, enc_ch_mult=[1, 2, 1], enc_blocks=[1, 2, 1], dec_ch_mult=[2, 1, 1], dec_blocks=[1, 1, 2],
             z_channels=10)


def load_reference(root: Path) -> types.ModuleType:
    """Show-o's ``models/modeling_magvitv2.py`` (and ``common_modules.py``) as package
    ``showo_ref``, with the two plumbing modules replaced (module docstring)."""
    package = types.ModuleType("showo_ref")
    package.__path__ = [str(root / "models")]
    sys.modules["showo_ref"] = package
    utils = types.ModuleType("showo_ref.modeling_utils")
    utils.ModelMixin, utils.ConfigMixin = nn.Module, object
    utils.register_to_config = lambda init: init
    misc = types.ModuleType("showo_ref.misc")
    exec("from typing import *", misc.__dict__)  # noqa: S102 - type aliases only, as misc.py's
    sys.modules["showo_ref.modeling_utils"], sys.modules["showo_ref.misc"] = utils, misc
    for name in ("common_modules", "modeling_magvitv2"):
        spec = importlib.util.spec_from_file_location(f"showo_ref.{name}", root / "models" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["showo_ref.modeling_magvitv2"]


def build_small(ref) -> nn.Module:
    """``MAGVITv2`` with its three parts built small by Show-o's own classes."""
    model = ref.MAGVITv2.__new__(ref.MAGVITv2)
    nn.Module.__init__(model)
    common = dict(ch=SMALL["ch"], z_channels=SMALL["z_channels"])
    model.encoder = ref.VQGANEncoder(ch_mult=SMALL["enc_ch_mult"], num_res_blocks=SMALL["enc_blocks"], **common)
    model.decoder = ref.VQGANDecoder(ch_mult=SMALL["dec_ch_mult"], num_res_blocks=SMALL["dec_blocks"], **common)
    model.quantize = ref.LFQuantizer(codebook_dim=SMALL["z_channels"])
    return model.eval()


def randomise(model: nn.Module) -> None:
    """GroupNorm affine parameters perturbed; every parameter rounded to an int8 grid."""
    torch.manual_seed(SEED)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.GroupNorm) and m.affine:
                m.weight.add_(0.1 * torch.randn_like(m.weight))
                m.bias.add_(0.1 * torch.randn_like(m.bias))
        for _, p in model.named_parameters():
            q, e = to_int8_grid(p)
            p.copy_(q.float() * 2.0 ** -e)




def image_transform(images: np.ndarray) -> torch.Tensor:
    """Show-o's ``training/utils.image_transform`` after its resize and crop: torchvision's
    ``ToTensor`` (``from_numpy(...).permute(2, 0, 1).contiguous().to(float32).div(255)``) and
    ``Normalize([0.5] * 3, [0.5] * 3)`` (``sub_(mean[:, None, None]).div_(std[:, None, None])``),
    one image at a time, then stacked (contiguous NCHW)."""
    half = torch.tensor([0.5, 0.5, 0.5])
    out = []
    for image in images:
        x = torch.from_numpy(image.copy()).permute(2, 0, 1).contiguous().to(torch.float32).div(255)
        out.append(x.sub_(half[:, None, None]).div_(half[:, None, None]))
    return torch.stack(out)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Show-o's inference scripts: ``clamp((y + 1) / 2, 0, 1)``, ``*= 255``, NHWC, ``astype(uint8)``."""
    x = torch.clamp((images.detach() + 1.0) / 2.0, min=0.0, max=1.0)
    x *= 255.0
    return x.permute(0, 2, 3, 1).numpy().astype(np.uint8)


@torch.no_grad()
def run_case(model, images: np.ndarray, prefix: str) -> dict[str, torch.Tensor]:
    x = image_transform(images)
    latents = model.encoder(x)
    indices = model.get_code(x)  # [B, h*w], as Show-o's inference_mmu.py takes them
    b, _, h, w = latents.shape
    decoded = model.decode_code(indices, shape=(h, w))
    per_image = [to_uint8(model.decode_code(indices[i:i + 1], shape=(h, w))) for i in range(b)]
    _, encoded = model.encode(x)  # MAGVITv2.encode: the same indices by its other door
    assert torch.equal(encoded, indices)
    return {f"{prefix}_images": torch.from_numpy(images), f"{prefix}_latents": latents.contiguous(),
            f"{prefix}_indices": indices.view(b, h, w).clone(),
            f"{prefix}_decoded_uint8": torch.from_numpy(to_uint8(decoded)),
            f"{prefix}_decoded1_uint8": torch.from_numpy(np.concatenate(per_image))}


@torch.no_grad()
def extra_cases(model) -> dict[str, torch.Tensor]:
    """Indices the reference decodes (random 6 x 6, a 1 x 2 grid) and LFQ edge values: 0, -0,
    tiny, subnormal, +-inf, NaN and latents so large that ``z + (q - z)`` rounds to 0."""
    g = torch.Generator().manual_seed(SEED + 1)
    bits = model.quantize.e_dim
    given = torch.randint(0, 2 ** bits, (1, 36), generator=g)
    row = torch.tensor([[5, 1000]])
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-45, -1e-45, float("inf"), float("-inf"), float("nan"),
                            3.0, 2.0 ** 25 + 4, 2.0 ** 24 + 2, 3e38, -3e38, 2.0 ** 26, -(2.0 ** 26)])
    z = torch.randn(1, bits, 4, 4, generator=g)
    for c in range(bits):  # 16 positions of edge values, in another order per channel
        z[0, c].view(-1)[:16] = special.roll(c)
    # the original computes its entropy loss in eval too, through a Categorical whose argument
    # validation rejects inf/NaN logits; validation off (it touches only the loss), as in -O
    torch.distributions.Distribution.set_default_validate_args(False)
    out = model.quantize(z)
    torch.distributions.Distribution.set_default_validate_args(True)
    return {"given_indices": given.view(1, 6, 6),
            "given_decoded_uint8": torch.from_numpy(to_uint8(model.decode_code(given, shape=(6, 6)))),
            "row_indices": row.view(1, 1, 2),
            "row_decoded_uint8": torch.from_numpy(to_uint8(model.decode_code(row, shape=(1, 2)))),
            "lfq_z": z, "lfq_indices": out["indices"].view(1, 4, 4).clone(),
            "lfq_codes": model.quantize.get_codebook_entry(out["indices"].view(1, 16), shape=(4, 4)).contiguous()}


def published_keys(ref) -> dict[str, list[int]]:
    with torch.device("meta"):
        model = ref.MAGVITv2()
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def make_fixtures(root: Path, out: Path) -> None:
    torch.set_num_threads(1)
    ref = load_reference(root)
    torch.manual_seed(SEED)  # the default initialisation draws from the global generator
    model = build_small(ref)
    randomise(model)
    cases: dict[str, torch.Tensor] = {}
    for prefix, images in photo_inputs().items():
        cases.update(run_case(model, images, prefix))
    cases.update(extra_cases(model))
    out.mkdir(parents=True, exist_ok=True)
    save_file(int8_weights(model), str(out / "weights.safetensors"))
    save_file({k: v.contiguous() for k, v in cases.items()}, str(out / "cases.safetensors"))
    keys = published_keys(ref)
    (out / "published_keys.json").write_text(
        "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in keys.items()) + "\n}\n")
    print(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in sorted(out.iterdir())))


def photos_at(paths: list[str], size: int) -> np.ndarray:
    """Show-o's ``image_transform`` geometry: shorter side resized to ``size`` (bicubic), then
    a centre crop ``size`` x ``size``."""
    from PIL import Image

    out = []
    for path in paths:
        img = Image.open(path).convert("RGB")
        scale = size / min(img.size)
        img = img.resize((max(size, round(img.width * scale)), max(size, round(img.height * scale))), Image.BICUBIC)
        left, top = (img.width - size) // 2, (img.height - size) // 2
        out.append(np.asarray(img.crop((left, top, left + size, top + size))))
    return np.stack(out)


@torch.no_grad()
def full_size(root: Path, photos: list[str], size: int, keep: Path | None = None) -> None:
    """MAGVITv2() random-initialised by Show-o's code next to vqserve's rebuild, on photos."""
    from safetensors.torch import save_file as save

    from vqserve.model.checkpoint import load_tokenizer
    from vqserve.model.families.showo.importer import import_showo

    torch.set_num_threads(max(1, torch.get_num_threads()))
    ref = load_reference(root)
    torch.manual_seed(SEED)
    model = ref.MAGVITv2().eval()
    images = photos_at(photos, size)
    with tempfile.TemporaryDirectory() as tmp:
        folder = (keep or Path(tmp)) / "magvitv2"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"_class_name": "MAGVITv2"}))
        save({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "pytorch_model.safetensors"))
        out, _ = import_showo([folder], (keep or Path(tmp)) / "imported")
        tok = load_tokenizer(out)
        same = px_same = total = px_total = 0
        for i in range(len(images)):
            reference = model.get_code(image_transform(images[i:i + 1]))
            ours = tok.encode(torch.from_numpy(images[i:i + 1]))
            same += int((ours.view(1, -1) == reference).sum())
            total += reference.numel()
            h, w = ours.shape[1:]
            ref_px = to_uint8(model.decode_code(reference, shape=(h, w)))
            our_px = tok.decode(reference.view(1, h, w)).numpy()
            px_same += int((ref_px == our_px).sum())
            px_total += ref_px.size
    print(f"MAGVITv2() full size, {len(images)} photos at {size}: indices {same}/{total} equal; "
          f"decoded uint8 {px_same}/{px_total} equal")


def fixture_cli(argv: list[str] | None, doc: str, out: Path, project: str, make, full) -> int:
    """The command line of a fixture script: ``--reference`` checkout, ``fixtures`` (the
    default: ``make(reference, out)``) or ``full-size`` (``full(reference, photos, size, keep)``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, type=Path, help=f"a scratch checkout of {project}")
    parser.add_argument("what", nargs="?", default="fixtures", choices=["fixtures", "full-size"])
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--photos", nargs="*", default=[])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--keep", type=Path, default=None,
                        help="full-size: keep the released-layout folder and its import here (for vqserve eval)")
    args = parser.parse_args(argv)
    if args.what == "fixtures":
        make(args.reference, args.out)
    else:
        full(args.reference, args.photos, args.size, args.keep)
    return 0


def main(argv: list[str] | None = None) -> int:
    return fixture_cli(argv, __doc__, OUT, "showlab/Show-o", make_fixtures, full_size)


if __name__ == "__main__":
    sys.exit(main())
