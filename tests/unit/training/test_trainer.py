"""The training loop: each precision trains and round-trips its checkpoint; resume; the policy.

All runs are real (real networks, real optimizer, real files) and tiny: 8-channel
factor-8 tokenizers on 16x16 crops of a few synthetic photographs, a few seconds each.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from safetensors.torch import load_file

from tests.helpers import ROOT
from vqserve.model import load_tokenizer
from vqserve.training.config import TrainConfig, load_config_file
from vqserve.training.losses import boundary_distance, latent_tv, lr_at, margin_loss
from vqserve.training.outputs import read_metrics
from vqserve.training.trainer import Trainer

TINY_MODEL = {"quantizer": "fsq", "levels": [8, 5, 5, 5], "channels": [8, 8, 8], "num_res_blocks": 1}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """Three smooth 48x48 'photographs': gradients plus a few soft blobs."""
    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:48, 0:48].astype(np.float64)
    for i in range(3):
        img = np.zeros((48, 48, 3))
        for c in range(3):
            a, b = rng.uniform(-3, 3, 2)
            img[..., c] = 128 + a * (xx - 24) + b * (yy - 24)
            for _ in range(3):
                cy, cx = rng.uniform(0, 48, 2)
                img[..., c] += rng.uniform(-80, 80) * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 60)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / f"img{i}.png")
    return str(root)


def tiny_config(image_dir: str, out, **overrides) -> TrainConfig:
    base = dict(data=image_dir, val_data=image_dir, crop_size=16, batch_size=4, val_crop_size=16,
                steps=12, lr=1e-2, warmup_steps=0, lr_schedule="constant", log_every=2,
                val_every=12, ckpt_every=4, ckpt_minutes=0, model=dict(TINY_MODEL),
                out=str(out), progress=False, plots=False, seed=0)
    return TrainConfig(**{**base, **overrides})


def _weights(tok) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tok.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_tiny_run_lowers_loss_and_checkpoint_reloads_identically(precision, image_dir, tmp_path):
    trainer = Trainer(tiny_config(image_dir, tmp_path / "run", precision=precision))
    seen: list[torch.dtype] = []
    hook = trainer.tokenizer.encoder.conv_in.register_forward_hook(
        lambda m, i, o: seen.append(o.dtype) if m.training else None)
    summary = trainer.run()
    hook.remove()
    assert summary["step"] == 12

    # the networks really ran in the compute dtype (autocast), the policy's choice
    expected = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert seen and set(seen) == {expected}

    vals = [h["val_psnr"] for h in trainer.history if "val_psnr" in h]
    assert len(vals) == 2 and vals[-1] > vals[0] + 1.0, vals  # validation loss went down
    losses = [h["loss"] for h in trainer.history if "loss" in h]
    assert losses[-1] < losses[0]
    assert all(np.isfinite(losses))

    # final/ and last/tokenizer reload to exactly the trained module's outputs
    tiles = trainer.val_tiles
    ref_idx = trainer.tokenizer.eval().encode(tiles)
    ref_img = trainer.tokenizer.decode(ref_idx)
    for path in (tmp_path / "run" / "final", tmp_path / "run" / "last" / "tokenizer"):
        loaded = load_tokenizer(path)
        assert torch.equal(loaded.encode(tiles), ref_idx)
        assert torch.equal(loaded.decode(ref_idx), ref_img)
        x = tiles.permute(0, 3, 1, 2).float() / 127.5 - 1
        with torch.no_grad():
            assert torch.equal(loaded(x)[0], trainer.tokenizer(x)[0])
    state = json.loads((tmp_path / "run" / "last" / "state.json").read_text())
    assert state["step"] == 12
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_bf16_uses_no_grad_scaler_and_fp16_does(image_dir, tmp_path):
    bf = Trainer(tiny_config(image_dir, tmp_path / "bf", precision="bf16", steps=2, val_every=0))
    fp = Trainer(tiny_config(image_dir, tmp_path / "fp", precision="fp16", steps=2, val_every=0))
    assert not bf.policy.use_grad_scaler and fp.policy.use_grad_scaler
    assert not bf.scaler.is_enabled() and fp.scaler.is_enabled()
    bf.train_step(0)
    fp.train_step(0)
    # a disabled scaler holds no scale state at all; the fp16 one scaled the loss
    assert getattr(bf.scaler, "_scale", None) is None and bf.scaler.state_dict() == {}
    assert fp.scaler._scale is not None and fp.scaler.get_scale() > 1.0
    fp.step = 1
    fp.save_checkpoint()
    saved = json.loads((tmp_path / "fp" / "last" / "state.json").read_text())
    assert saved["optimizer"]["scaler"]["scale"] == fp.scaler.get_scale()
    # the quantizer computed in fp32 even under fp16 autocast: indices match an fp32 re-run
    # of the same latents
    x = fp.crops.batch(0)
    with torch.no_grad(), fp.policy.autocast("cpu"):
        lat = fp.tokenizer.encode_latents(x)
        _, idx = fp.tokenizer.quantize(lat)
    _, idx32 = fp.tokenizer.quantize(lat.float())
    assert torch.equal(idx, idx32)


def test_resume_after_interruption_matches_an_uninterrupted_run(image_dir, tmp_path):
    kwargs = dict(steps=8, ckpt_every=3, val_every=4, log_every=1, margin=0.1, margin_weight=0.1,
                  quant_noise=0.05, lr_schedule="cosine", warmup_steps=2)
    full = Trainer(tiny_config(image_dir, tmp_path / "full", **kwargs))
    full.run()

    cfg = tiny_config(image_dir, tmp_path / "killed", **kwargs)
    first = Trainer(cfg)
    assert first.run(stop_at=5) == {"step": 5, "interrupted": True}  # killed after step 5
    assert json.loads((tmp_path / "killed" / "last" / "state.json").read_text())["step"] == 3

    resumed = Trainer(cfg, resume=True)
    assert resumed.step == 3  # lost at most one checkpoint interval
    assert resumed.run()["step"] == 8
    for k, v in _weights(full.tokenizer).items():
        torch.testing.assert_close(resumed.tokenizer.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)
    steps = [r["step"] for r in read_metrics(tmp_path / "killed" / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 9))  # the lost steps 4-5 were dropped, not duplicated


def test_resume_without_checkpoint_starts_fresh_and_mismatch_is_refused(image_dir, tmp_path):
    assert Trainer(tiny_config(image_dir, tmp_path / "r", steps=2), resume=True).step == 0
    Trainer(tiny_config(image_dir, tmp_path / "r", steps=2)).run()
    other = dict(TINY_MODEL, levels=[5, 5, 5])
    with pytest.raises(ValueError, match="--resume"):
        Trainer(tiny_config(image_dir, tmp_path / "r", steps=4, model=other), resume=True)


def test_checkpoint_has_no_pickle(image_dir, tmp_path):
    trainer = Trainer(tiny_config(image_dir, tmp_path / "p", steps=1, val_every=0))
    trainer.train_step(0)
    trainer.step = 1
    last = trainer.save_checkpoint()
    files = sorted(p.relative_to(last).as_posix() for p in last.rglob("*") if p.is_file())
    assert files == ["optimizer.safetensors", "state.json", "tokenizer/config.json",
                     "tokenizer/model.safetensors"]
    opt = load_file(str(last / "optimizer.safetensors"))
    assert any(k.endswith(".exp_avg") for k in opt) and any(k.endswith(".exp_avg_sq") for k in opt)
    assert not list(tmp_path.glob("p/.last*"))  # no temp directory left behind


def test_cli_train_with_config_file_and_overrides(image_dir, tmp_path, capsys):
    from vqserve.cli import main

    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(
        f"data: {image_dir}\nval_data: {image_dir}\ncrop_size: 16\nbatch_size: 2\nval_crop_size: 16\n"
        "steps: 50\nwarmup_steps: 0\nlog_every: 1\nval_every: 0\nckpt_every: 2\n"
        "model:\n  levels: [8, 5, 5, 5]\n  channels: [8, 8, 8]\n")
    out = tmp_path / "cli"
    argv = ["train", "--config", str(cfg_file), "--steps", "2", "--out", str(out), "--no-progress",
            "--precision", "bf16", "--lr", "0.003", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 2
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["precision"] == "bf16" and saved["lr"] == 0.003 and saved["steps"] == 2
    assert saved["model"]["channels"] == [8, 8, 8]
    # --resume with more steps continues from step 2
    assert main(argv[:-1] + ["--steps", "3", "--resume"]) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    # --factor trims/extends the widths
    from vqserve.commands.train import build_config

    ns = argparse.Namespace(**{k: None for k in ["data", "val_data", "crop_size", "batch_size", "steps",
                                                 "lr", "lr_schedule", "warmup_steps", "margin",
                                                 "margin_weight", "quant_noise", "precision", "device",
                                                 "threads", "seed", "out", "val_every", "ckpt_every",
                                                 "ckpt_minutes", "log_every", "quantizer", "levels",
                                                 "num_res_blocks", "margin_start", "margin_ramp",
                                                 "sampling"]},
                            config=str(cfg_file), channels=[8, 16], factor=16, no_progress=True)
    assert build_config(ns).tokenizer_config().factor == 16
    # with a patch-4 stem, factor 16 needs two stages; factor 4 leaves none and is refused
    ns.patch_size = 4
    assert build_config(ns).tokenizer_config().channels == [8, 16]
    ns.factor = 4
    with pytest.raises(ValueError, match="at least one stage"):
        build_config(ns)


def test_bad_configs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown training config keys"):
        TrainConfig.from_dict({"stepz": 3})
    with pytest.raises(ValueError, match="multiple of the factor"):
        TrainConfig(crop_size=20)
    with pytest.raises(ValueError, match="not supported"):
        TrainConfig(precision="fp8")
    f = tmp_path / "c.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config_file(f)
    assert TrainConfig.from_dict({"levels": [5, 5, 5], "crop_size": 32}).model["levels"] == [5, 5, 5]


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(1e-4)
    assert lr_at(cfg, 9) == pytest.approx(1e-3)
    assert lr_at(cfg, 10) == pytest.approx(1e-3)
    assert lr_at(cfg, 100) == pytest.approx(1e-4)
    assert all(lr_at(cfg, s) >= lr_at(cfg, s + 1) for s in range(10, 100))


def test_margin_loss_pushes_latents_away_from_boundaries():
    b = torch.tensor([0.0, 0.49, 0.5, 1.3, -2.45, 2.95])
    torch.testing.assert_close(boundary_distance(b), torch.tensor([0.5, 0.01, 0.0, 0.2, 0.05, 0.45]))
    assert float(margin_loss(torch.tensor([0.0, 1.0, -2.9, 3.0]), 0.1)) == 0.0
    x = torch.tensor([0.45, -1.55], requires_grad=True)
    margin_loss(x, 0.1).backward()
    # descent moves 0.45 down towards 0 and -1.55 down towards -2: both away from a boundary
    assert x.grad[0] > 0 and x.grad[1] > 0


def test_robust_quantize_path_matches_fsq_exactly_when_inactive(image_dir, tmp_path):
    """Before margin_start the margin path must train exactly like plain FSQ (same loss and
    gradients), including latents saturated past the outermost level."""
    model = dict(TINY_MODEL, levels=[8, 8, 8, 6, 5])
    plain = Trainer(tiny_config(image_dir, tmp_path / "a", model=model, val_every=0))
    robust = Trainer(tiny_config(image_dir, tmp_path / "b", model=model, val_every=0,
                                 margin=0.1, margin_weight=0.1, margin_start=0.9))
    robust.tokenizer.load_state_dict(plain.tokenizer.state_dict())
    with torch.no_grad():
        for t in (plain, robust):
            t.tokenizer.encoder.conv_out.weight.mul_(50)  # drive latents into saturation
    x = plain.crops.batch(0)
    results = []
    for t in (plain, robust):
        loss, parts, recon, idx = t._forward_losses(x, 0)
        loss.backward()
        results.append((loss.detach(), recon, idx))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][2], results[1][2])
    for p, q in zip(plain.tokenizer.parameters(), robust.tokenizer.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


# -- issue 28: a rate proxy for FSQ tokens ----------------------------------------------
def test_latent_tv_is_the_mean_neighbour_difference_in_levels():
    flat = torch.full((2, 3, 4, 6), 1.7)
    assert float(latent_tv(flat)) == 0.0
    ramp = torch.arange(4.0).view(1, 1, 4, 1).expand(1, 3, 4, 2)  # +1 level per column, rows equal
    assert float(latent_tv(ramp)) == pytest.approx(0.5)            # (1 across + 0 down) / 2
    x = torch.tensor([[[[0.0], [2.0]]]], requires_grad=True)
    latent_tv(x).backward()
    assert x.grad[0, 0, 0, 0] < 0 < x.grad[0, 0, 1, 0]  # descent pulls the neighbours together


def _neighbour_code_changes(trainer, x) -> float:
    with torch.no_grad():
        idx = trainer.tokenizer.quantize(trainer.tokenizer.encode_latents(x))[1]
    return float(((idx[:, :, 1:] != idx[:, :, :-1]).float().mean() + (idx[:, 1:] != idx[:, :-1]).float().mean()) / 2)


def test_latent_tv_weight_trains_neighbouring_tokens_to_agree(image_dir, tmp_path):
    """The same start, data and steps with and without the rate proxy: with it, the encoder's
    neighbouring latents move together, and fewer neighbouring tokens differ."""
    runs = {}
    for name, weight in (("plain", 0.0), ("tv", 5.0)):
        cfg = tiny_config(image_dir, tmp_path / name, val_every=0, steps=30, latent_tv_weight=weight)
        trainer = Trainer(cfg)
        rows = [trainer.train_step(step) for step in range(cfg.steps)]
        runs[name] = (trainer, rows)
    assert "latent_tv" not in runs["plain"][1][-1] and runs["tv"][1][-1]["latent_tv"] >= 0
    x = runs["plain"][0].crops.batch(0)
    bounded = {name: t.tokenizer.quantizer.bound(t.tokenizer.encode_latents(x).permute(0, 2, 3, 1)).detach()
               for name, (t, _) in runs.items()}
    assert float(latent_tv(bounded["tv"])) < 0.5 * float(latent_tv(bounded["plain"]))
    assert _neighbour_code_changes(runs["tv"][0], x) < _neighbour_code_changes(runs["plain"][0], x)


def test_latent_tv_weight_is_refused_where_it_cannot_act(tmp_path):
    with pytest.raises(ValueError, match="latent_tv_weight must be >= 0"):
        TrainConfig(latent_tv_weight=-1)
    with pytest.raises(ValueError, match="FSQ's bounded latents"):
        TrainConfig(latent_tv_weight=1, model={"quantizer": "vq", "channels": [8, 8, 8], "num_res_blocks": 1})
    with pytest.raises(ValueError, match="latent_tv_weight act on the encoder"):
        TrainConfig(latent_tv_weight=1, freeze_encoder=True, init_from=str(tmp_path))
    from vqserve.cli import build_parser
    from vqserve.commands.train import build_config

    args = build_parser().parse_args(["train", "--latent-tv-weight", "0.3", "--out", str(tmp_path / "r")])
    assert build_config(args).latent_tv_weight == 0.3


# -- issue 17: size-independent normalisation, block-mean loss -------------------------


def test_pixel_norm_output_does_not_depend_on_the_image_around_a_pixel():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from vqserve.model.networks import GroupNorm, PixelNorm

    pixel, group = PixelNorm(8), GroupNorm(4, 8, eps=1e-6)
    with torch.no_grad():
        pixel.weight.uniform_(0.5, 2)
        pixel.bias.uniform_(-1, 1)

    @settings(max_examples=25, deadline=None)
    @given(st.integers(0, 2**31 - 1), st.integers(2, 9), st.integers(2, 9))
    def check(seed, h, w):
        x = torch.randn(2, 8, 10, 12, generator=torch.Generator().manual_seed(seed)) * 3 + 1
        assert torch.allclose(pixel(x)[..., :h, :w], pixel(x[..., :h, :w].contiguous()), atol=1e-5)
        # GroupNorm's whole-image statistics: the same pixels come out differently
        assert not torch.allclose(group(x)[..., :h, :w], group(x[..., :h, :w].contiguous()), atol=1e-3)

    check()


def test_norm_option_defaults_to_the_old_architecture_and_pixel_trains(image_dir, tmp_path):
    from vqserve.model.config import TokenizerConfig
    from vqserve.model.networks import PixelNorm

    old = {k: v for k, v in TokenizerConfig().to_dict().items() if k != "norm"}
    assert TokenizerConfig.from_dict(old).norm == "group"  # config.json written before issue 17
    with pytest.raises(ValueError, match="norm must be"):
        TokenizerConfig(norm="batch")
    cfg = TrainConfig(data=str(image_dir), val_data="", crop_size=16, batch_size=2, steps=3,
                      model={**TINY_MODEL, "norm": "pixel"}, block_mean_weight=1.0,
                      out=str(tmp_path / "run"), progress=False, plots=False, warmup_steps=0)
    trainer = Trainer(cfg)
    assert any(isinstance(m, PixelNorm) for m in trainer.tokenizer.modules())
    row = trainer.train_step(0)
    assert row["block_mean"] > 0 and np.isfinite(row["loss"])
    trainer.run()
    loaded = load_tokenizer(tmp_path / "run" / "final")
    assert loaded.config.norm == "pixel"
    x = torch.randint(0, 256, (1, 16, 16, 3), dtype=torch.uint8)
    assert torch.equal(loaded.encode(x), trainer.tokenizer.eval().encode(x))


def test_block_mean_loss_sees_a_colour_cast_that_per_pixel_noise_hides():
    from vqserve.training.losses import block_losses

    def block_mean_loss(recon, target, factor):
        return block_losses(recon, target, factor)[0]

    x = torch.rand(1, 3, 16, 16) * 2 - 1
    yy, xx = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    noise = x + torch.where((yy + xx) % 2 == 0, -0.2, 0.2)   # checkerboard: zero mean per block
    cast = x + torch.tensor([0.2, 0.0, 0.0])[None, :, None, None]  # a red cast
    assert float((noise - x).abs().mean()) == pytest.approx(float((cast - x).abs().mean()) * 3, rel=1e-5)
    assert float(block_mean_loss(noise, x, 8)) < 1e-6 < float(block_mean_loss(cast, x, 8))


@given(shift=st.floats(-0.5, 0.5), tint=st.floats(0.01, 0.5), channel=st.integers(0, 2))
@settings(max_examples=25, deadline=None)
def test_block_chroma_loss_charges_a_tint_and_not_a_brightness_error(shift, tint, channel):
    """The same error on all three channels (too dark / too bright) costs nothing; moving one
    channel alone (a tint on a grey) costs in proportion to how far it moves."""
    from vqserve.training.losses import block_losses

    def block_chroma_loss(recon, target, factor):
        return block_losses(recon, target, factor)[1]

    x = torch.rand(1, 3, 16, 16) * 2 - 1
    assert float(block_chroma_loss(x + shift, x, 8)) < 1e-5
    off = torch.zeros(1, 3, 1, 1)
    off[0, channel] = tint
    small, large = float(block_chroma_loss(x + off, x, 8)), float(block_chroma_loss(x + 2 * off, x, 8))
    assert small > 0.5 * tint and large == pytest.approx(2 * small, rel=1e-3)


def test_block_chroma_and_smooth_fraction_flags_train_with_them(image_dir, tmp_path):
    from vqserve.cli import build_parser
    from vqserve.commands.train import build_config

    args = build_parser().parse_args(["train", "--block-chroma-weight", "2", "--smooth-fraction", "0.5",
                                      "--data", str(image_dir), "--out", str(tmp_path / "run")])
    parsed = build_config(args)
    assert parsed.block_chroma_weight == 2.0 and parsed.smooth_fraction == 0.5
    cfg = TrainConfig(data=str(image_dir), val_data="", crop_size=16, batch_size=2, steps=1,
                      model=TINY_MODEL, block_chroma_weight=2.0, smooth_fraction=0.5,
                      out=str(tmp_path / "run"), progress=False, plots=False, warmup_steps=0)
    trainer = Trainer(cfg)
    assert trainer.crops.smooth_fraction == 0.5
    row = trainer.train_step(0)
    assert row["block_chroma"] > 0 and "block_mean" not in row and np.isfinite(row["loss"])


def test_cli_norm_and_block_mean_flags_reach_the_config(tmp_path):
    from vqserve.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["train", "--norm", "pixel", "--block-mean-weight", "0.5",
                              "--data", "photos:train", "--out", str(tmp_path)])
    from vqserve.commands.train import build_config

    cfg = build_config(args)
    assert cfg.model["norm"] == "pixel" and cfg.block_mean_weight == 0.5 and cfg.data == "photos:train"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--norm", "batch"])


def test_init_from_starts_at_the_given_weights_and_refuses_another_model(image_dir, tmp_path):
    """Fine-tuning (--init-from) begins at exactly the trained weights, with a fresh
    optimizer and step 0; another architecture is refused before any step, naming both."""
    base = Trainer(tiny_config(image_dir, tmp_path / "base", steps=3, val_every=0))
    base.run()
    saved = tmp_path / "base" / "final"
    tuned = Trainer(tiny_config(image_dir, tmp_path / "tuned", steps=2, val_every=0, init_from=str(saved)))
    assert tuned.step == 0 and not tuned.optimizer.state
    for k, v in _weights(base.tokenizer).items():
        torch.testing.assert_close(tuned.tokenizer.state_dict()[k], v, rtol=0, atol=0, msg=k)
    assert tuned.run()["step"] == 2
    other = dict(TINY_MODEL, levels=[5, 5, 5])
    with pytest.raises(ValueError, match="init_from=.*same model settings"):
        Trainer(tiny_config(image_dir, tmp_path / "other", steps=2, model=other, init_from=str(saved)))


def test_freeze_encoder_trains_only_the_decoder_so_every_token_stays(image_dir, tmp_path):
    """A decoder-only fine-tune: the encoder's weights are bit-identical after training (so
    every image keeps its tokens), the decoder's move; it also survives --resume."""
    base = Trainer(tiny_config(image_dir, tmp_path / "base", steps=3, val_every=0))
    base.run()
    saved = tmp_path / "base" / "final"
    cfg = tiny_config(image_dir, tmp_path / "dec", steps=6, val_every=0, init_from=str(saved),
                      freeze_encoder=True, smooth_fraction=0.5, lr=1e-2)
    Trainer(cfg).run(stop_at=5)  # checkpointed at step 4 (ckpt_every), then "killed"
    resumed = Trainer(cfg, resume=True)
    assert resumed.step == 4 and not any(p.requires_grad for p in resumed.tokenizer.encoder.parameters())
    resumed.run()
    before, after = load_tokenizer(saved), load_tokenizer(tmp_path / "dec" / "final")
    for k, v in before.encoder.state_dict().items():
        torch.testing.assert_close(after.encoder.state_dict()[k], v, rtol=0, atol=0, msg=k)
    assert any(not torch.equal(after.decoder.state_dict()[k], v) for k, v in before.decoder.state_dict().items())
    x = torch.randint(0, 256, (2, 16, 16, 3), dtype=torch.uint8)
    assert torch.equal(after.encode(x), before.encode(x))
    with pytest.raises(ValueError, match="needs init_from"):
        tiny_config(image_dir, tmp_path / "x", freeze_encoder=True)
    with pytest.raises(ValueError, match="margin_weight, quant_noise and latent_tv_weight"):
        tiny_config(image_dir, tmp_path / "x", freeze_encoder=True, init_from=str(saved), margin=0.1,
                    margin_weight=0.1)


