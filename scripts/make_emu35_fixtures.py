"""Generate the Emu3.5 VisionTokenizer reference fixtures once, by running Emu3.5's own code.

vqserve does not ship Emu3.5's code. This script imports ``src/vision_tokenizer/ibq.py`` (the
``IBQ`` class) and its ``modules/`` from a scratch copy of baaivision/Emu3.5 (commit in
tests/fixtures/emu35/README.md), outside this repository::

    git clone https://github.com/baaivision/Emu3.5 /tmp/ref-emu35
    python scripts/make_emu35_fixtures.py --reference /tmp/ref-emu35             # fixtures
    python scripts/make_emu35_fixtures.py --reference /tmp/ref-emu35 full-size --photos A.jpg

The package's ``__init__`` (``build_vision_tokenizer``: omegaconf, transformers) is not run:
the script loads ``ibq.py`` and the two modules it imports directly, and does what
``build_vision_tokenizer`` does with a folder: ``IBQ(**config)`` from ``config.yaml``, then
``load_state_dict`` of ``model.ckpt`` (a ``torch.save`` of the state dict), ``eval()``.

``fixtures`` writes tests/fixtures/emu35/:

* ``config.yaml``: the small configuration, in the layout of Emu3.5's ``config.yaml``
  (``ddconfig``, ``n_embed``, ``embed_dim``);
* ``weights.safetensors``: the reference model's tensors (int8 with a power-of-two exponent
  per tensor, ``NAME#exp``; the weights were rounded to those values before the reference
  ran, so the file holds the exact fp32 values); the test writes them back as ``model.ckpt``;
* ``cases.safetensors``: inputs and the reference's outputs (README.md).

``full-size`` builds ``IBQ`` at full size with Emu3.5's codebook (131,072 x 256) and
SEED-Voken IBQ's published ddconfig (the released ``config.yaml`` was not at hand),
random-initialised by the reference's code (seed 0), runs it next to vqserve's import of the
same weights on photographs (shorter side resized to ``--size``, centre-cropped to a multiple
of 16, non-square kept) and prints how many indices and decoded pixels agree.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
import yaml
from fixture_kit import photo_inputs, to_int8_grid
from make_showo_fixtures import fixture_cli, randomise
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "emu35"
SEED = 0
# Small: factor 4 (three levels, widths 32, 64, 32), attention at the middle level (attn_resolutions
# [32] at resolution 64: not the lowest, so vqserve's attention_levels is exercised), 512 x 8 codes.
SMALL = {"ddconfig": {"double_z": False, "z_channels": 32, "resolution": 64, "in_channels": 3, "out_ch": 3,
                      "ch": 32, "ch_mult": [1, 2, 1], "num_res_blocks": 1, "attn_resolutions": [32],
                      "dropout": 0.0},
         "n_embed": 512, "embed_dim": 8}
# SEED-Voken IBQ's published ddconfig with Emu3.5's codebook (module docstring)
FULL = {"ddconfig": {"double_z": False, "z_channels": 256, "resolution": 256, "in_channels": 3, "out_ch": 3,
                     "ch": 128, "ch_mult": [1, 1, 2, 2, 4], "num_res_blocks": 4, "attn_resolutions": [16],
                     "dropout": 0.0},
        "n_embed": 131072, "embed_dim": 256}


def load_reference(root: Path) -> types.ModuleType:
    """``src/vision_tokenizer/ibq.py`` as ``emu35_ref.ibq``, its modules beside it."""
    base = root / "src" / "vision_tokenizer"
    for name, path in (("emu35_ref", base), ("emu35_ref.modules", base / "modules"),
                       ("emu35_ref.modules.diffusionmodules", base / "modules" / "diffusionmodules"),
                       ("emu35_ref.modules.vqvae", base / "modules" / "vqvae")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    for name, path in (("emu35_ref.modules.diffusionmodules.model", base / "modules/diffusionmodules/model.py"),
                       ("emu35_ref.modules.vqvae.quantize", base / "modules/vqvae/quantize.py"),
                       ("emu35_ref.ibq", base / "ibq.py")):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules["emu35_ref.ibq"]


def weights_file(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        q, e = to_int8_grid(p)
        assert torch.equal(q.float() * 2.0 ** -e, p), name
        tensors[name], tensors[f"{name}#exp"] = q, torch.tensor([e], dtype=torch.int8)
    return tensors


def input_pixels(images: np.ndarray) -> torch.Tensor:
    """Emu3.5's ``build_image``: ``torch.tensor(np.array(image) / 127.5 - 1.0)`` (float64),
    ``.to(float32).permute(2, 0, 1)``, one image at a time, here stacked."""
    return torch.stack([torch.tensor(img / 127.5 - 1.0).to(torch.float32).permute(2, 0, 1) for img in images])


def to_uint8(y: torch.Tensor) -> np.ndarray:
    """Emu3.5's ``decode_image``: ``.float()``, HWC, ``((image + 1.0) * 127.5).clamp(0, 255)``,
    numpy ``astype(uint8)``; NHWC for a batch."""
    x = y.detach().float().permute(0, 2, 3, 1)
    return ((x + 1.0) * 127.5).clamp(0, 255).numpy().astype(np.uint8)


@torch.no_grad()
def run_case(model, images: np.ndarray, prefix: str) -> dict[str, torch.Tensor]:
    x = input_pixels(images)
    b = x.shape[0]
    latents = model.quant_conv(model.encoder(x))
    _, _, (_, _, token) = model.encode(x)
    h, w = latents.shape[2:]
    indices = token.view(b, h, w)
    embed = model.quantize.e_dim
    decoded = model.decode_code(indices.reshape(-1), shape=(b, h, w, embed))
    per_image = [to_uint8(model.decode_code(indices[i].reshape(-1), shape=(1, h, w, embed))) for i in range(b)]
    return {f"{prefix}_images": torch.from_numpy(images), f"{prefix}_latents": latents.contiguous(),
            f"{prefix}_indices": indices.clone(), f"{prefix}_decoded_uint8": torch.from_numpy(to_uint8(decoded)),
            f"{prefix}_decoded1_uint8": torch.from_numpy(np.concatenate(per_image))}


@torch.no_grad()
def tie_case(model) -> dict[str, torch.Tensor]:
    """The quantizer on latents equal to codebook rows that have exact and near-exact copies:
    the reference's indices where its softmax ties."""
    g = torch.Generator().manual_seed(SEED + 2)
    embedding = model.quantize.embedding.weight
    rows = torch.randint(0, embedding.shape[0], (1, 5, 7), generator=g)
    rows[0, 0, :3] = torch.tensor([300, 5, 100])  # code 5, its exact copy 300 and near copy 100
    z = embedding[rows].permute(0, 3, 1, 2).contiguous()
    _, _, (_, _, ind) = model.quantize(z)
    return {"tie_z": z, "tie_indices": ind.view(1, 5, 7).clone()}


