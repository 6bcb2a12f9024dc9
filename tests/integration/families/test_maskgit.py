"""The MaskGIT-VQGAN family against open-muse's own ``MaskGitVQGAN``: fixtures made once by the
original class (tests/fixtures/maskgit, written by scripts/make_maskgit_fixtures.py), the
importer (the released folder, its refusals, a MaskGIT state dict refused by `vqserve import
taming`), a real gRPC server, `vqserve tokenize` and exports.

The fixture model is a small random configuration of the original (hidden 32, channel_mult
[1, 2], two blocks per level so the shortcut quirk runs at both width changes, 512 codes of 16,
factor 2); its ``config.json`` is what the class's own ``save_pretrained`` writes, and the
released folder is rebuilt here from it and a ``torch.save``d state dict (``pytorch_model.bin``).
The reference decoded non-square grids too (``get_codebook_entry``'s ops with the grid's own
height and width, where the original reshapes to a square): vqserve decodes any grid.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import FIXTURES_DIR
from tests.integration.families.kit import (
    CodePayload,
    check_against_fixtures,
    fixture_weights,
    maskgit_release,
)
from vqserve.cli import main as cli_main
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.maskgit.family import MASKGIT, PRESETS, MaskgitTokenizer
from vqserve.model.families.maskgit.importer import expected_shapes, import_maskgit
from vqserve.model.families.taming.importer import import_taming

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "maskgit"


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    return maskgit_release(tmp_path_factory.mktemp("maskgit") / "maskgit-small")


@pytest.fixture(scope="module")
def imported(released, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("imported") / "maskgit-small"
    import_maskgit(released, out)
    return str(out)


@pytest.fixture(scope="module")
def tok(imported) -> MaskgitTokenizer:
    return load_tokenizer(imported)


def test_indices_latents_and_pixels_equal_the_original(tok, cases):
    check_against_fixtures(tok, cases)


def test_pixels_are_totensor_in_and_open_muses_pil_rule_out_for_every_value(tok):
    values = np.arange(256, dtype=np.uint8)
    expected = torch.from_numpy(values).to(torch.float32).div(255)  # torchvision ToTensor
    assert torch.equal(tok.encoder.normalise(torch.arange(256.0)), expected)
    y = np.linspace(-0.2, 1.2, 4001, dtype=np.float32)
    pil = (255 * ((np.clip(2.0 * y - 1.0, -1.0, 1.0) + 1.0) / 2.0)).astype(np.uint8)  # to_pil_image
    assert np.array_equal(tok.decoder.to_pixels(torch.from_numpy(y)).numpy().astype(np.uint8), pil)


def test_the_shortcut_quirk_is_the_originals(tok):
    """Where a block changes width, nin_shortcut maps out -> out channels (it reads the output)."""
    shortcuts = {name: tuple(m.weight.shape) for name, m in tok.named_modules() if name.endswith("nin_shortcut")}
    assert shortcuts == {"encoder.down.1.block.0.nin_shortcut": (64, 64, 1, 1),
                         "decoder.up.0.block.0.nin_shortcut": (32, 32, 1, 1)}


def test_the_released_architecture_has_the_original_tensor_names_and_shapes():
    published = json.loads((FIXTURES / "published_keys.json").read_text())["imagenet-f16-256"]
    assert {k: list(v) for k, v in expected_shapes(PRESETS["imagenet-f16-256"]).items()} == published
    assert PRESETS["imagenet-f16-256"].factor == 16 and len(published) == 168


def test_import_records_what_it_read(imported, released):
    path = Path(imported)
    assert family_for(path) is MASKGIT
    config = json.loads((path / "config.json").read_text())
    assert config["format"] == "vqserve-maskgit" and config["pixels"] == "maskgit"
    meta = config["meta"]
    assert meta["reference"].startswith("huggingface/open-muse@64e1afe0")
    assert meta["imported_from"] == "pytorch_model.bin" and meta["source_config"]["_class_name"] == "MaskGitVQGAN"
    facts = MASKGIT.read_config(path)
    assert (facts.codebook_size, facts.factor, facts.latent_dim) == (512, 2, 16)


def test_the_weights_file_and_safetensors_import_the_same_model(released, imported, tmp_path):
    from_file, _ = import_maskgit(released / "pytorch_model.bin", tmp_path / "from-file")
    folder = tmp_path / "st"
    folder.mkdir()
    shutil.copy(released / "config.json", folder / "config.json")
    save_file(fixture_weights(FIXTURES), str(folder / "pytorch_model.safetensors"))
    from_st, _ = import_maskgit(folder, tmp_path / "from-st")
    reference = load_file(f"{imported}/model.safetensors")
    for out in (from_file, from_st):
        got = load_file(str(out / "model.safetensors"))
        assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in reference)
    assert json.loads((from_st / "config.json").read_text())["meta"]["imported_from"] == "pytorch_model.safetensors"


def test_bad_inputs_get_one_line_errors_naming_the_file_and_write_nothing(released, tmp_path):
    weights = fixture_weights(FIXTURES)
    config = json.loads((FIXTURES / "config.json").read_text())
    taming_weights = fixture_weights(FIXTURES_DIR / "taming")

    def folder(name: str, config_change=None, state=None, bare: bool = False) -> Path:
        data = dict(config)
        if config_change:
            config_change(data)
        path = maskgit_release(tmp_path / name, data, state)
        if bare:
            (path / "config.json").unlink()
        return path

    damaged = folder("damaged")
    (damaged / "pytorch_model.bin").write_bytes((released / "pytorch_model.bin").read_bytes()[:4000])
    var = folder("var")
    shutil.copy(FIXTURES_DIR / "var" / "weights.pth", var / "vae_ch160v4096z32.pth")
    payload = folder("payload")
    torch.save({**weights, "x": CodePayload(tmp_path / "PWNED")}, payload / "pytorch_model.bin")
    bad = {
        "no config": (folder("bare", bare=True), r"pytorch_model.bin: no config.json beside it"),
        "no weights": (tmp_path, r"no pytorch_model.safetensors / model.safetensors / pytorch_model.bin"),
        "missing tensor": (folder("missing", state={k: v for k, v in weights.items() if k != "decoder.conv_out.bias"}),
                           r"does not fit the MaskGIT-VQGAN architecture: 1 missing \(first decoder.conv_out.bias\)"),
        "extra tensor": (folder("extra", state={**weights, "encoder.extra.weight": torch.zeros(2)}),
                         r"1 unexpected \(first encoder.extra.weight\)"),
        "wrong shape": (folder("codes", lambda c: c.update(num_embeddings=1024)),
                        r"quantize.embedding.weight has shape \(512, 16\), the config needs \(1024, 16\)"),
        "taming .ckpt": (folder("taming", state={"state_dict": taming_weights}),
                         r"a Lightning checkpoint .*use `vqserve import taming`"),
        "taming state dict": (folder("taming-bare", state=taming_weights),
                              r"has quant_conv.weight\* tensors.*try `vqserve import taming`"),
        "VAR .pth": (var / "vae_ch160v4096z32.pth", r"vae_ch160v4096z32.pth: has quantize.quant_resi.\* tensors.*"
                                                    r"try `vqserve import var`"),
        "damaged": (damaged / "pytorch_model.bin", r"pytorch_model.bin: not a PyTorch checkpoint"),
        "code payload": (payload, r"pytorch_model.bin: refused, this pickle holds more than weights"),
        "another class": (folder("vqgan", lambda c: c.update(_class_name="VQGANModel")),
                          r"config.json: _class_name must be 'MaskGitVQGAN'.*got 'VQGANModel'"),
        "unknown key": (folder("unknown", lambda c: c.update(no_attn_mid_block=True)),
                        r"unknown MaskGitVQGAN arguments \['no_attn_mid_block'\]"),
        "grey": (folder("grey", lambda c: c.update(num_channels=1)), r"num_channels is 1"),
        "no projection": (folder("proj", lambda c: c.update(z_channels=32)), r"z_channels \(32\) must equal"),
        "not json": (folder("notjson"), r"config.json: not readable JSON"),
    }
    (tmp_path / "notjson" / "config.json").write_text("{not json")
    for what, (path, message) in bad.items():
        out = tmp_path / f"out-{what.replace(' ', '-')}"
        with pytest.raises(ValueError, match=message) as err:
            import_maskgit(path, out)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what
    assert not (tmp_path / "PWNED").exists()


def test_taming_import_without_a_yaml_refuses_a_maskgit_config_json_in_one_line(released, tmp_path):
    """(Its state dict, with a yaml, is refused by the family contract: the table's marks.)"""
    message = r"its config.json is open-muse's MaskGitVQGAN.*`vqserve import maskgit`"
    with pytest.raises(ValueError, match=message) as err:
        import_taming(released / "pytorch_model.bin", tmp_path / "out", None)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_cli_import_checks_the_preset(released, tmp_path, capsys):
    """(The import itself, its line and the served model: the family contract.)"""
    assert cli_main(["import", "maskgit", str(released), "--config", "imagenet-f16-256", "--out",
                     str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--config imagenet-f16-256 expects" in err and err.count("\n") == 1 and not (tmp_path / "x").exists()
