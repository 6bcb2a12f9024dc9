"""The subtractive ordered dither of FSQ (``dither="bayer4"``): what it promises.

* indices and codes stay each other's inverse, in every dtype, at every position;
* a flat latent between two levels alternates codes, and the codes' mean over a 4x4 block
  lands within 1/32 of a level of the latent (plain rounding is off by up to 1/2): the
  reason it exists, slow gradients without bands;
* the pattern hangs on the grid: crops cut at multiples of 4 positions give the same
  tokens, other crops need not;
* config.json carries it, undithered configs stay as they were, and every exported format
  rebuilds the pattern for sizes it was never traced at.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vqserve.model import FSQ, Tokenizer, TokenizerConfig, load_tokenizer, save_tokenizer

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@settings(max_examples=30, deadline=None)
@given(
    levels=st.lists(st.integers(3, 8), min_size=1, max_size=6),
    h=st.integers(1, 9), w=st.integers(1, 9),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
)
def test_dithered_codes_and_indices_are_inverse(levels, h, w, dtype, seed):
    q = FSQ(levels, dither="bayer4")
    z = (torch.randn(2, h, w, len(levels), generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    codes, indices = q(z)
    assert codes.dtype == dtype and indices.dtype == torch.int64 and indices.shape == z.shape[:-1]
    assert int(indices.min()) >= 0 and int(indices.max()) < q.codebook_size
    assert torch.equal(q.indices_to_codes(indices, dtype=dtype), codes)
    assert torch.equal(q.codes_to_indices(codes), indices)


@settings(max_examples=40, deadline=None)
@given(level_value=st.floats(-1.9, 1.9), channel=st.integers(0, 5))
def test_a_flat_latent_averages_to_its_value_within_a_32nd_of_a_level(level_value, channel):
    """Pre-rounding latent ``level_value`` (in levels) everywhere on an 8x8 grid: plain
    rounding gives one code (error up to 1/2 level), the dither a mix of codes whose mean
    is within 1/32 of a level."""
    levels = [8, 8, 8, 5, 5, 5]
    q, plain = FSQ(levels, dither="bayer4"), FSQ(levels)
    half_width = levels[channel] // 2
    flat = torch.zeros(1, 8, 8, len(levels))
    flat[..., channel] = level_value
    codes, indices = q.quantize_bounded(flat + q.dither_offsets(flat))  # what bound() adds
    plain_codes, plain_indices = plain.quantize_bounded(flat)
    assert abs(float(codes[..., channel].mean() * half_width) - level_value) <= 1 / 32 + 1e-5
    assert plain_indices.unique().numel() == 1  # one code: the staircase the dither removes
    assert abs(float(plain_codes[..., channel].mean() * half_width) - level_value) <= 0.5 + 1e-5
    assert torch.equal(q.indices_to_codes(indices), codes)


def test_the_pattern_is_anchored_to_the_grid():
    q = FSQ([8, 8, 8, 5, 5, 5], dither="bayer4")
    z = torch.randn(1, 12, 16, 6) * 2
    _, whole = q(z)
    _, aligned = q(z[:, 4:, 8:])
    assert torch.equal(aligned, whole[:, 4:, 8:])
    _, shifted = q(z[:, 1:, 3:])
    assert not torch.equal(shifted, whole[:, 1:, 3:])
    offsets = q.dither_offsets(z)
    assert offsets.shape == (12, 16, 6)
    # 16 distinct offsets in every 4x4 block of every channel, symmetric about zero
    block = offsets[:4, :4]
    for c in range(6):
        assert block[..., c].unique().numel() == 16
    assert float(block.mean()) == 0.0 and float(offsets.abs().max()) < 0.5
    # channels do not dither in step
    assert not torch.equal(block[..., 0], block[..., 1])


def test_dither_needs_positions_and_a_known_name():
    with pytest.raises(ValueError, match="dither must be one of"):
        FSQ([5, 5], dither="blue-noise")
    with pytest.raises(ValueError, match=r"needs positions: \[\.\.\., h, w, 2\]"):
        FSQ([5, 5], dither="bayer4")(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="needs quantizer 'fsq'"):
        TokenizerConfig(quantizer="lfq", dither="bayer4")


def test_config_json_carries_the_dither_and_leaves_undithered_files_alone(tmp_path):
    small = dict(channels=[8], patch_size=4, levels=[5, 5, 5])
    plain = save_tokenizer(Tokenizer(TokenizerConfig(**small)).eval(), tmp_path / "plain")
    assert "dither" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    dithered = save_tokenizer(Tokenizer(TokenizerConfig(**small, dither="bayer4")).eval(), tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dither"] == "bayer4"
    assert load_tokenizer(dithered).quantizer.dither == "bayer4"
    assert load_tokenizer(plain).quantizer.dither == "none"


def test_decode_of_encode_uses_the_same_pattern():
    """The eager tokenizer: decoding a token grid rebuilds the codes the encoder rounded to."""
    torch.manual_seed(0)
    tok = Tokenizer(TokenizerConfig(channels=[8], patch_size=4, levels=[5, 5, 5], dither="bayer4")).eval()
    x = torch.rand(2, 3, 40, 56) * 2 - 1
    codes, indices = tok.quantize(tok.encode_latents(x))
    assert torch.equal(tok.indices_to_codes(indices), codes)


@pytest.mark.parametrize("fmt", ["torchscript", "onnx", "pt2"])
def test_every_format_rebuilds_the_pattern_at_sizes_it_was_not_traced_at(fmt, photos, tmp_path):
    from tests.conftest import make_tokenizer
    from vqserve.export.exporter import export_model
    from vqserve.export.runtimes.loader import EagerRuntime, load_runtime

    ckpt = tmp_path / "dithered"
    save_tokenizer(make_tokenizer(channels=[16], patch_size=4, dither="bayer4"), ckpt)
    manifest = export_model(str(ckpt), fmt, "fp32", tmp_path / fmt, parity_size=32, parity_count=4)
    assert manifest["dither"] == "bayer4"  # a reader of the artifact learns codes depend on position
    rt = load_runtime(tmp_path / fmt)
    ref = EagerRuntime(str(ckpt))
    assert rt.info.dither == ref.info.dither == "bayer4"
    for images in (photos[:1], photos[:3, :40, :56], photos[:2, :24, :16]):
        idx = rt.encode(images)
        np.testing.assert_array_equal(idx, ref.encode(images))
        diff = np.abs(rt.decode(idx).astype(int) - ref.decode(idx).astype(int)).max()
        assert diff <= (1 if fmt == "onnx" else 0)


def test_a_server_says_its_tokens_are_dithered_and_round_trips_them(photos, tmp_path):
    """The real gRPC server on a dithered checkpoint: GetModelInfo says ``bayer4`` (a client
    computing codes itself must add the offsets), and its tokens and pixels are the eager
    model's, whole photographs and 32-pixel-aligned pieces alike."""
    from tests.conftest import make_tokenizer
    from vqserve.export.runtimes.loader import EagerRuntime
    from vqserve.serve.clients.sync import TokenizerClient
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    ckpt = tmp_path / "dithered"
    save_tokenizer(make_tokenizer(channels=[16], patch_size=4, dither="bayer4"), ckpt)
    ref = EagerRuntime(str(ckpt))
    config = ServerConfig(model=str(ckpt), backend="eager", device="cpu", host="127.0.0.1", port=0,
                          metrics_port=0, max_batch_size=8, max_delay_ms=5, grace_s=2)
    with ServerThread(config) as server, TokenizerClient(server.target, timeout=30) as client:
        assert client.model_info()["dither"] == "bayer4"
        for images in (photos[:2], photos[:1, 8:40, 16:56]):
            tokens = client.encode(images)
            np.testing.assert_array_equal(tokens, ref.encode(images))
            np.testing.assert_array_equal(client.decode(tokens), ref.decode(tokens))
