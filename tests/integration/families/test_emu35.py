"""Emu3.5's VisionTokenizer (an IBQ-family preset) against Emu3.5's own code: fixtures made
once by the original (tests/fixtures/emu35/README.md), imported from its released layout
(config.yaml + model.ckpt), the importer's refusals, the quantizer's memory plan, a real gRPC
server with non-square images, `vqserve tokenize`, a TorchScript export.

The fixture model is a small random-initialised ``IBQ`` built by Emu3.5's own class from
tests/fixtures/emu35/config.yaml (ch 32, ch_mult [1, 2, 1], one block, attention at the
middle level, 512 x 8 codes, factor 4).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from tests.helpers import (
    FIXTURES_DIR,
    assert_matches_reference,
)
from tests.integration.families.kit import CodePayload, emu35_release, fixture_weights
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.ibq.emu35 import import_emu35
from vqserve.model.families.ibq.family import IBQ, Emu35Decoder
from vqserve.model.tokenizer import pixels_to_float

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "emu35"


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("emu35")
    out, arch = import_emu35([emu35_release(root / "Emu3.5-VisionTokenizer")], root / "imported")
    assert (arch.attention_levels, arch.pixel_rule, arch.factor, arch.codebook_size) == ([1], "emu3.5", 4, 512)
    return str(out)


@pytest.fixture(scope="module")
def tok(imported):
    return load_tokenizer(imported)


@pytest.mark.parametrize("case", ["square", "rect"])
def test_indices_latents_and_pixels_equal_the_original(tok, cases, case):
    images = cases[f"{case}_images"]
    assert isinstance(tok.decoder, Emu35Decoder)
    assert_matches_reference(tok.encode(images), cases[f"{case}_indices"], "indices")
    latents = tok.encode_latents(pixels_to_float(images, tok.pixel_range))
    assert_matches_reference(latents, cases[f"{case}_latents"], "latents")
    reference = cases[f"{case}_indices"]
    assert_matches_reference(tok.decode(reference), cases[f"{case}_decoded_uint8"], "pixels")
    one_by_one = torch.cat([tok.decode(reference[i:i + 1]) for i in range(len(reference))])
    assert_matches_reference(one_by_one, cases[f"{case}_decoded1_uint8"], "pixels")


def test_ties_and_whole_images_keep_the_original_indices(tok, cases):
    """Latents equal to a code with an exact and a near copy: the original's indices; and the
    images (scored whole, the island's default) give the original's indices."""
    _, indices = tok.quantizer(cases["tie_z"].permute(0, 2, 3, 1))
    assert torch.equal(indices, cases["tie_indices"])
    for case in ("square", "rect"):
        assert torch.equal(tok.encode(cases[f"{case}_images"]), cases[f"{case}_indices"])


def test_import_writes_an_ibq_directory_from_every_released_form(imported, tmp_path, cases):
    path = Path(imported)
    assert family_for(path) is IBQ
    config = json.loads((path / "config.json").read_text())
    assert config["format"] == "vqserve-ibq" and config["pixel_rule"] == "emu3.5"
    assert config["meta"]["reference"].startswith("baaivision/Emu3.5@") and config["meta"]["imported_from"] == "model.ckpt"
    # {"state_dict": ...}, the two files named apart, and a .safetensors state dict
    wrapped = emu35_release(tmp_path / "wrapped", {"state_dict": fixture_weights(FIXTURES)})
    out, _ = import_emu35([wrapped / "model.ckpt", wrapped / "config.yaml"], tmp_path / "w", preset=None)
    assert torch.equal(load_tokenizer(out).encode(cases["rect_images"]), cases["rect_indices"])
    st = tmp_path / "st"
    st.mkdir()
    (st / "config.yaml").write_text((FIXTURES / "config.yaml").read_text())
    save_file(fixture_weights(FIXTURES), str(st / "model.safetensors"))
    out, _ = import_emu35([st], tmp_path / "s")
    assert torch.equal(load_tokenizer(out).encode(cases["rect_images"]), cases["rect_indices"])


def _bad_sources(tmp_path: Path) -> dict[str, tuple[list[Path], str, str | None]]:
    good = fixture_weights(FIXTURES)
    cfg = yaml.safe_load((FIXTURES / "config.yaml").read_text())

    def folder(name: str, state: object = None, config: dict | str | None = None) -> list[Path]:
        text = config if isinstance(config, str) or config is None else yaml.safe_dump(config)
        return [emu35_release(tmp_path / name, state, text)]

    def with_dd(**changes) -> dict:
        return {**cfg, "ddconfig": {**cfg["ddconfig"], **changes}}

    without = {k: v for k, v in good.items() if k != "post_quant_conv.bias"}
    wrong = {**good, "quant_conv.weight": torch.zeros(8, 32, 3, 3)}
    return {
        "missing": (folder("missing", without), r"1 missing \(first post_quant_conv.bias\)", None),
        "wrong shape": (folder("wrong", wrong), r"quant_conv.weight has shape \(8, 32, 3, 3\), the config needs "
                                                r"\(8, 32, 1, 1\)", None),
        "stray": (folder("stray", {**good, "loss.logvar": torch.zeros(1)}),
                  r"1 tensor\(s\) that Emu3.5's IBQ does not have \(first loss.logvar\)", None),
        "config says otherwise": (folder("other", config=with_dd(num_res_blocks=2)),
                                  r"does not fit the Emu3.5 VisionTokenizer architecture: \d+ missing", None),
        "double_z": (folder("dz", config=with_dd(double_z=True)), "with double_z false", None),
        "not yaml": (folder("ny", config="ddconfig: [unclosed"), "config.yaml: not readable YAML", None),
        "no ddconfig": (folder("nd", config={"n_embed": 4}), "expected a mapping with ddconfig", None),
        "code payload": (folder("evil", {**good, "hook": CodePayload(tmp_path / "PWNED")}),
                         r"refused, this pickle holds more than weights \(it names posix.mkdir\)", None),
        "preset": (folder("preset"), "--config emu3.5 expects codebook_size 131072, the config has 512", "emu3.5"),
    }


def test_bad_sources_get_one_line_errors_and_write_nothing(tmp_path):
    for what, (sources, message, preset) in _bad_sources(tmp_path).items():
        out = tmp_path / f"out-{what.replace(' ', '-')}"
        with pytest.raises(ValueError, match=message) as err:
            import_emu35(sources, out, preset=preset)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what
    assert not (tmp_path / "PWNED").exists()


def test_torchscript_export_keeps_the_tokens_and_proves_the_island(imported, tmp_path, cases):
    from vqserve.export.exporter import export_model
    from vqserve.export.runtimes.loader import load_runtime

    manifest = export_model(imported, "torchscript", "bf16", tmp_path / "bf16", min_agreement=0.0,
                            parity_size=32, parity_count=2)
    island = manifest["fp32_island"]["encode"]
    assert island["ok"] and set(island["island_float_dtypes"]) <= {"float32"}
    manifest = export_model(imported, "torchscript", "fp32", tmp_path / "ts", parity_size=32, parity_count=2)
    assert manifest["parity"]["index_agreement"] == 1.0
    runtime = load_runtime(tmp_path / "ts")
    np.testing.assert_array_equal(runtime.encode(cases["rect_images"].numpy()), cases["rect_indices"].numpy())
