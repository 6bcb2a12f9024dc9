"""Metrics (checked against scikit-image), `vqserve eval --json`, and the shipped default."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import load_script
from vqserve.model import default_tokenizer_available, load_tokenizer
from vqserve.model.evaluation import (
    batch_invariance,
    code_counts,
    codebook_stats,
    downsample_bicubic_baseline,
    index_agreement,
    psnr,
    ssim,
)

# Measured on the shipped default (docs/TRAINING.md): chelsea (a model-selection photograph,
# never trained on), whole image centre-cropped to 296x448, fp32 eager round trip: v5 27.73 dB
# (v4 27.73 dB, v3 27.59 dB, v2 26.89 dB, the first default 26.70 dB, its predecessor 23.03 dB).
# The floor leaves ~1 dB for platform differences; an untrained tokenizer scores ~10 dB.
DEFAULT_CHELSEA_PSNR_FLOOR = 26.7
# bf16 as served (fp32 residual stream): 99.57% of chelsea's tokens match fp32 here for v5
# (v4 99.52%, v3 99.66%, v2 99.95%, the first default 99.47%); with v4's whole encoder cast
# to bf16 97.97%.
# The floor catches a serving policy that stops protecting the tokens, with room for CPUs
# whose bf16 kernels round differently (one token of chelsea's 2,072 is 0.05 points).
DEFAULT_CHELSEA_BF16_AGREEMENT_FLOOR = 0.993


pytestmark = pytest.mark.usefixtures("one_thread")


def _rand_images(seed: int, n: int = 2, h: int = 48, w: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def test_psnr_matches_scikit_image():
    from skimage.metrics import peak_signal_noise_ratio

    a, b = _rand_images(0), _rand_images(1)
    assert psnr(a, b) == pytest.approx(peak_signal_noise_ratio(a, b, data_range=255), abs=1e-9)
    assert psnr(a, a) == math.inf
    # float [-1, 1] inputs are scored on the same 0..255 scale
    fa = torch.from_numpy(a).permute(0, 3, 1, 2).double() / 127.5 - 1
    assert psnr(fa, torch.from_numpy(b).permute(0, 3, 1, 2).double() / 127.5 - 1) == pytest.approx(
        psnr(a, b), abs=1e-6)


def test_ssim_matches_scikit_image():
    from skimage.metrics import structural_similarity

    rng = np.random.default_rng(0)
    a = _rand_images(2, n=1)[0]
    b = np.clip(a.astype(int) + rng.integers(-30, 30, a.shape), 0, 255).astype(np.uint8)
    ref = structural_similarity(a, b, data_range=255, channel_axis=-1, gaussian_weights=True,
                                sigma=1.5, use_sample_covariance=False)
    assert ssim(a, b) == pytest.approx(ref, abs=2e-3)
    assert ssim(a, a) == pytest.approx(1.0)


def test_codebook_stats_and_agreement():
    counts = code_counts(torch.tensor([[0, 1], [0, 1]]), 4)
    assert counts.tolist() == [2, 2, 0, 0]
    s = codebook_stats(counts)
    assert s["utilization"] == 0.5 and s["used_codes"] == 2 and s["positions"] == 4
    assert s["entropy_bits"] == pytest.approx(1.0) and s["perplexity"] == pytest.approx(2.0)
    assert s["max_entropy_bits"] == 2.0
    assert codebook_stats(torch.zeros(8, dtype=torch.int64))["utilization"] == 0.0
    assert index_agreement(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4])) == 0.75
    with pytest.raises(ValueError, match="shapes differ"):
        index_agreement(torch.zeros(3), torch.zeros(4))


def test_baseline_is_exact_on_flat_images_and_lossy_on_detail():
    flat = np.full((1, 32, 32, 3), 77, np.uint8)
    assert torch.equal(downsample_bicubic_baseline(torch.from_numpy(flat), 8), torch.from_numpy(flat))
    noisy = torch.from_numpy(_rand_images(3, n=1, h=32, w=32))
    assert psnr(noisy, downsample_bicubic_baseline(noisy, 8)) < 15


def test_eval_json_has_the_fields(tiny_checkpoint, tmp_path, capsys):
    from vqserve.cli import main

    for i, img in enumerate(_rand_images(4, n=2, h=40, w=48)):
        Image.fromarray(img).save(tmp_path / f"im{i}.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["eval", "--model", tiny_checkpoint, "--images", str(tmp_path), "--json"]) == 0
    assert any("skipping unreadable image" in str(w.message) for w in caught)
    r = json.loads(capsys.readouterr().out)
    for key in ("psnr", "baseline_psnr", "ssim", "utilization", "entropy_bits", "perplexity",
                "agreement", "codebook", "per_image", "images", "factor", "codebook_size"):
        assert key in r, key
    assert r["images"] == 2 and r["skipped_images"] == 1 and r["factor"] == 8 and r["dither"] == "none"
    assert set(r["agreement"]) == set(r["agreement_autocast"]) == {"bf16", "fp16"}
    assert all(0.0 <= v <= 1.0 for v in [*r["agreement"].values(), *r["agreement_autocast"].values()])
    assert r["codebook"]["positions"] == 2 * 5 * 6
    assert 0 < r["utilization"] <= 1 and r["entropy_bits"] >= 0
    assert {"psnr", "ssim", "agreement_bf16", "agreement_fp16", "agreement_bf16_autocast"} <= set(r["per_image"][0])
    # batch invariance (the two 40x48 images, cycled to a batch of 4) and the speed on this machine
    assert r["batch_invariance"] == {"batch": 4, "height": 40, "width": 48, "identical": True,
                                     "differing_tokens": 0, "tokens": 4 * 5 * 6}
    assert set(r["images_per_second"]) == {"fp32", "bf16", "fp16", "bf16_autocast", "fp16_autocast"}
    assert all(v > 0 for v in r["images_per_second"].values()) and r["machine"]["threads"] >= 1
    assert "margins" in r and "agreement_per_scale" not in r  # fp32 tie share; no scales in a grid


def test_eval_table_on_terminal(tiny_checkpoint, tmp_path, capsys):
    from vqserve.cli import main

    Image.fromarray(_rand_images(5, n=1, h=32, w=32)[0]).save(tmp_path / "a.png")
    assert main(["eval", "--model", tiny_checkpoint, "--images", str(tmp_path),
                 "--precisions", "bf16"]) == 0
    out = capsys.readouterr().out
    for text in ("PSNR (fp32 eager)", "SSIM", "codebook utilization", "entropy",
                 "bf16 vs fp32 index agreement", "bf16 autocast vs fp32", "baseline",
                 "batch invariant (fp32)", "yes (batch 1 vs batch 4, 32x32)", "encode speed", " img/s (",
                 "tokens near a boundary"):
        assert text in out
    assert "fp16 vs fp32" not in out and "dither" not in out
    # a dithered tokenizer says so on its first line: its perplexity reads differently
    from tests.conftest import make_tokenizer
    from vqserve.model import save_tokenizer

    save_tokenizer(make_tokenizer(dither="bayer4"), tmp_path / "dithered")
    assert main(["eval", "--model", str(tmp_path / "dithered"), "--images", str(tmp_path),
                 "--precisions", "bf16"]) == 0
    assert "codebook 1000  dither bayer4" in capsys.readouterr().out.splitlines()[0]


def test_eval_rejects_bad_arguments(tiny_checkpoint, tmp_path, capsys):
    from vqserve.cli import main

    assert main(["eval", "--model", tiny_checkpoint, "--images", str(tmp_path)]) == 2
    assert "no readable images" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "nope"), "--images", str(tmp_path)]) == 2


@pytest.mark.skipif(not default_tokenizer_available(),
                    reason="model/default/{config.json,model.safetensors} is absent in this checkout; "
                           "train it as docs/TRAINING.md says (`make data`, configs/default-v2-pixel.yaml, default-v3-tune.yaml, default-v4-tune.yaml, default-v5-dither.yaml)")
def test_shipped_default_round_trips_a_real_photograph():
    from skimage import data

    from vqserve.training.data import center_crop_multiple

    tok = load_tokenizer("default")
    assert tok.factor == 8 and tok.codebook_size >= 4096 and tok.config.quantizer == "fsq"
    img = center_crop_multiple(data.chelsea(), 8)  # a validation photograph: never trained on
    batch = torch.from_numpy(img)[None]
    idx = tok.encode(batch)
    assert idx.shape == (1, img.shape[0] // 8, img.shape[1] // 8)
    assert int(idx.min()) >= 0 and int(idx.max()) < tok.codebook_size
    recon = tok.decode(idx)
    assert recon.shape == batch.shape and recon.dtype == torch.uint8
    value = psnr(batch, recon)
    assert value > DEFAULT_CHELSEA_PSNR_FLOOR, value
    # and the serving path is deterministic: the same photograph gives the same tokens
    assert torch.equal(tok.encode(batch), idx)


@pytest.mark.skipif(not default_tokenizer_available(), reason="model/default is absent in this checkout")
def test_shipped_default_keeps_its_tokens_in_bf16_as_served():
    from skimage import data

    from vqserve.model.evaluation import encode_in_precision, index_agreement
    from vqserve.model.mixed_precision import low_precision_encoder
    from vqserve.training.data import center_crop_multiple

    tok = load_tokenizer("default")
    batch = torch.from_numpy(center_crop_multiple(data.chelsea(), 8))[None]
    served, _ = low_precision_encoder(tok.encoder, "bf16")
    value = index_agreement(encode_in_precision(tok, batch, "bf16", channels_last=False, encoder=served),
                            tok.encode(batch))
    assert value >= DEFAULT_CHELSEA_BF16_AGREEMENT_FLOOR, value


# -- issue 17: what a user should look at ---------------------------------------------


def test_mean_colour_error_is_signed_per_channel_and_side_by_side_lays_out_panels():
    from vqserve.model.evaluation import mean_colour_error, side_by_side

    a = _rand_images(7, n=1)[0]
    shifted = np.clip(a.astype(int) + np.array([10, 0, -10]), 0, 255).astype(np.uint8)
    err = mean_colour_error(a, shifted)
    assert err[0] > 5 and abs(err[1]) < 1e-9 and err[2] < -5  # red up, green same, blue down
    assert mean_colour_error(a, a) == [0.0, 0.0, 0.0]
    sheet = side_by_side(a, shifted, a, gap=4)
    assert sheet.shape == (a.shape[0], 3 * a.shape[1] + 8, 3) and sheet.dtype == np.uint8
    assert np.array_equal(sheet[:, : a.shape[1]], a) and (sheet[:, a.shape[1] : a.shape[1] + 4] == 255).all()


def test_flat_area_tint_sees_a_hue_change_on_a_sky_and_forgives_brightness_and_texture():
    from vqserve.model.evaluation import flat_area_tint

    sky = np.full((64, 128, 3), 180, np.uint8)
    texture = _rand_images(3, n=1, h=64, w=128)[0]
    photo = np.concatenate([sky, texture])  # top half flat, bottom half busy
    cyan = photo.copy()
    cyan[:64, :, 0] -= 5   # the sky loses 5 levels of red: 175,180,180
    tint, share = flat_area_tint(photo, cyan)
    assert share == pytest.approx(0.5) and tint == pytest.approx(5 * 2 / 3, abs=1e-6)
    darker = photo.copy()
    darker[:64] -= 6       # the sky 6 levels darker, still grey
    assert flat_area_tint(photo, darker)[0] == pytest.approx(0.0, abs=1e-9)
    noisy = photo.copy()
    noisy[64:, :, 0] = 255 - noisy[64:, :, 0]   # the texture wrecked: not a flat area
    assert flat_area_tint(photo, noisy)[0] == pytest.approx(0.0, abs=1e-9)
    assert flat_area_tint(texture, texture) == (0.0, 0.0)  # no flat area at all


def test_tiled_round_trip_with_one_tile_is_the_whole_round_trip():
    from tests.conftest import make_tokenizer
    from vqserve.model.evaluation import tiled_round_trip

    tok = make_tokenizer()
    batch = torch.from_numpy(_rand_images(8, n=1, h=48, w=64))
    whole = tok.decode(tok.encode(batch))
    assert torch.equal(tiled_round_trip(tok, batch, 64), whole)
    pieces = tiled_round_trip(tok, batch, 16)  # 3 x 4 tiles, each encoded alone
    assert pieces.shape == batch.shape
    first = tok.decode(tok.encode(batch[:, :16, :16].contiguous()))
    assert torch.equal(pieces[:, :16, :16], first)


def test_check_targets_reports_each_target():
    from vqserve.model.evaluation import TARGETS, check_targets

    good = {"psnr": 30.0, "baseline_psnr": 29.0, "tiled_psnr": 30.1, "max_abs_mean_error": 1.0,
            "agreement": {"bf16": 0.999}}
    assert all(t["ok"] for t in check_targets(good).values()) and set(check_targets(good)) == set(TARGETS)
    bad = {**good, "baseline_psnr": 29.8, "tiled_psnr": 30.5, "max_abs_mean_error": 3.5,
           "agreement": {"bf16": 0.99}}
    assert not any(t["ok"] for t in check_targets(bad).values())


def test_eval_writes_side_by_side_pngs_and_never_overwrites_silently(tiny_checkpoint, tmp_path, capsys):
    from vqserve.cli import main

    src = tmp_path / "imgs"
    src.mkdir()
    for i, img in enumerate(_rand_images(9, n=2, h=40, w=48)):
        Image.fromarray(img).save(src / f"photo {i}.png")
    out = tmp_path / "new" / "report"
    assert main(["eval", "--model", tiny_checkpoint, "--images", str(src), "--out", str(out),
                 "--precisions", "", "--tile", "16", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == ["00-photo_0.png", "01-photo_1.png", "eval.json"]
    sheet = np.asarray(Image.open(out / "00-photo_0.png"))
    assert sheet.shape == (40, 3 * 48 + 8, 3)  # original | reconstruction | bicubic
    assert np.array_equal(sheet[:, :48], np.asarray(Image.open(src / "photo 0.png")))
    row = r["per_image"][0]
    assert len(row["mean_error_rgb"]) == 3 and row["max_abs_mean_error"] == max(map(abs, row["mean_error_rgb"]))
    assert {"tiled_psnr", "baseline_ssim"} <= set(row) and r["tile"] == 16 and "tiled_psnr" in r
    assert set(r["targets"]) == {"psnr_over_baseline_db", "max_abs_mean_error", "whole_minus_tiled_db"}
    before = (out / "eval.json").read_bytes()
    assert main(["eval", "--model", tiny_checkpoint, "--images", str(src), "--out", str(out),
                 "--precisions", ""]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "eval.json").read_bytes() == before
    assert main(["eval", "--model", tiny_checkpoint, "--images", str(src), "--out", str(out),
                 "--precisions", "bf16", "--overwrite"]) == 0
    text = capsys.readouterr().out
    for needle in ("PSNR as 128-px tiles", "worst mean colour error", "targets (issue 17", "bf16_agreement"):
        assert needle in text
    assert main(["eval", "--model", tiny_checkpoint, "--images", str(src), "--tile", "12"]) == 2
    assert "multiple of the factor" in capsys.readouterr().err


def test_heldout_pip_photographs_load_for_evaluation():
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    from vqserve.training.data import open_source

    src = open_source("heldout:pip")
    assert src.names == ["matplotlib/grace_hopper.jpg", "sklearn/china.jpg", "sklearn/flower.jpg"]
    assert all(img.dtype == np.uint8 and img.ndim == 3 and min(img.shape[:2]) >= 400 for img in src.images)


def _flat_colours_script():
    return load_script("flat_colours")


def test_flat_colour_palette_is_each_codes_decoded_flat_colour_and_nearest_is_nearest(tiny_checkpoint):
    """scripts/flat_colours.py --palette: entry c is the flat colour that a map of code c
    alone decodes to (batches must not shift codes), and ``nearest`` finds the closest entry."""
    flat = _flat_colours_script()
    tok = load_tokenizer(tiny_checkpoint).eval()
    palette = flat.code_palette(tok, batch=96)  # 1,000 codes: the last batch is partial
    assert palette.shape == (tok.codebook_size, 3)
    assert palette.min() >= 0 and palette.max() <= 255
    for code in (0, 95, 96, 517, tok.codebook_size - 1):
        img = tok.decode(torch.full((1, 8, 8), code))[0, 24:40, 24:40].double()
        np.testing.assert_allclose(palette[code], img.mean(dim=(0, 1)).numpy())
    rng = np.random.default_rng(0)
    targets = rng.integers(0, 256, size=(50, 3)).astype(np.uint8)
    got = flat.nearest(palette, targets)
    brute = palette[((palette[None] - targets[:, None].astype(np.float64)) ** 2).sum(-1).argmin(1)]
    np.testing.assert_array_equal(got, brute)


def test_flat_colours_reports_the_palette_bound(tiny_checkpoint, capsys):
    """``--palette`` adds the best-any-code figures beside the encoder's own, in the same form."""
    flat = _flat_colours_script()
    assert flat.main([tiny_checkpoint, "--colours", "8", "--palette", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert set(row) == {"model", "greys", "colours", "palette_greys", "palette_colours"}
    assert set(row["palette_greys"]) == set(row["greys"])


class _BatchDependent(torch.nn.Module):
    """A stand-in tokenizer whose tokens depend on the batch (the failure the check finds)."""

    factor = 8

    def encode(self, images):
        grid = torch.zeros(images.shape[0], images.shape[1] // 8, images.shape[2] // 8, dtype=torch.int64)
        return grid + (images.shape[0] > 1)


def test_batch_invariance_counts_tokens_that_depend_on_the_batch(tiny_checkpoint):
    images = list(_rand_images(6, n=3, h=56, w=72))
    result = batch_invariance(load_tokenizer(tiny_checkpoint), images, batch=3, side=48)
    assert result == {"batch": 3, "height": 48, "width": 48, "identical": True, "differing_tokens": 0,
                      "tokens": 3 * 6 * 6}
    bad = batch_invariance(_BatchDependent(), images[:1], batch=2)
    assert not bad["identical"] and bad["differing_tokens"] == bad["tokens"] == 2 * 7 * 9