def test_cli_init_from_reaches_the_config():
    import argparse

    from vqserve.commands.train import add_parser, build_config

    parser = argparse.ArgumentParser()
    add_parser(parser)
    assert build_config(parser.parse_args(["--init-from", "default"])).init_from == "default"
    assert build_config(parser.parse_args([])).init_from == ""


def test_an_undithered_tokenizer_fine_tunes_into_a_dithered_one(image_dir, tmp_path):
    """The dither changes no weight, so --init-from accepts the same network without it (how
    the v5 default was made from v4); the margin term then sees the dithered rounding, and
    the saved tokenizer carries the dither into config.json and back."""
    import argparse

    from vqserve.commands.train import add_parser, build_config

    base = Trainer(tiny_config(image_dir, tmp_path / "base", steps=3, val_every=0))
    base.run()
    dithered = dict(TINY_MODEL, dither="bayer4")
    start = str(tmp_path / "base" / "final")
    # its tokens will mean something else than the starting tokenizer's: only when asked for
    with pytest.raises(ValueError, match="change_dither: true"):
        Trainer(tiny_config(image_dir, tmp_path / "t0", steps=2, val_every=0, model=dithered, init_from=start))
    tuned = Trainer(tiny_config(image_dir, tmp_path / "tuned", steps=2, val_every=0, model=dithered,
                                init_from=start, margin=0.1, margin_weight=0.1, change_dither=True))
    for k, v in _weights(base.tokenizer).items():
        torch.testing.assert_close(tuned.tokenizer.state_dict()[k], v, rtol=0, atol=0, msg=k)
    assert tuned.run()["step"] == 2
    loaded = load_tokenizer(tmp_path / "tuned" / "final")
    assert loaded.quantizer.dither == "bayer4"
    parser = argparse.ArgumentParser()
    add_parser(parser)
    assert build_config(parser.parse_args(["--dither", "bayer4"])).model["dither"] == "bayer4"
    assert build_config(parser.parse_args(["--change-dither"])).change_dither is True
    # back the other way (dithered default -> an undithered config) is refused the same way,
    # and a frozen encoder can never keep its tokens across a dither change
    with pytest.raises(ValueError, match="tokens would mean something else"):
        Trainer(tiny_config(image_dir, tmp_path / "t1", steps=2, val_every=0, init_from=str(tmp_path / "tuned" / "final")))
    with pytest.raises(ValueError, match="freeze_encoder"):
        Trainer(tiny_config(image_dir, tmp_path / "t2", steps=2, val_every=0, freeze_encoder=True, change_dither=True,
                            init_from=str(tmp_path / "tuned" / "final")))


