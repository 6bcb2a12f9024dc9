"""The SBER-MoVQGAN family against MoVQGAN's own code: fixtures made once by the original
modules (tests/fixtures/movqgan, written by scripts/make_movqgan_fixtures.py), the importer
(published models recognised by their tensors, refusals), a real gRPC server, `vqserve
tokenize` and exports.

The fixture model is a small random configuration of the original ``MOVQ`` (ch 32, ch_mult
[1, 2], one block per level, attention at the lowest resolution, 512 codes of 4 dimensions,
factor 2); the reference decoded batches of two grids and single grids of other sizes than
its own ``decode_code`` allows (that is fixed to one 32x32 grid): the same operations.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import FIXTURES_DIR
from tests.integration.families.kit import check_against_fixtures, fixture_weights
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.movqgan.family import MOVQGAN, PRESETS, MovqganTokenizer
from vqserve.model.families.movqgan.importer import import_movqgan, published_architecture
from vqserve.model.families.taming.layout import to_taming_name

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "movqgan"


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """As published: a bare state dict (get_movqgan_model loads it with strict=False)."""
    path = tmp_path_factory.mktemp("movqgan") / "movqgan_small.ckpt"
    torch.save(fixture_weights(FIXTURES), path)
    return path


@pytest.fixture(scope="module")
def imported(checkpoint, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("imported") / "movqgan-small"
    import_movqgan(checkpoint, out, FIXTURES / "config.yaml")
    return str(out)


@pytest.fixture(scope="module")
def tok(imported) -> MovqganTokenizer:
    return load_tokenizer(imported)


def test_indices_latents_and_pixels_equal_the_original(tok, cases):
    check_against_fixtures(tok, cases)


def test_pixels_are_the_notebooks_float32_rule_for_every_value(tok):
    import numpy as np

    values = np.arange(256, dtype=np.uint8)
    expected = torch.from_numpy(values.astype(np.float32) / 127.5 - 1)
    assert torch.equal(tok.encoder.normalise(torch.arange(256.0)), expected)
    y = torch.linspace(-1.2, 1.2, 4001)
    assert torch.equal(tok.decoder.to_pixels(y), ((y + 1) * 127.5).round().clamp(0, 255))


@pytest.mark.parametrize("name", ["67M", "102M", "270M"])
def test_published_models_have_the_original_tensor_names_and_shapes_and_are_recognised(name):
    published = json.loads((FIXTURES / "published_keys.json").read_text())[name]
    with torch.device("meta"):
        ours = MovqganTokenizer(PRESETS[name])
        state = {k: torch.empty(v) for k, v in published.items()}
    assert {to_taming_name(k, 4): list(v.shape) for k, v in ours.state_dict().items()} == published
    assert published_architecture(state, "published") == PRESETS[name]
    with pytest.raises(ValueError, match="not those of SBER-MoVQGAN"):
        published_architecture(state, "published", "270M" if name != "270M" else "67M")


def test_import_records_what_it_read_and_ignores_ema_copies(imported, tmp_path):
    path = Path(imported)
    assert family_for(path) is MOVQGAN
    config = json.loads((path / "config.json").read_text())
    assert config["pixels"] == "movqgan" and config["meta"]["reference"].startswith("ai-forever/MoVQGAN@f3976d87")
    weights = fixture_weights(FIXTURES)
    ema = {"ema_encoder.conv_inweight": torch.zeros(32, 3, 3, 3), "ema_encoder.decay": torch.tensor(0.9999)}
    torch.save({"state_dict": {**weights, **ema}}, tmp_path / "train.ckpt")
    out, _ = import_movqgan(tmp_path / "train.ckpt", tmp_path / "out", FIXTURES / "config.yaml")
    assert json.loads((out / "config.json").read_text())["meta"]["dropped_training_only"] == {"ema_encoder": 2}


def test_bad_checkpoints_get_one_line_errors_and_write_nothing(checkpoint, tmp_path):
    weights = fixture_weights(FIXTURES)
    taming = FIXTURES_DIR / "taming"
    torch.save({k: v for k, v in weights.items() if not k.endswith("conv_y.weight")}, tmp_path / "missing.ckpt")
    bad = {
        "not a published model, no yaml": (checkpoint, None, r"movqgan_small.ckpt: its tensors are those of none"),
        "a taming checkpoint": (tmp_path / "t.ckpt", FIXTURES / "config.yaml", r"t.ckpt does not match"),
        "a taming yaml": (checkpoint, taming / "config.yaml", r"VQModel is not a SBER-MoVQGAN .*vqserve import taming"),
        "missing spatial norm": (tmp_path / "missing.ckpt", FIXTURES / "config.yaml", r"missing \(first decoder."),
    }
    torch.save(fixture_weights(taming), tmp_path / "t.ckpt")
    for what, (path, config, message) in bad.items():
        out = tmp_path / f"out-{what.replace(' ', '-')}"
        with pytest.raises(ValueError, match=message) as err:
            import_movqgan(path, out, config)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what
