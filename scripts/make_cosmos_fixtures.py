"""Make the Cosmos DI reference fixtures (and the full-size checks) by running NVIDIA's own code.

vqserve does not ship Cosmos-Tokenizer's code. This script imports it from a checkout kept
outside the repository, at the commit ``vqserve.model.families.cosmos.family.REFERENCE_COMMIT``::

    git clone https://github.com/NVIDIA/Cosmos-Tokenizer /tmp/cosmos-ref
    git -C /tmp/cosmos-ref checkout 3584ae752ce8ebdbe06a420bf60d7513c0e878cc
    python scripts/make_cosmos_fixtures.py fixtures --reference /tmp/cosmos-ref
    python scripts/make_cosmos_fixtures.py full-size --reference /tmp/cosmos-ref --json full.json

(it needs ``einops`` and ``loguru``, which vqserve's test environment has; ``mediapy``, which
Cosmos's ``utils.py`` imports for file I/O this script never uses, is stubbed when missing.)

``fixtures`` writes ``tests/fixtures/cosmos/cases.safetensors``: inputs and the reference's
outputs for two small configurations whose weights are ``deterministic_weights`` (the same
on every machine, so no weights file is stored; the sha256 of each set is recorded and
checked). The reference runs exactly as Cosmos's library feeds it: pixels through its own
``numpy2tensor`` (float64 normalisation, a channels-last fp32 tensor), ``DiscreteImageTokenizer
.encode`` / ``decode_code``, pixels back through its own ``tensor2numpy``. The model is put in
fp32 with ``model.to(dtype=torch.float32)``: Cosmos's FSQ otherwise casts its codes to bf16
(exact for FSQ codes, but an fp32 ``post_quant_conv`` then refuses the bf16 input).

It also checks, and prints, what the tests cannot: that vqserve's ``NaivePath`` gives the
reference's indices when the reference itself is cast to bf16; and that a TorchScript archive
traced from the reference (the way NVIDIA publishes the models) imports with ``vqserve import
cosmos`` into a model with the reference's indices. ``full-size`` compares the published
DI8x8 / DI16x16 architectures (deterministic random weights, seed 0) on scikit-image
photographs, fp32 and bf16.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import types
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from vqserve.model.families.cosmos.family import (
    PRESETS,
    REFERENCE_COMMIT,
    CosmosConfig,
    CosmosTokenizer,
    deterministic_weights,
    weights_digest,
)
from vqserve.model.families.cosmos.importer import (
    import_cosmos,
    read_torchscript_tensors,
    to_cosmos_names,
)
from vqserve.model.families.cosmos.precision import NaivePath, skimage_photos

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "cosmos"
# Two small configurations: DI8x8's layout (attention only in the middle, one downsampling
# after the Haar patcher), and DI16x16's (two downsamplings) with attention placed in levels
# too (resolution 128, attn_resolutions [32, 16]) so that code path is checked as well.
FIXTURE_ARCHS = {
    "f8": CosmosConfig(channels=32, channels_mult=[1, 2, 2], num_res_blocks=1, spatial_compression=8, z_channels=16),
    "f16": CosmosConfig(channels=32, channels_mult=[1, 2, 2], num_res_blocks=2, spatial_compression=16,
                        z_channels=16, resolution=128, attn_resolutions=[32, 16]),
}
SEEDS = {"f8": 1, "f16": 2}


def import_reference(path: Path):
    """Cosmos's modules from a checkout outside the repository."""
    if not (path / "cosmos_tokenizer" / "networks" / "discrete_image.py").is_file():
        raise SystemExit(f"{path} is not a Cosmos-Tokenizer checkout (no cosmos_tokenizer/networks/discrete_image.py)")
    try:
        import mediapy  # noqa: F401
    except ImportError:  # only read_image/write_image use it; never called here
        sys.modules["mediapy"] = types.ModuleType("mediapy")
    sys.path.insert(0, str(path))
    from loguru import logger

    logger.remove()  # Cosmos logs every model construction at INFO
    from cosmos_tokenizer import utils
    from cosmos_tokenizer.networks import TokenizerConfigs, TokenizerModels

    return types.SimpleNamespace(utils=utils, configs=TokenizerConfigs, models=TokenizerModels)