# -- the shipped recipes (issue 28) ------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_recipe_is_a_valid_training_config(path):
    cfg = TrainConfig.from_dict(load_config_file(path))
    assert cfg.steps > 0 and cfg.data in ("photos:train", "builtin")


@pytest.mark.parametrize("name, recipes", [
    ("default", ["default-v6-decoder.yaml", "default-v6-decoder-256.yaml"]),
    ("dithered", ["default-v5-dither.yaml"]),
])
def test_the_shipped_tokenizers_are_what_their_recipes_train(name, recipes):
    """The configs in configs/ say how each shipped tokenizer was made: their model section
    must be the shipped config, and the v6 stages keep v4's tokens (encoder frozen)."""
    shipped = load_tokenizer(name).config
    for recipe in recipes:
        cfg = TrainConfig.from_dict(load_config_file(ROOT / "configs" / recipe))
        assert cfg.tokenizer_config() == shipped, recipe
        assert cfg.freeze_encoder == (name == "default"), recipe


def test_train_on_budget_sets_the_schedule_from_the_measured_rate(image_dir, tmp_path):
    """scripts/train_on_budget.py (how the v6 default was trained on a lent GPU): a few seconds
    on CPU must still end in a saved, loadable tokenizer whose meta records the plan."""
    import subprocess
    import sys

    root = ROOT
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({**tiny_config(image_dir, tmp_path / "unused").to_dict(), "steps": 10_000}))
    res = subprocess.run([sys.executable, str(root / "scripts" / "train_on_budget.py"), "--config", str(config),
                          "--seconds", "4", "--probe", "6", "--set", "val_every=0", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "run" / "final" / "config.json").read_text())["meta"]
    assert 6 < meta["planned_steps"] < 10_000 and meta["step"] <= meta["planned_steps"]
    assert meta["network_storage"] == "fp16"
    load_tokenizer(tmp_path / "run" / "final")
    bad = subprocess.run([sys.executable, str(root / "scripts" / "train_on_budget.py"), "--config", str(config),
                          "--seconds", "4", "--set", "steps", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr


def test_train_candidates_runs_recipes_side_by_side_and_packs_each(image_dir, tmp_path):
    """scripts/train_candidates.sh (the v6 default's eight candidates on a lent GPU): two tiny
    candidates side by side on CPU, each packed as NAME.tar holding a loadable tokenizer whose
    meta carries its own override."""
    import os
    import subprocess
    import sys
    import tarfile

    root = ROOT
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({**tiny_config(image_dir, tmp_path / "unused").to_dict(), "steps": 10_000}))
    env = {**os.environ, "PY": sys.executable, "COMMON": "val_every=0"}
    res = subprocess.run(["bash", str(root / "scripts" / "train_candidates.sh"), "4", str(tmp_path / "out"),
                          str(config), "A seed=1", "B seed=2 block_chroma_weight=1.0"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    for name, seed in (("A", 1), ("B", 2)):
        with tarfile.open(tmp_path / "out" / f"{name}.tar") as tar:
            tar.extractall(tmp_path / name, filter="data")
        assert json.loads((tmp_path / name / "final" / "config.json").read_text())["meta"]["seed"] == seed
        load_tokenizer(tmp_path / name / "final")
    bad = subprocess.run(["bash", str(root / "scripts" / "train_candidates.sh"), "4", str(tmp_path / "o2"),
                          str(config), "no/slash seed=1"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "letters, digits" in bad.stderr


def test_batches_cut_ahead_in_threads_are_the_batches_of_their_steps(image_dir, tmp_path):
    """On an accelerator the trainer cuts the next batches in threads (Trainer._host_batch);
    forced on here on CPU: in order, after a jump (a resume) and backwards, every batch is
    exactly the one its step gives without threads."""
    trainer = Trainer(tiny_config(image_dir, tmp_path / "run", smooth_fraction=0.5))
    assert trainer.prefetch == 0       # on CPU the threads would take the step's cores
    trainer.prefetch = 3
    for step in (0, 1, 2, 3, 10, 11, 5):
        assert torch.equal(trainer._batch(step), trainer.crops.batch(step)), step
    assert set(trainer._ahead) <= set(range(5, 9))
