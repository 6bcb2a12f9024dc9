"""Generate the MaskGIT-VQGAN reference fixtures once, by running open-muse's own ``MaskGitVQGAN``.

vqserve does not ship open-muse's code. This script loads two of its module files by path from a
scratch checkout outside this repository (``muse/modeling_maskgit_vqgan.py`` and the
``modeling_utils.py`` it imports, whose ``ConfigMixin`` writes the released ``config.json``), so
``muse/__init__.py`` (transformers, wandb, ...) is never imported; ``modeling_utils`` itself
needs ``accelerate`` and ``huggingface_hub``, installed into a scratch folder::

    git clone https://github.com/huggingface/open-muse /tmp/ref-muse
    git -C /tmp/ref-muse checkout 64e1afe033717d795866ab8204484705cd4dc3f7
    pip install --target /tmp/muse-deps --no-deps accelerate huggingface_hub
    python scripts/make_maskgit_fixtures.py --reference /tmp/ref-muse --deps /tmp/muse-deps

writes tests/fixtures/maskgit/ (README.md there): ``weights.safetensors`` (a small model in the
released layout, int8 grid as tests/fixtures/taming), ``config.json`` (what the class's own
``save_pretrained`` writes for it), ``cases.safetensors`` (inputs and the reference's outputs)
and ``published_keys.json`` (the released architecture's tensor names and shapes). Pixels as
open-muse feeds them (torchvision ``ToTensor``: ``x / 255``) and turns decodes into images
(``to_pil_image``: ``2y - 1``, clip, ``(t + 1) / 2``, ``(255 t).astype(uint8)``). ``full-size``
runs the released architecture (random weights, codebook from its latents) next to vqserve on
photographs; ``random-checkpoint --out DIR`` writes it as the released folder (``config.json`` +
``pytorch_model.bin`` by the class's ``save_pretrained``) for `vqserve import maskgit` / `eval`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch
from fixture_kit import SEED, int8_weights, photo_inputs
from make_taming_fixtures import (  # a sibling script, like fixture_kit
    compare_on_photos,
    randomise_on_int8_grid,
)
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "tests" / "fixtures" / "maskgit"
OWN = ("encoder.", "decoder.", "quantize.")
# hidden 32, channel_mult [1, 2] (factor 2), two blocks per level: the first block of encoder
# level 1 and of decoder level 0 change width, so the shortcut quirk runs; 512 codes of 16.
SMALL = dict(resolution=32, hidden_channels=32, channel_mult=[1, 2], num_res_blocks=2, z_channels=16,
             num_embeddings=512, quantized_embed_dim=16)


def reference_class(checkout: Path, deps: Path | None):
    """``MaskGitVQGAN`` from ``muse/modeling_maskgit_vqgan.py``, its package stubbed so that
    ``muse/__init__.py`` is not run (it imports the transformers pipeline)."""
    if deps is not None:
        sys.path.insert(0, str(deps))
    package = types.ModuleType("muse")
    package.__path__ = [str(checkout / "muse")]
    package.__version__ = "0.0.1"  # muse/__init__.py's, which ConfigMixin writes as _version
    sys.modules["muse"] = package
    for name in ("logging", "modeling_utils", "modeling_maskgit_vqgan"):
        spec = importlib.util.spec_from_file_location(f"muse.{name}", checkout / "muse" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"muse.{name}"] = module
        spec.loader.exec_module(module)
    return sys.modules["muse.modeling_maskgit_vqgan"].MaskGitVQGAN


def totensor_pixels(images: np.ndarray) -> torch.Tensor:
    """torchvision's ``ToTensor`` on uint8 HWC, batched: contiguous NCHW, ``float().div(255)``."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(torch.float32).div(255)


def to_pil_uint8(y: torch.Tensor) -> np.ndarray:
    """``PipelineMuse.to_pil_image``, batched: ``2y - 1``, clip to [-1, 1], ``(t + 1) / 2``,
    ``(255 * t).astype(uint8)``, in float32 numpy. NHWC."""
    image = y.detach().permute(0, 2, 3, 1).numpy()
    image = 2.0 * image - 1.0
    image = np.clip(image, -1.0, 1.0)
    image = (image + 1.0) / 2.0
    return (255 * image).astype(np.uint8)


def decode_grid(model, indices: torch.Tensor) -> torch.Tensor:
    """``decode_code`` for a ``[B, h, w]`` grid: ``get_codebook_entry``'s ops with the grid's own
    ``(h, w)`` in place of its square ``sqrt(num_tokens)`` (the only change; same strides)."""
    b, h, w = indices.shape
    z_q = model.quantize.embedding(indices.reshape(b, h * w)).reshape(b, h, w, -1).permute(0, 3, 1, 2)
    return model.decode(z_q)