def reference_model(ref, arch: CosmosConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Cosmos's ``DiscreteImageTokenizer`` for ``arch``, holding ``weights``, fp32, eval."""
    config = dict(ref.configs.DI.value)
    config.update(channels=arch.channels, channels_mult=list(arch.channels_mult), num_res_blocks=arch.num_res_blocks,
                  attn_resolutions=list(arch.attn_resolutions), resolution=arch.resolution,
                  patch_size=arch.patch_size, patch_method=arch.patch_method,
                  spatial_compression=arch.spatial_compression, z_channels=arch.z_channels,
                  embedding_dim=arch.embedding_dim, levels=list(arch.levels))
    model = ref.models.DI.value(**config)
    model.load_state_dict(to_cosmos_names(weights), strict=True)
    return model.eval().to(dtype=torch.float32)  # the keyword also sets the quantizer's dtype


def ours(arch: CosmosConfig, weights: dict[str, torch.Tensor]) -> CosmosTokenizer:
    tokenizer = CosmosTokenizer(arch)
    tokenizer.load_state_dict(weights)
    return tokenizer.eval()


@torch.no_grad()
def run_reference(ref, model, images: np.ndarray, dtype: torch.dtype = torch.float32,
                  decode: bool = True) -> dict[str, torch.Tensor]:
    """Cosmos's library path, one image at a time (vqserve's server runs micro-batches of
    one on CPU, and PyTorch's CPU convolutions round a batch of two differently: 3 of 24,576
    decoded values move by one level): numpy2tensor -> encode -> decode_code -> tensor2numpy."""
    parts = [_run_one(ref, model, images[i:i + 1], dtype, decode) for i in range(len(images))]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _run_one(ref, model, image: np.ndarray, dtype: torch.dtype, decode: bool) -> dict[str, torch.Tensor]:
    x = ref.utils.numpy2tensor(image, dtype=dtype, device="cpu")
    indices, codes, _ = model.encode(x)
    out = {"indices": indices.to(torch.int64), "codes": codes.float(),
           "latents": model.quant_conv(model.encoder(x)).float().contiguous()}
    if dtype == torch.float32 and decode:
        out["decoded_uint8"] = torch.from_numpy(ref.utils.tensor2numpy(model.decode_code(indices)))
        full = model(x).reconstructions  # the autoencoder's own forward decodes the same codes
        assert np.array_equal(ref.utils.tensor2numpy(full), out["decoded_uint8"].numpy())
    return out


def photo_inputs() -> dict[str, np.ndarray]:
    """Two 64x64 images (a scikit-image photograph downscaled, uniform noise), one 48x80 crop."""
    from PIL import Image
    from skimage import data as skdata

    rng = np.random.default_rng(0)
    astronaut = np.asarray(Image.fromarray(skdata.astronaut()).resize((64, 64), Image.BICUBIC))
    noise = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    coffee = np.asarray(Image.fromarray(skdata.coffee()).resize((80, 53), Image.BICUBIC))[:48]
    return {"square": np.stack([astronaut, noise]), "rect": coffee[None].copy()}


def fsq_probe(levels: list[int]) -> torch.Tensor:
    """Latents [1, d, 32, 64] for the FSQ alone: a wide sweep, random values, and values one
    to three ulps either side of every rounding boundary of every channel."""
    d = len(levels)
    g = torch.Generator().manual_seed(0)
    columns = []
    for c, level in enumerate(levels):
        half_l = (level - 1) * (1 + 1e-3) / 2
        offset = 0.5 if level % 2 == 0 else 0.0
        shift = float(np.arctanh(offset / half_l))
        edges = torch.tensor([np.arctanh((k + 0.5 + offset) / half_l) - shift
                              for k in range(-(level // 2), (level - 1) // 2)], dtype=torch.float32)
        near = [edges]
        for steps in (1, 2, 3):
            up, down = edges.clone(), edges.clone()
            for _ in range(steps):
                up, down = torch.nextafter(up, torch.tensor(np.inf)), torch.nextafter(down, torch.tensor(-np.inf))
            near += [up, down]
        near = torch.cat(near)
        sweep = torch.linspace(-6, 6, 1024)
        rand = torch.randn(2048 - 1024 - near.numel(), generator=g) * 2
        column = torch.cat([sweep, near, rand])
        columns.append(column[torch.randperm(column.numel(), generator=g)] if c % 2 else column)
    return torch.stack(columns).reshape(1, d, 32, 64)


def make_fixtures(ref, out: Path) -> dict:
    torch.set_num_threads(1)
    from cosmos_tokenizer.modules.quantizers import FSQuantizer

    cases: dict[str, torch.Tensor] = {}
    checks: dict = {"reference": f"NVIDIA/Cosmos-Tokenizer@{REFERENCE_COMMIT}", "torch": torch.__version__}
    inputs = photo_inputs()
    for case, images in inputs.items():
        cases[f"{case}_images"] = torch.from_numpy(images)
    for tag, arch in FIXTURE_ARCHS.items():
        weights = deterministic_weights(arch, SEEDS[tag])
        cases[f"{tag}_weights_sha256"] = torch.frombuffer(bytearray.fromhex(weights_digest(weights)), dtype=torch.uint8)
        model, tok = reference_model(ref, arch, weights), ours(arch, weights)
        for case, images in inputs.items():
            got = run_reference(ref, model, images)
            for name in ("indices", "latents", "decoded_uint8"):
                cases[f"{tag}_{case}_{name}"] = got[name]
            mine = tok.encode(torch.from_numpy(images))
            checks[f"{tag}_{case}_fp32_indices_equal"] = bool(torch.equal(mine, got["indices"]))
            checks[f"{tag}_{case}_distinct_codes"] = int(got["indices"].unique().numel())
            naive_ref = run_reference(ref, copy.deepcopy(model).to(torch.bfloat16), images, torch.bfloat16)["indices"]
            checks[f"{tag}_{case}_bf16_naive_path_equals_reference_bf16"] = bool(
                torch.equal(NaivePath(tok, "bf16")(torch.from_numpy(images)), naive_ref))
        given = torch.randint(0, tok.codebook_size, (1, 4, 4), generator=torch.Generator().manual_seed(SEEDS[tag]))
        cases[f"{tag}_given_indices"] = given
        with torch.no_grad():
            cases[f"{tag}_given_decoded_uint8"] = torch.from_numpy(ref.utils.tensor2numpy(model.decode_code(given)))
        checks[f"{tag}_jit_import"] = check_jit_import(model, arch, inputs, cases, tag)

    fsq = FSQuantizer(levels=list(PRESETS["DI8x8"].levels), dtype=torch.float32)
    z = fsq_probe(list(PRESETS["DI8x8"].levels))
    with torch.no_grad():
        indices, codes, _ = fsq(z)
        from_bf16, _, _ = fsq(z.to(torch.bfloat16))
        all_codes = fsq.indices_to_codes(torch.arange(fsq.codebook_size).reshape(1, 1, -1))
    cases.update(fsq_z=z, fsq_indices=indices.to(torch.int32), fsq_codes=codes.to(torch.float16),
                 fsq_indices_from_bf16=from_bf16.to(torch.int32))
    sample = torch.cat([torch.tensor([0, 1, 7, 8, 63999]),
                        torch.randint(0, fsq.codebook_size, (2043,), generator=torch.Generator().manual_seed(3))])
    cases["fsq_sample_indices"] = sample.to(torch.int32)
    cases["fsq_sample_codes"] = all_codes[0, :, 0, sample].t().contiguous().to(torch.float16)  # exact: k/4, k/2
    out.mkdir(parents=True, exist_ok=True)
    archs = {tag: {"seed": SEEDS[tag], "config": asdict(arch)} for tag, arch in FIXTURE_ARCHS.items()}
    save_file({k: v.contiguous() for k, v in cases.items()}, str(out / "cases.safetensors"),
              metadata={"reference": checks["reference"], "torch": torch.__version__, "archs": json.dumps(archs)})
    return checks


def check_jit_import(model, arch: CosmosConfig, inputs: dict, cases: dict, tag: str) -> dict:
    """Trace the reference's encoder_jit()/decoder_jit() (NVIDIA's published form), import the
    two archives with vqserve's reader, and compare tensors and tokens."""
    from vqserve.model.checkpoint import load_tokenizer

    images = inputs["square"]
    x = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))).float() / 127.5 - 1
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        tmp = Path(tmp)
        encoder = torch.jit.trace(model.encoder_jit(), x, check_trace=False)
        decoder = torch.jit.trace(model.decoder_jit(), cases[f"{tag}_square_indices"].to(torch.int32), check_trace=False)
        encoder.save(str(tmp / "encoder.jit"))
        decoder.save(str(tmp / "decoder.jit"))
        read = {**read_torchscript_tensors(tmp / "encoder.jit"), **read_torchscript_tensors(tmp / "decoder.jit")}
        state = model.state_dict()
        tensors_equal = all(torch.equal(read[k], v) for k, v in state.items())
        import_cosmos(tmp, tmp / "imported")
        tok = load_tokenizer(tmp / "imported")
        return {"archive_tensors_equal_state_dict": tensors_equal,
                "archive_names": sorted({k.split(".")[0] for k in read}),
                "imported_indices_equal": all(torch.equal(tok.encode(torch.from_numpy(inputs[c])), cases[f"{tag}_{c}_indices"])
                                              for c in inputs)}


def full_size(ref, photos_size: int) -> dict:
    """The published architectures, random weights (seed 0), scikit-image photographs."""
    torch.set_num_threads(1)
    photos = skimage_photos(photos_size)
    result = {}
    for name, arch in PRESETS.items():
        weights = deterministic_weights(arch, 0)
        model, tok = reference_model(ref, arch, weights), ours(arch, weights)
        fp32_equal = bf16_equal = total = 0
        codes = set()
        for i, photo in enumerate(photos):
            got = run_reference(ref, model, photo[None], decode=i == 0)
            if i == 0:  # one full-size decode: the reference's uint8 pixels
                decoded = tok.decode(got["indices"].to(torch.int64))
                result[f"{name}_decoded_pixels_equal_first_photo"] = bool(torch.equal(decoded, got["decoded_uint8"]))
            got = got["indices"]
            mine = tok.encode(torch.from_numpy(photo[None]))
            fp32_equal += int((mine == got).sum())
            total += got.numel()
            codes.update(got.unique().tolist())
            naive_ref = run_reference(ref, copy.deepcopy(model).to(torch.bfloat16), photo[None], torch.bfloat16)["indices"]
            bf16_equal += int((NaivePath(tok, "bf16")(torch.from_numpy(photo[None])) == naive_ref).sum())
        result[name] = {"tokens": total, "distinct_codes": len(codes), "fp32_indices_equal": fp32_equal,
                        "bf16_naive_path_equals_reference_bf16": bf16_equal}
        print(name, result[name], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["fixtures", "full-size"])
    parser.add_argument("--reference", required=True, type=Path, help="Cosmos-Tokenizer checkout (outside the repo)")
    parser.add_argument("--out", type=Path, default=OUT, help="fixtures directory (default tests/fixtures/cosmos)")
    parser.add_argument("--size", type=int, default=256, help="full-size: photo crop side (default 256)")
    parser.add_argument("--json", default=None, help="also write the checks to this JSON file")
    args = parser.parse_args()
    ref = import_reference(args.reference.resolve())
    checks = make_fixtures(ref, args.out) if args.mode == "fixtures" else full_size(ref, args.size)
    print(json.dumps(checks, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(checks, indent=2) + "\n")


if __name__ == "__main__":
    main()
