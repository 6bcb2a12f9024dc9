"""The taming family against taming-transformers' own code and against transformers' Chameleon.

Fixtures made once by taming's own modules (tests/fixtures/taming, written by
scripts/make_taming_fixtures.py): a small random model in taming's layout (ch 32, ch_mult
[1, 2], attention at the full resolution only, 512 codes of 8 dimensions, factor 2), its
yaml, and its indices, latents and decoded pixels. Then Chameleon: a transformers
``ChameleonVQVAE`` with random weights is turned into Meta's taming layout (transformers keeps
taming's tensor names and drops the decoder) plus a decoder, imported with ``vqserve import
taming``; its tokens equal the transformers family's on the same weights, and it decodes.
Then the importer's refusals, the CLI, a real gRPC server, `vqserve tokenize` and exports.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import FIXTURES_DIR
from tests.integration.families.kit import (
    CodePayload,
    check_against_fixtures,
    crops,
    fixture_weights,
    taming_checkpoint,
)
from vqserve.cli import main as cli_main
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.taming.family import PRESETS, TAMING, TamingConfig, TamingTokenizer
from vqserve.model.families.taming.importer import import_taming
from vqserve.model.families.taming.layout import to_taming_name, to_vqserve_name

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "taming"


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return taming_checkpoint(tmp_path_factory.mktemp("taming") / "last.ckpt", fixture_weights(FIXTURES))


@pytest.fixture(scope="module")
def imported(checkpoint, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("imported") / "taming-small"
    import_taming(checkpoint, out, FIXTURES / "config.yaml")
    return str(out)


@pytest.fixture(scope="module")
def tok(imported) -> TamingTokenizer:
    return load_tokenizer(imported)


# ---- the same tokens and pixels as taming's own code (fp32) ------------------------------------
def test_indices_latents_and_pixels_equal_the_original(tok, cases):
    check_against_fixtures(tok, cases)


def test_attention_sits_where_the_yaml_puts_it(tok):
    """attn_resolutions [32] at resolution 32: the full-resolution level only (not LlamaGen's)."""
    assert [len(level.attn) for level in tok.encoder.conv_blocks] == [1, 0]
    assert [len(level.attn) for level in tok.decoder.conv_blocks] == [0, 2]  # lowest first, 2 = blocks + 1


def test_import_records_what_it_read(imported, checkpoint):
    path = Path(imported)
    assert family_for(path) is TAMING
    config = json.loads((path / "config.json").read_text())
    assert config["pixels"] == "taming" and config["attn_resolutions"] == [32]
    meta = config["meta"]
    assert meta["dropped_training_only"] == {"loss": 2} and meta["config"] == "config.yaml"
    assert meta["reference"].startswith("CompVis/taming-transformers@3ba01b24")
    assert (TAMING.read_config(path).codebook_size, TAMING.read_config(path).factor) == (512, 2)


@pytest.mark.parametrize("name", ["imagenet-f16-16384", "chameleon"])
def test_published_architectures_have_the_original_tensor_names_and_shapes(name):
    published = json.loads((FIXTURES / "published_keys.json").read_text())[name]
    with torch.device("meta"):
        ours = TamingTokenizer(PRESETS[name])
    shapes = {to_taming_name(k, 5): list(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == published
    assert all(to_vqserve_name(to_taming_name(k, 5), 5) == k for k in ours.state_dict())
    assert PRESETS[name].factor == 16


# ---- Chameleon: Meta's taming-layout vqgan.ckpt vs transformers' ChameleonVQVAE ---------------
CHAMELEON_SMALL = dict(embed_dim=16, num_embeddings=512, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 2, 2], num_res_blocks=1, resolution=32, attn_resolutions=[16],
                       attn_type="vanilla")


@pytest.fixture(scope="module")
def chameleon(tmp_path_factory) -> dict:
    """A transformers ChameleonVQVAE (random networks, codebook from its own latents of photos),
    saved by save_pretrained, and the same weights in Meta's layout (vqgan.ckpt + vqgan.yaml)
    with a random decoder added (transformers has none)."""
    pytest.importorskip("transformers")
    from tests.fixtures.transformers.models import random_model, save_model

    root = tmp_path_factory.mktemp("chameleon")
    model = random_model("chameleon_vqgan", crops(32, corner=True), **CHAMELEON_SMALL)
    hf_dir = save_model(model, root / "hf")
    cfg = model.config
    arch = TamingConfig(base_channels=cfg.base_channels, ch_mult=list(cfg.channel_multiplier),
                        num_res_blocks=cfg.num_res_blocks, z_channels=cfg.latent_channels, resolution=cfg.resolution,
                        attn_resolutions=list(cfg.attn_resolutions), codebook_size=cfg.num_embeddings,
                        codebook_dim=cfg.embed_dim)
    torch.manual_seed(1)
    decoder = {to_taming_name(k, 3): v for k, v in TamingTokenizer(arch).state_dict().items()
               if k.startswith("decoder.") and not k.startswith("decoder.post_quant_conv.")}
    state = {**model.state_dict(), **decoder}  # transformers keeps taming's names for the encoder
    torch.save({"state_dict": state}, root / "vqgan.ckpt")
    ddconfig = dict(double_z=False, z_channels=cfg.latent_channels, resolution=cfg.resolution, in_channels=3,
                    out_ch=3, ch=cfg.base_channels, ch_mult=list(cfg.channel_multiplier),
                    num_res_blocks=cfg.num_res_blocks, attn_resolutions=list(cfg.attn_resolutions),
                    dropout=0.0, attn_type="vanilla")
    (root / "vqgan.yaml").write_text(yaml.safe_dump({"model": {
        "target": "taming.models.vqgan.VQModel",
        "params": {"embed_dim": cfg.embed_dim, "n_embed": cfg.num_embeddings, "ddconfig": ddconfig,
                   "lossconfig": {"target": "torch.nn.Identity"}, "ckpt_path": "/checkpoint/vqgan.ckpt"}}}))
    return {"model": model, "hf": hf_dir, "ckpt": root / "vqgan.ckpt", "yaml": root / "vqgan.yaml", "root": root}


def test_chameleon_taming_import_gives_the_transformers_tokens_and_decodes(chameleon):
    from tests.fixtures.transformers.models import oracle_indices

    out, arch = import_taming(chameleon["ckpt"], chameleon["root"] / "as-transformers", chameleon["yaml"],
                              pixels="chameleon-transformers")
    ours, served = load_tokenizer(out), load_tokenizer(chameleon["hf"])
    assert served.config.family == "transformers-chameleon" and served.decoder is None
    for images in (crops(32, corner=False), crops(32, corner=False, width=48)):
        tokens = ours.encode(torch.from_numpy(images))
        assert torch.equal(tokens, served.encode(torch.from_numpy(images)))
        assert np.array_equal(tokens.numpy(), oracle_indices(chameleon["model"], "chameleon_vqgan", images))
        decoded = ours.decode(tokens)
        assert decoded.shape == images.shape and decoded.dtype == torch.uint8
    assert json.loads((Path(out) / "config.json").read_text())["pixels"] == "chameleon-transformers"


def test_chameleon_default_pixels_are_metas_image_tokenizer(chameleon):
    """Meta's ImageTokenizer feeds (x / 255 * 2 - 1) in float64, then float32: the transformers
    class fed those pixels is Meta's VQModel.encode on the same weights."""

    out, _ = import_taming(chameleon["ckpt"], chameleon["root"] / "meta", chameleon["yaml"])
    images = crops(32, corner=False)
    meta_pixels = torch.from_numpy(images / 255.0 * 2 - 1).permute(0, 3, 1, 2).float().contiguous()
    with torch.no_grad():
        expected = chameleon["model"].encode(meta_pixels).image_tokens.view(len(images), 8, 8)
    assert torch.equal(load_tokenizer(out).encode(torch.from_numpy(images)), expected)


# ---- refusals ---------------------------------------------------------------------------------
def test_bad_inputs_get_one_line_errors_naming_the_file_and_write_nothing(tmp_path, checkpoint):
    weights = fixture_weights(FIXTURES)
    good_yaml = FIXTURES / "config.yaml"
    config = yaml.safe_load(good_yaml.read_text())

    def save(name: str, obj) -> Path:
        torch.save(obj, tmp_path / name)
        return tmp_path / name

    def yaml_with(name: str, change) -> Path:
        data = json.loads(json.dumps(config))
        change(data["model"]["params"])
        (tmp_path / name).write_text(yaml.safe_dump(data))
        return tmp_path / name

    # a VAR VQVAE .pth: taming-like encoder names, but its quantizer is multi-scale
    var_like = {**weights, "quantize.quant_resi.qresi_ls.0.weight": torch.zeros(8, 8, 3, 3)}
    (tmp_path / "truncated.ckpt").write_bytes(checkpoint.read_bytes()[:4000])
    bad = {
        "VAR .pth": (save("vae_ch160v4096z32.pth", var_like), good_yaml,
                     r"vae_ch160v4096z32.pth does not match .*config.yaml: 1 unexpected \(first quantize.quant_resi"),
        "yaml of another model": (checkpoint, yaml_with("wide.yaml", lambda p: p["ddconfig"].update(ch=64)),
                                  r"last.ckpt does not match .*wide.yaml: encoder.conv_in.weight has shape"),
        "codebook size": (checkpoint, yaml_with("codes.yaml", lambda p: p.update(n_embed=1024)),
                          r"quantize.embedding.weight has shape \(512, 8\), the yaml needs \(1024, 8\)"),
        "missing tensor": (save("missing.ckpt", {"state_dict": {k: v for k, v in weights.items()
                                                              if k != "decoder.conv_out.bias"}}), good_yaml,
                           r"1 missing \(first decoder.conv_out.bias\)"),
        "stray tensor": (save("stray.ckpt", {"state_dict": {**weights, "transformer.wte.weight": torch.zeros(2)}}),
                         good_yaml, r"stray.ckpt: 1 tensor\(s\) that a taming VQGAN does not have"),
        "damaged": (tmp_path / "truncated.ckpt", good_yaml, r"truncated.ckpt: not a PyTorch checkpoint"),
        "code payload": (save("evil.ckpt", {"state_dict": weights, "x": CodePayload(tmp_path / "PWNED")}), good_yaml,
                         r"evil.ckpt: refused, this pickle holds more than weights"),
        "no yaml": (checkpoint, None, r"last.ckpt: no --config; a taming VQGAN checkpoint carries no architecture"),
        "yaml missing": (checkpoint, tmp_path / "nope.yaml", r"config '.*nope.yaml' does not exist"),
        "gumbel": (checkpoint, yaml_with("gumbel.yaml", lambda p: None), None),
        "MoVQGAN yaml": (checkpoint, FIXTURES_DIR / "movqgan" / "config.yaml", r"use `vqserve import movqgan`"),
        "remap": (checkpoint, yaml_with("remap.yaml", lambda p: p.update(remap="used.npy")), r"remap is set"),
        "ddconfig missing": (checkpoint, yaml_with("noch.yaml", lambda p: p["ddconfig"].pop("ch")), r"missing ch"),
        "not yaml": (checkpoint, save("weights.yaml", weights), r"weights.yaml: not a readable yaml file"),
    }
    gumbel = yaml.safe_load((tmp_path / "gumbel.yaml").read_text())
    gumbel["model"]["target"] = "taming.models.vqgan.GumbelVQ"
    (tmp_path / "gumbel.yaml").write_text(yaml.safe_dump(gumbel))
    bad["gumbel"] = (checkpoint, tmp_path / "gumbel.yaml", r"GumbelVQ is not a taming VQGAN")
    for what, (path, config_path, message) in bad.items():
        out = tmp_path / f"out-{what.replace(' ', '-')}"
        with pytest.raises(ValueError, match=message) as err:
            import_taming(path, out, config_path)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what
    assert not (tmp_path / "PWNED").exists()


def test_cli_import_needs_the_yaml(checkpoint, tmp_path, capsys):
    """(The import itself, its line and the served model: the family contract.)"""
    assert cli_main(["import", "taming", str(checkpoint), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vqserve import: error:") and "no --config" in err and err.count("\n") == 1


def test_a_model_directory_whose_weights_are_a_pickle_is_refused(imported, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(imported, bad)
    torch.save(fixture_weights(FIXTURES), bad / "model.safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file .*vqserve import taming") as err:
        load_tokenizer(bad)
    assert "\n" not in str(err.value)


# ---- bf16 -------------------------------------------------------------------------------------
def photocrops(size: int = 64) -> torch.Tensor:
    from skimage import data

    crops = []
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        img = getattr(data, name)()
        h, w = img.shape[:2]
        crops.append(img[h // 2 - size // 2: h // 2 + size // 2, w // 2 - size // 2: w // 2 + size // 2, :3])
    return torch.from_numpy(np.stack(crops))


def test_bf16_keeps_the_search_fp32_and_flips_fewer_tokens_than_the_original_cast(chameleon):
    """A Chameleon-shaped model whose codebook came from its own latents (near ties, as after
    training): the original cast to bf16 (its VectorQuantizer2 search in bf16 too) flips more
    tokens than vqserve's bf16 path, which keeps the search, and by default the residual
    stream, in fp32."""
    from vqserve.model.families.taming.precision import flip_rates

    out, _ = import_taming(chameleon["ckpt"], chameleon["root"] / "bf16", chameleon["yaml"])
    tok = load_tokenizer(out)
    rates = flip_rates(tok, photocrops(), "bf16")
    assert rates["naive"] > rates["vqserve_island_only"] >= 0
    assert rates["vqserve"] <= rates["vqserve_island_only"]
    tok.to(torch.bfloat16)
    assert tok.quantizer.embedding.dtype == torch.float32
