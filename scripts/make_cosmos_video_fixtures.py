"""Make the Cosmos DV (video) reference fixtures by running NVIDIA's own code.

vqserve does not ship Cosmos-Tokenizer's code. This script imports it from a checkout kept
outside the repository, at ``vqserve.model.families.cosmos.family.REFERENCE_COMMIT``::

    git clone https://github.com/NVIDIA/Cosmos-Tokenizer /tmp/cosmos-ref
    git -C /tmp/cosmos-ref checkout 3584ae752ce8ebdbe06a420bf60d7513c0e878cc
    python scripts/make_cosmos_video_fixtures.py --reference /tmp/cosmos-ref

It writes ``tests/fixtures/cosmos_video/cases.safetensors``: for three small models in the
layouts of DV4x8x8, DV8x8x8 and DV8x16x16 (``CausalDiscreteVideoTokenizer`` with
``EncoderFactorized`` / ``DecoderFactorized``, FSQ [8,8,8,5,5,5]; weights from
``deterministic_video_weights``: ``deterministic_tensors`` with ``quant_conv`` scaled by ``QUANT_CONV_GAIN``, the same on
every machine, their sha256 recorded), the inputs and
the reference's outputs, in fp32, each clip run on its own:

* ``whole``: a 17-frame clip in one causal pass (``numpy2tensor`` -> ``encode`` ->
  ``decode_code`` -> ``tensor2numpy``), indices and decoded uint8 frames;
* ``chunked``: a 34-frame clip as ``CausalVideoTokenizer.forward`` feeds it with
  ``temporal_window=17``: two independent windows, their indices concatenated; and the first
  33 frames of it in one pass, so the test can count what chunking changes;
* ``padded``: a 12-frame 40x40 clip through the reference's ``pad_video_batch`` (zeros to
  48x48, frames repeated to 17) then ``encode``;
* ``given``: random indices and their decoded frames.

It also traces the reference's ``encoder_jit()`` / ``decoder_jit()`` (the form NVIDIA
publishes) for each model, imports the two archives with ``vqserve import cosmos --config``
and prints whether the tensors and the imported model's indices equal the reference's (the
archives hold the 64,000-code FSQ table twice, a few MB, so they are not kept; the test
traces vqserve's own modules into archives of the same layout instead).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_cosmos_fixtures import import_reference  # noqa: E402  (a sibling script)

from vqserve.model.families.cosmos.family import REFERENCE_COMMIT, weights_digest  # noqa: E402
from vqserve.model.families.cosmos.video import (  # noqa: E402
    CosmosVideoConfig,
    CosmosVideoTokenizer,
    deterministic_video_weights,
)

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "cosmos_video"
SMALL = dict(channels=16, channels_mult=[1, 2, 2], num_res_blocks=1, z_channels=8)
FIXTURE_ARCHS = {
    "dv4x8": CosmosVideoConfig(spatial_compression=8, temporal_compression=4, **SMALL),
    "dv8x8": CosmosVideoConfig(spatial_compression=8, temporal_compression=8, **SMALL),
    # attention in a level too (nominal resolution 32 at level 1), as the 0.1 configs never have
    "dv8x16": CosmosVideoConfig(spatial_compression=16, temporal_compression=8, resolution=128,
                                attn_resolutions=[16], **SMALL),
}
SEEDS = {"dv4x8": 11, "dv8x8": 12, "dv8x16": 13}
PRESET_OF = {"dv4x8": "DV4x8x8", "dv8x8": "DV8x8x8", "dv8x16": "DV8x16x16"}

def moving_clip(frames: int, height: int, width: int, start: int = 0) -> np.ndarray:
    """uint8 [frames, H, W, 3]: a window sliding over a scikit-image photograph, with motion
    in both directions (so that time matters), then noise on every third frame's corner."""
    from PIL import Image
    from skimage import data as skdata

    photo = np.asarray(Image.fromarray(skdata.astronaut()).resize((160, 160), Image.BICUBIC))
    rng = np.random.default_rng(start)
    out = []
    for f in range(start, start + frames):
        y, x = (3 * f) % (160 - height), (2 * f + f * f // 7) % (160 - width)
        frame = photo[y:y + height, x:x + width].copy()
        if f % 3 == 0:
            frame[:8, :8] = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        out.append(frame)
    return np.stack(out)


def reference_model(ref, arch: CosmosVideoConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    config = dict(ref.configs.DV.value)
    config.update({k: v for k, v in asdict(arch).items() if k in config or k in ("legacy_mode",)})
    model = ref.models.DV.value(**config)
    model.load_state_dict(weights, strict=True)
    return model.eval().to(dtype=torch.float32)  # the keyword also sets the quantizer's dtype


@torch.no_grad()
def ref_encode(ref, model, clip: np.ndarray) -> torch.Tensor:
    indices = model.encode(ref.utils.numpy2tensor(clip[None], dtype=torch.float32, device="cpu"))[0]
    return indices.to(torch.int64)


@torch.no_grad()
def ref_decode(ref, model, indices: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(ref.utils.tensor2numpy(model.decode_code(indices.to(torch.int32))))


def make_fixtures(ref, out: Path) -> dict:
    torch.set_num_threads(1)
    cases: dict[str, torch.Tensor] = {}
    checks: dict = {"reference": f"NVIDIA/Cosmos-Tokenizer@{REFERENCE_COMMIT}", "torch": torch.__version__}
    clips = {"whole": moving_clip(17, 48, 64), "chunked": moving_clip(34, 48, 64, start=5),
             "padded": moving_clip(12, 40, 40, start=9)}
    for name, clip in clips.items():
        cases[f"{name}_clip"] = torch.from_numpy(clip)
    for tag, arch in FIXTURE_ARCHS.items():
        mine = CosmosVideoTokenizer(arch).eval()
        weights = deterministic_video_weights(arch, SEEDS[tag])
        mine.load_state_dict(weights)
        model = reference_model(ref, arch, weights)
        cases[f"{tag}_weights_sha256"] = torch.frombuffer(bytearray.fromhex(weights_digest(weights)), dtype=torch.uint8)
        whole = ref_encode(ref, model, clips["whole"])
        cases[f"{tag}_whole_indices"] = whole
        cases[f"{tag}_whole_decoded_uint8"] = ref_decode(ref, model, whole)
        chunked = clips["chunked"]
        cases[f"{tag}_chunked_indices"] = torch.cat([ref_encode(ref, model, chunked[s:s + 17]) for s in (0, 17)], 1)
        cases[f"{tag}_chunked_whole33_indices"] = ref_encode(ref, model, chunked[:33])
        padded, _crop = ref.utils.pad_video_batch(clips["padded"][None])
        cases[f"{tag}_padded_indices"] = ref_encode(ref, model, padded[0])
        given = torch.randint(0, 64000, (1, 2, 2, 3), generator=torch.Generator().manual_seed(SEEDS[tag]))
        cases[f"{tag}_given_indices"] = given
        cases[f"{tag}_given_decoded_uint8"] = ref_decode(ref, model, given)
        got = mine.encode(torch.from_numpy(clips["whole"][None]))
        checks[f"{tag}_whole_equal"] = bool(torch.equal(got, whole))
        checks[f"{tag}_whole_distinct_codes"] = int(whole.unique().numel())
        checks[f"{tag}_decoded_equal"] = bool(torch.equal(mine.decode(whole), cases[f"{tag}_whole_decoded_uint8"]))
        checks[f"{tag}_jit_import"] = check_jit_import(model, arch, clips["whole"], whole, tag)
    out.mkdir(parents=True, exist_ok=True)
    archs = {tag: {"seed": SEEDS[tag], "config": asdict(arch)} for tag, arch in FIXTURE_ARCHS.items()}
    save_file({k: v.contiguous() for k, v in cases.items()}, str(out / "cases.safetensors"),
              metadata={"reference": checks["reference"], "torch": torch.__version__, "archs": json.dumps(archs)})
    return checks


def check_jit_import(model, arch: CosmosVideoConfig, clip: np.ndarray, indices: torch.Tensor, tag: str) -> dict:
    """Trace ``encoder_jit()`` / ``decoder_jit()`` from the reference, as NVIDIA publishes them,
    import the two archives with vqserve's reader, and compare tensors and tokens."""
    from vqserve.model.checkpoint import load_tokenizer
    from vqserve.model.families.cosmos.importer import import_cosmos, read_torchscript_tensors

    x = torch.from_numpy(np.ascontiguousarray(clip[None].transpose(0, 4, 1, 2, 3))).float() / 127.5 - 1
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        where = Path(tmp)
        torch.jit.trace(model.encoder_jit(), x, check_trace=False).save(str(where / "encoder.jit"))
        torch.jit.trace(model.decoder_jit(), indices.to(torch.int32), check_trace=False).save(str(where / "decoder.jit"))
        read = {**read_torchscript_tensors(where / "encoder.jit"), **read_torchscript_tensors(where / "decoder.jit")}
        _, imported_arch = import_cosmos(where, where / "imported", preset=PRESET_OF[tag])
        tok = load_tokenizer(where / "imported")
        return {"archive_tensors_equal_state_dict": all(torch.equal(read[k], v) for k, v in model.state_dict().items()),
                "archive_names": sorted({k.split(".")[0] for k in read}),
                "imported_indices_equal": bool(torch.equal(tok.encode(torch.from_numpy(clip[None])), indices)),
                "imported_config_equal_but_attention_numbers": asdict(imported_arch) | {"attn_resolutions": 0,
                    "resolution": 0} == asdict(arch) | {"attn_resolutions": 0, "resolution": 0}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, type=Path, help="Cosmos-Tokenizer checkout (outside the repo)")
    parser.add_argument("--out", type=Path, default=OUT, help="fixtures directory (default tests/fixtures/cosmos_video)")
    args = parser.parse_args()
    checks = make_fixtures(import_reference(args.reference.resolve()), args.out)
    print(json.dumps(checks, indent=2))


if __name__ == "__main__":
    main()