def make_fixtures(root: Path, out: Path) -> None:
    torch.set_num_threads(1)
    ref = load_reference(root)
    torch.manual_seed(SEED)
    model = ref.IBQ(**SMALL).eval()
    randomise(model)
    with torch.no_grad():  # the longest code, moved to 5, with an exact and a near copy (tie_case)
        w = model.quantize.embedding.weight
        step = 2.0 ** -to_int8_grid(w)[1]
        w[5] = w[int(w.norm(dim=1).argmax())].clone()
        w[300] = w[5]
        w[100] = w[5]
        w[100, 0] -= step if w[5, 0] > 0 else -step
    cases: dict[str, torch.Tensor] = {}
    for prefix, images in photo_inputs().items():
        cases.update(run_case(model, images, prefix))
    cases.update(tie_case(model))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(SMALL, sort_keys=False))
    save_file(weights_file(model), str(out / "weights.safetensors"))
    save_file({k: v.contiguous() for k, v in cases.items()}, str(out / "cases.safetensors"))
    print(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in sorted(out.iterdir())))


def photo(path: str, size: int) -> np.ndarray:
    from PIL import Image

    img = Image.open(path).convert("RGB")
    scale = size / min(img.size)
    img = img.resize((round(img.width * scale), round(img.height * scale)), Image.BICUBIC)
    arr = np.asarray(img)
    h, w = arr.shape[0] // 16 * 16, arr.shape[1] // 16 * 16
    y, x = (arr.shape[0] - h) // 2, (arr.shape[1] - w) // 2
    return np.ascontiguousarray(arr[y:y + h, x:x + w])


@torch.no_grad()
def full_size(root: Path, photos: list[str], size: int, keep: Path | None = None) -> None:
    from vqserve.model.checkpoint import load_tokenizer
    from vqserve.model.families.ibq.emu35 import import_emu35

    ref = load_reference(root)
    torch.manual_seed(SEED)
    model = ref.IBQ(**FULL).eval()
    with tempfile.TemporaryDirectory() as tmp:
        folder = (keep or Path(tmp)) / "Emu3.5-VisionTokenizer"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump(FULL, sort_keys=False))
        torch.save(model.state_dict(), folder / "model.ckpt")
        out, _ = import_emu35([folder], (keep or Path(tmp)) / "imported")
        tok = load_tokenizer(out)
        for path in photos:
            img = photo(path, size)[None]
            _, _, (_, _, token) = model.encode(input_pixels(img))
            ours = tok.encode(torch.from_numpy(img))
            h, w = ours.shape[1:]
            same = int((ours.reshape(-1) == token.reshape(-1)).sum())
            ref_px = to_uint8(model.decode_code(token.reshape(-1), shape=(1, h, w, 256)))
            px = int((tok.decode(token.view(1, h, w)).numpy() == ref_px).sum())
            print(f"{Path(path).name} {img.shape[2]}x{img.shape[1]}: indices {same}/{h * w} equal; "
                  f"decoded uint8 {px}/{ref_px.size} equal", flush=True)


def main(argv: list[str] | None = None) -> int:
    return fixture_cli(argv, __doc__, OUT, "baaivision/Emu3.5", make_fixtures, full_size)


if __name__ == "__main__":
    sys.exit(main())
