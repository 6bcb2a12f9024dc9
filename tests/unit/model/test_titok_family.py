"""TiTok's networks, config parsing and refusals (vqserve.model.families.titok), without fixtures:
the index-identity against the original is tests/integration/families/test_titok.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vqserve.model.families.titok.family import (
    PRESETS,
    TITOK,
    TitokConfig,
    TitokTokenizer,
    architecture_from_released,
    is_released_config,
    to_vqserve_names,
)
from vqserve.model.families.titok.networks import TitokDecoder, TitokEncoder, TitokPixelDecoder

SMALL = dict(width=32, layers=1, heads=2, image_size=32, patch_size=8, num_latent_tokens=4, token_size=6)


def released(**vq) -> dict:
    """A config.json as TiTok.save_pretrained writes it (L-32's values unless changed)."""
    base = {"codebook_size": 4096, "token_size": 12, "use_l2_norm": True, "commitment_cost": 0.25,
            "vit_enc_model_size": "large", "vit_dec_model_size": "large", "vit_enc_patch_size": 16,
            "vit_dec_patch_size": 16, "num_latent_tokens": 32, "finetune_decoder": True}
    return {"experiment": {}, "model": {"vq_model": {**base, **vq}}, "dataset": {"preprocessing": {"crop_size": 256}}}


def _random(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return module.eval()


def test_the_legacy_reshape_is_kept_and_differs_from_the_permute():
    legacy = _random(TitokEncoder(**SMALL, is_legacy=True))
    fixed = TitokEncoder(**SMALL, is_legacy=False)
    fixed.load_state_dict(legacy.state_dict())
    x = torch.randint(0, 256, (2, 3, 32, 32)).float()
    a, b = legacy(x), fixed(x)
    assert a.shape == b.shape == (2, 6, 1, 4) and not torch.allclose(a, b)


def test_the_pixel_rearrange_is_einops():
    einops = pytest.importorskip("einops")
    dec = _random(TitokDecoder(**SMALL, is_legacy=False, pixel_decoder=None))
    codes = torch.randn(2, 6, 1, 4)
    with torch.no_grad():
        x = dec.ffn(torch.randn(2, 32, 4, 4))
        expected = einops.rearrange(x, "b (p1 p2 c) h w -> b c (h p1) (w p2)", p1=8, p2=8)
        p, g = 8, 4
        ours = x.reshape(2, p, p, 3, g, g).permute(0, 3, 4, 1, 5, 2).reshape(2, 3, g * p, g * p)
        assert torch.equal(ours, expected)
        out = dec(codes)
    assert out.shape == (2, 3, 32, 32) and torch.equal(out, out.trunc()) and 0 <= out.min() <= out.max() <= 255


def test_pixels_follow_the_readme_for_every_value():
    y = np.linspace(-0.2, 1.2, 4001, dtype=np.float32)
    readme = (torch.clamp(torch.from_numpy(y), 0.0, 1.0) * 255.0).to(torch.uint8).numpy()
    assert np.array_equal(TitokPixelDecoder.to_pixels(torch.from_numpy(y)).numpy().astype(np.uint8), readme)


def test_released_configs_read_as_the_presets_and_the_layout_is_a_sequence():
    assert architecture_from_released(released(), "c") == PRESETS["l32"]
    assert architecture_from_released(released(vit_enc_model_size="small", vit_dec_model_size="small",
                                               num_latent_tokens=128), "c") == PRESETS["s128"]
    vq8k = released(codebook_size=8192, token_size=64, use_l2_norm=False, vit_enc_model_size="base",
                    num_latent_tokens=64, finetune_decoder=False, is_legacy=False)
    assert architecture_from_released(vq8k, "c") == PRESETS["bl64_vq8k"]
    layout = PRESETS["b64"].layout()
    assert (layout.kind, layout.length, layout.size, layout.factor) == ("sequence", 64, (256, 256), 16)
    arch = PRESETS["sl256_vq8k"]
    assert TitokConfig.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch


@pytest.mark.parametrize(("change", "message"), [
    (dict(quantize_mode="vae"), "a TiTok VAE has continuous latents, no tokens"),
    (dict(vit_dec_model_size="huge"), "unknown vit model size 'huge'"),
    (dict(is_legacy=False), "is_legacy False with finetune_decoder True"),
    (dict(vit_enc_patch_size=24), "image_size 256 is not a multiple of vit_enc_patch_size 24"),
    (dict(num_latent_tokens=0), "num_latent_tokens must be a positive integer"),
])
def test_configs_vqserve_does_not_serve_are_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=message) as err:
        architecture_from_released(released(**change), "titok/config.json")
    assert str(err.value).startswith("titok/config.json: ") and "\n" not in str(err.value)


def test_a_missing_key_is_named():
    data = released()
    del data["model"]["vq_model"]["num_latent_tokens"]
    with pytest.raises(ValueError, match="model.vq_model has no num_latent_tokens"):
        architecture_from_released(data, "c")


def test_the_family_claims_released_and_imported_configs_only():
    assert is_released_config(released()) and TITOK.claims(released())
    assert TITOK.claims({"format": "vqserve-titok"})
    for other in ({"_class_name": "MaskGitVQGAN"}, {"model": {"vq_model": {"codebook_size": 4}}}, {"model": 3}):
        assert not TITOK.claims(other)


def test_the_declared_import_choices_are_the_presets():
    from vqserve.model.families.titok.declare import PRESET_NAMES

    assert list(PRESET_NAMES) == sorted(PRESETS)


def test_released_names_map_onto_vqserves():
    with torch.device("meta"):
        ours = TitokTokenizer(PRESETS["l32"]).state_dict()
    assert to_vqserve_names({"latent_tokens": 0, "quantize.embedding.weight": 1, "pixel_quantize.embedding.weight": 2,
                             "pixel_decoder.conv_in.weight": 3, "encoder.ln_pre.weight": 4}) == {
        "encoder.latent_tokens": 0, "quantizer.embedding": 1, "decoder.pixel_quantize.embedding.weight": 2,
        "decoder.pixel_decoder.conv_in.weight": 3, "encoder.ln_pre.weight": 4}
    assert {"encoder.latent_tokens", "quantizer.embedding", "decoder.pixel_quantize.embedding.weight"} <= set(ours)


def test_bf16_runs_the_attention_and_mlp_branches_only_the_residual_stream_stays_fp32():
    from vqserve.model.mixed_precision import low_precision_encoder

    enc = _random(TitokEncoder(**SMALL, is_legacy=True))
    low, kept = low_precision_encoder(enc, "bf16")
    dtypes = {n: p.dtype for n, p in low.named_parameters()}
    assert kept == ["patch_embed", "conv_out"]
    assert dtypes["transformer.0.attn.in_proj_weight"] == dtypes["transformer.0.mlp.c_fc.weight"] == torch.bfloat16
    assert dtypes["transformer.0.ln_1.weight"] == dtypes["ln_post.weight"] == torch.float32
    x = torch.randint(0, 256, (2, 3, 32, 32)).float()
    with torch.no_grad():
        out = low(x)
    assert out.dtype == torch.float32 and torch.allclose(out, enc(x), atol=0.1)