@torch.no_grad()
def run_case(model, images: np.ndarray, prefix: str) -> dict:
    x = totensor_pixels(images)
    latents = model.encoder(x)
    _, indices = model.encode(x)
    b, _, h, w = latents.shape
    indices = indices.view(b, h, w)
    decoded = to_pil_uint8(decode_grid(model, indices))
    if h == w:  # the original's own decode_code takes square grids: the same pixels
        assert np.array_equal(to_pil_uint8(model.decode_code(indices.reshape(b, -1))), decoded)
    per_image = [to_pil_uint8(decode_grid(model, indices[i:i + 1])) for i in range(b)]
    return {f"{prefix}_images": torch.from_numpy(images), f"{prefix}_latents": latents.contiguous(),
            f"{prefix}_indices": indices.clone(), f"{prefix}_decoded_uint8": torch.from_numpy(decoded),
            f"{prefix}_decoded1_uint8": torch.from_numpy(np.concatenate(per_image))}


@torch.no_grad()
def given_case(model) -> dict:
    """The decode of fixed random indices: a batch of two 6x5 grids (not square)."""
    g = torch.Generator().manual_seed(SEED + 1)
    given = torch.randint(0, model.config.num_embeddings, (2, 6, 5), generator=g)
    return {"given_indices": given, "given_decoded_uint8": torch.from_numpy(to_pil_uint8(decode_grid(model, given)))}


def make_fixtures(cls, out: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = cls(**SMALL).eval()
    randomise_on_int8_grid(model, OWN)
    cases: dict[str, torch.Tensor] = {}
    for prefix, images in photo_inputs(32).items():
        cases.update(run_case(model, images, prefix))
    cases.update(given_case(model))
    with torch.device("meta"):
        published = {k: list(v.shape) for k, v in cls().state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(int8_weights(model), str(out / "weights.safetensors"))
    save_file({k: v.contiguous() for k, v in cases.items()}, str(out / "cases.safetensors"))
    (out / "config.json").write_text(model.to_json_string())
    (out / "published_keys.json").write_text(json.dumps({"imagenet-f16-256": published}, indent=0) + "\n")
    print(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in sorted(out.iterdir())))


@torch.no_grad()
def like_trained(model: nn.Module, photos: np.ndarray) -> None:
    """Random weights where tokens mean something: GroupNorm affine parameters perturbed, the
    codebook drawn from the model's own latents of ``photos`` plus noise (seed 0)."""
    torch.manual_seed(SEED)
    for m in model.modules():
        if isinstance(m, nn.GroupNorm):
            m.weight.add_(0.1 * torch.randn_like(m.weight))
            m.bias.add_(0.1 * torch.randn_like(m.bias))
    dim = model.config.quantized_embed_dim
    flat = model.encoder(totensor_pixels(photos)).permute(0, 2, 3, 1).reshape(-1, dim)
    codebook = model.quantize.embedding.weight
    pick = torch.randint(0, flat.shape[0], (codebook.shape[0],))
    codebook.copy_(flat[pick] + torch.randn_like(codebook) * flat.std(dim=0) * 0.25)


def seed_photos(size: int = 256) -> np.ndarray:
    """The photographs the taming and MoVQGAN scripts draw codebooks from (scikit-image's rocket
    and astronaut), resized to ``size``."""
    from PIL import Image
    from skimage import data as skdata

    return np.stack([np.asarray(Image.fromarray(getattr(skdata, n)()[..., :3]).resize((size, size), Image.BICUBIC))
                     for n in ("rocket", "astronaut")])


def full_size(cls, photos: list[str], size: int) -> None:
    """The released architecture (random weights, ``like_trained``) next to vqserve's rebuild on
    photographs: indices and decoded pixels compared."""
    from vqserve.model.families.maskgit.family import PRESETS, MaskgitTokenizer

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    model = cls().eval()
    like_trained(model, seed_photos())
    ours = MaskgitTokenizer(PRESETS["imagenet-f16-256"]).eval()
    ours.load_state_dict({("quantizer.embedding" if k == "quantize.embedding.weight" else k): v
                          for k, v in model.state_dict().items()})

    def reference(image: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        _, indices = model.encode(totensor_pixels(image))
        indices = indices.view(1, size // 16, size // 16)
        return indices, to_pil_uint8(model.decode_code(indices.reshape(1, -1)))  # the original's own, square

    compare_on_photos("imagenet-f16-256", photos, size, reference, ours)


@torch.no_grad()
def random_checkpoint(cls, out: Path) -> None:
    """The released architecture with random weights (``like_trained``), saved by the class's own
    ``save_pretrained``: the released folder's ``config.json`` + ``pytorch_model.bin``."""
    torch.manual_seed(SEED)
    model = cls().eval()
    like_trained(model, seed_photos())
    model.save_pretrained(str(out))
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="fixtures", choices=["fixtures", "full-size", "random-checkpoint"])
    ap.add_argument("--reference", required=True, help="a checkout of huggingface/open-muse")
    ap.add_argument("--deps", default=None, help="a folder with accelerate and huggingface_hub (pip --target)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--photos", nargs="*", default=[], help="full-size: image files")
    ap.add_argument("--size", type=int, default=256, help="full-size: square crop side")
    args = ap.parse_args()
    cls = reference_class(Path(args.reference).resolve(), Path(args.deps).resolve() if args.deps else None)
    if args.mode == "fixtures":
        make_fixtures(cls, Path(args.out))
    elif args.mode == "random-checkpoint":
        random_checkpoint(cls, Path(args.out))
    else:
        full_size(cls, args.photos, args.size)


if __name__ == "__main__":
    main()
