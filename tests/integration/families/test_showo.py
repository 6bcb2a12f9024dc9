"""The Show-o family against Show-o's own code: fixtures made once by the original
(tests/fixtures/showo/README.md), imported from the released layout (config.json +
pytorch_model.safetensors), the importer's refusals, a real gRPC server, `vqserve tokenize`,
exports.

The fixture model is a small random-initialised ``MAGVITv2`` built from Show-o's own classes
(ch 32, encoder ch_mult [1, 2, 1] with blocks [1, 2, 1], decoder [2, 1, 1] with [1, 1, 2],
LFQ 10 bits = 1,024 codes, factor 4).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    FIXTURES_DIR,
    assert_matches_reference,
)
from tests.integration.families.kit import SHOWO_CONFIG, showo_release, showo_state
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.showo.family import (
    PRESETS,
    SHOWO,
    ShowoConfig,
    ShowoLFQ,
    ShowoTokenizer,
)
from vqserve.model.families.showo.importer import import_showo, infer_architecture, lfq_buffers
from vqserve.model.families.taming.layout import LEVEL_INVERSE, rename
from vqserve.model.tokenizer import pixels_to_float

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "showo"
SMALL = ShowoConfig(base_channels=32, encoder_ch_mult=[1, 2, 1], encoder_blocks=[1, 2, 1],
                    decoder_ch_mult=[2, 1, 1], decoder_blocks=[1, 1, 2], z_channels=10)
@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("showo")
    out, arch = import_showo([showo_release(root / "magvitv2")], root / "imported")
    assert arch == SMALL
    return str(out)


@pytest.fixture(scope="module")
def tok(imported) -> ShowoTokenizer:
    return load_tokenizer(imported)


# ---- the same tokens and pixels as Show-o's own code (fp32) ----------------------------------
@pytest.mark.parametrize("case", ["square", "rect"])
def test_indices_latents_and_pixels_equal_the_original(tok, cases, case):
    images = cases[f"{case}_images"]
    indices = tok.encode(images)
    assert_matches_reference(indices, cases[f"{case}_indices"], "indices")  # msb-first bit order included
    latents = tok.encode_latents(pixels_to_float(images, tok.pixel_range))
    assert_matches_reference(latents, cases[f"{case}_latents"], "latents")
    reference = cases[f"{case}_indices"]
    assert_matches_reference(tok.decode(reference), cases[f"{case}_decoded_uint8"], "pixels")
    one_by_one = torch.cat([tok.decode(reference[i:i + 1]) for i in range(len(reference))])
    assert_matches_reference(one_by_one, cases[f"{case}_decoded1_uint8"], "pixels")
    one_each = torch.cat([tok.encode(images[i:i + 1]) for i in range(len(images))])
    assert torch.equal(one_each, indices)  # batch-invariant


def test_decode_of_given_indices_equals_the_original(tok, cases):
    assert_matches_reference(tok.decode(cases["given_indices"]), cases["given_decoded_uint8"], "pixels")
    assert_matches_reference(tok.decode(cases["row_indices"]), cases["row_decoded_uint8"], "pixels")


def test_lfq_bit_order_and_edge_values_equal_the_original(tok, cases):
    """0, -0, subnormals, +-inf, NaN and latents so large that Show-o's ``z + (q - z)`` is 0:
    the original's indices; channel 0 is the most significant bit; codes are its embedding rows."""
    z = cases["lfq_z"].permute(0, 2, 3, 1)
    codes, indices = tok.quantizer(z)
    assert torch.equal(indices, cases["lfq_indices"])
    assert torch.equal(codes.permute(0, 3, 1, 2), cases["lfq_codes"])
    plain = ((z > 0).to(torch.int64) * 2 ** torch.arange(9, -1, -1)).sum(-1)
    assert not torch.equal(plain, cases["lfq_indices"])  # the plain sign test would differ: +inf, 2^25 + 4 ...
    one_hot = torch.where(torch.eye(10, dtype=torch.bool), 1.0, -1.0)
    assert tok.quantizer(one_hot)[1].tolist() == [2 ** (9 - k) for k in range(10)]  # most significant first
    assert torch.equal(tok.quantizer(z.to(torch.bfloat16))[1], tok.quantizer(z.to(torch.bfloat16).float())[1])
    q = ShowoLFQ(13).to(torch.bfloat16)
    idx = torch.randint(0, 2 ** 13, (3, 5), generator=torch.Generator().manual_seed(0))
    assert q.mask.dtype == torch.int64 and torch.equal(q(q.indices_to_codes(idx))[1], idx)


# ---- the published architecture ---------------------------------------------------------------
def test_published_architecture_has_the_original_names_and_shapes():
    """``MAGVITv2()``'s state dict (published_keys.json, written by Show-o's code) is vqserve's
    default architecture under the importer's renames, plus the two LFQ buffers; its shapes
    alone give back the preset (factor 16, 8,192 codes)."""
    published = json.loads((FIXTURES / "published_keys.json").read_text())
    arch = PRESETS["magvitv2"]
    with torch.device("meta"):
        ours = ShowoTokenizer(arch).state_dict()
    names = {rename(k, LEVEL_INVERSE, 5): list(v.shape) for k, v in ours.items()}
    names.update({k: list(v.shape) for k, v in lfq_buffers(13).items()})
    assert names == published
    with torch.device("meta"):
        state = {k: torch.empty(v) for k, v in published.items()}
    assert infer_architecture(state, "published") == arch
    assert (arch.factor, arch.codebook_size) == (16, 8192)


# ---- the importer -----------------------------------------------------------------------------
def test_import_writes_a_family_directory(imported, tmp_path, cases):
    path = Path(imported)
    assert family_for(path) is SHOWO
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    meta = json.loads((path / "config.json").read_text())["meta"]
    assert meta["imported_from"] == "pytorch_model.safetensors" and meta["reference"].startswith("showlab/Show-o@")
    facts = SHOWO.read_config(path)
    assert (facts.factor, facts.codebook_size, facts.quantizer) == (4, 1024, "lfq")
    # the two files named one by one, in either order
    folder = showo_release(tmp_path / "files")
    out, _ = import_showo([folder / "pytorch_model.safetensors", folder / "config.json"], tmp_path / "two")
    assert torch.equal(load_tokenizer(out).encode(cases["rect_images"]), cases["rect_indices"])


def _bad_sources(tmp_path: Path) -> dict[str, tuple[list[Path], str]]:
    good = showo_state()

    def folder(name: str, state: dict | None = None, config: dict | None = None) -> list[Path]:
        return [showo_release(tmp_path / name, state, config)]

    without = {k: v for k, v in good.items() if k != "decoder.conv_out.bias"}
    wrong = {**good, "encoder.mid.block_1.conv1.weight": torch.zeros(32, 32, 1, 1)}
    lsb = {**good, "quantize.power_vals": 2 ** torch.arange(10)}
    flipped = {**good, "quantize.embedding": -good["quantize.embedding"]}
    pickled = tmp_path / "pickle"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(SHOWO_CONFIG))
    torch.save(good, pickled / "pytorch_model.bin")
    damaged = folder("damaged")
    weights = damaged[0] / "pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    return {
        "missing": (folder("missing", without), r"1 missing \(first decoder.conv_out.bias\)"),
        "wrong shape": (folder("wrong", wrong), r"encoder.mid.block_1.conv1.weight has shape \(32, 32, 1, 1\), "
                                                r"the config needs \(32, 32, 3, 3\)"),
        "lsb-first buffers": (folder("lsb", lsb), "quantize.power_vals is not Show-o's LFQ power_vals"),
        "other codebook": (folder("flip", flipped), "quantize.embedding is not Show-o's LFQ embedding"),
        "stray tensor": (folder("stray", {**good, "vq.weight": torch.zeros(2)}),
                         r"1 tensor\(s\) that Show-o's MAGVITv2 does not have \(first vq.weight\)"),
        "pickle only": ([pickled], "pytorch_model.bin: vqserve reads weights from safetensors only"),
        "damaged": (damaged, "pytorch_model.safetensors: not a readable safetensors file"),
        "other class": (folder("cls", config={"_class_name": "VQModel"}), "_class_name must be 'MAGVITv2'"),
        "config keys": (folder("keys", config={**SHOWO_CONFIG, "ch": 64}), r"unexpected keys \['ch'\]"),
        "not json": ([tmp_path / "nj" / "config.json", tmp_path / "nj" / "pytorch_model.safetensors"],
                     "does not exist or is not a file"),
        "wrong preset": (folder("preset"), "--config magvitv2 expects base_channels 128, the checkpoint has 32"),
    }


def test_bad_sources_get_one_line_errors_and_write_nothing(tmp_path):
    for what, (sources, message) in _bad_sources(tmp_path).items():
        out = tmp_path / f"out-{what.replace(' ', '-')}"
        preset = "magvitv2" if what == "wrong preset" else None
        with pytest.raises(ValueError, match=message) as err:
            import_showo(sources, out, preset=preset)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what


def test_torchscript_export_keeps_the_tokens_and_proves_the_island(imported, tmp_path, cases):
    from vqserve.export.exporter import export_model
    from vqserve.export.runtimes.loader import load_runtime

    manifest = export_model(imported, "torchscript", "fp32", tmp_path / "ts", parity_size=32, parity_count=2)
    assert manifest["parity"]["index_agreement"] == 1.0
    runtime = load_runtime(tmp_path / "ts")
    for case in ("square", "rect"):
        np.testing.assert_array_equal(runtime.encode(cases[f"{case}_images"].numpy()), cases[f"{case}_indices"].numpy())
    manifest = export_model(imported, "torchscript", "bf16", tmp_path / "bf16", min_agreement=0.0,
                            parity_size=32, parity_count=2)
    island = manifest["fp32_island"]["encode"]
    assert island["ok"] and set(island["island_float_dtypes"]) <= {"float32"} and "gt" in island["quantizer_ops"]
    assert "bfloat16" in island["network_conv_dtypes"]
