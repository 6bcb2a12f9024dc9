"""Tokenizer shapes, factors, quantizer kinds and the clear errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_tokenizer
from vqserve.model import TokenizerConfig


@pytest.mark.parametrize("channels,factor", [([16, 16], 4), ([16, 16, 16], 8), ([8, 16, 16, 16], 16)])
def test_factor_and_round_trip_shapes(channels, factor):
    tok = make_tokenizer(channels=channels)
    assert tok.factor == factor
    images = torch.randint(0, 256, (2, 32, 48, 3), dtype=torch.uint8)
    indices = tok.encode(images)
    assert indices.shape == (2, 32 // factor, 48 // factor)
    pixels = tok.decode(indices)
    assert pixels.shape == (2, 32, 48, 3) and pixels.dtype == torch.uint8


@pytest.mark.parametrize("channels,patch,factor", [([16], 4, 8), ([16, 16], 2, 8), ([16, 16], 4, 16)])
def test_pixel_shuffle_stem_sets_the_factor_and_keeps_full_resolution_out(channels, patch, factor):
    tok = make_tokenizer(channels=channels, patch_size=patch)
    assert tok.factor == factor
    # no convolution sees full resolution: the first one takes p*p*3 folded channels
    assert tok.encoder.conv_in.in_channels == 3 * patch * patch
    assert tok.decoder.conv_out.out_channels == 3 * patch * patch
    images = torch.randint(0, 256, (2, 32, 48, 3), dtype=torch.uint8)
    indices = tok.encode(images)
    assert indices.shape == (2, 32 // factor, 48 // factor)
    assert tok.decode(indices).shape == (2, 32, 48, 3)


@pytest.mark.parametrize("quantizer,extra", [
    ("fsq", {}), ("lfq", {"lfq_dim": 10}), ("vq", {"vq_codebook_size": 128, "vq_dim": 4}),
    ("rfsq", {"num_quantizers": 3}),
])
def test_every_quantizer_kind(quantizer, extra):
    tok = make_tokenizer(quantizer=quantizer, **extra)
    images = np.random.default_rng(0).integers(0, 256, (1, 16, 16, 3), dtype=np.uint8)
    indices = tok.encode(images)  # numpy input is accepted too
    expected = (1, 2, 2) + ((3,) if quantizer == "rfsq" else ())
    assert tuple(indices.shape) == expected
    assert int(indices.max()) < tok.codebook_size
    assert tok.decode(indices).shape == (1, 16, 16, 3)


def test_decode_is_deterministic_and_encode_decode_agree_with_float_path():
    tok = make_tokenizer()
    images = torch.randint(0, 256, (2, 16, 16, 3), dtype=torch.uint8)
    indices = tok.encode(images)
    x = images.permute(0, 3, 1, 2).float() / 127.5 - 1
    assert torch.equal(tok.encode_float(x), indices)
    assert torch.equal(tok.decode(indices), tok.decode(indices))


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), w=st.integers(1, 4))
def test_any_multiple_of_factor_works(b, h, w):
    tok = make_tokenizer(channels=[8, 8])
    images = torch.zeros(b, 4 * h, 4 * w, 3, dtype=torch.uint8)
    assert tok.encode(images).shape == (b, h, w)


BAD_IMAGES = [
    (torch.zeros(16, 16, 3, dtype=torch.uint8), "rank 4"),
    (torch.zeros(1, 16, 16, 4, dtype=torch.uint8), "3 channels"),
    (torch.zeros(1, 16, 16, 3, dtype=torch.float32), "uint8"),
    (torch.zeros(1, 12, 16, 3, dtype=torch.uint8), "multiples of the downsampling factor 8"),
    (torch.zeros(1, 16, 0, 3, dtype=torch.uint8), "multiples"),
    (torch.zeros(0, 16, 16, 3, dtype=torch.uint8), "empty batch"),
    ([[1, 2, 3]], "torch.Tensor or numpy"),
]


@pytest.mark.parametrize("images,message", BAD_IMAGES)
def test_encode_bad_input_is_a_clear_value_error(images, message):
    with pytest.raises(ValueError, match=message):
        make_tokenizer().encode(images)


BAD_INDICES = [
    (torch.zeros(2, 2, dtype=torch.int64), r"shape \[B,h,w\]"),
    (torch.zeros(1, 2, 2, dtype=torch.float32), "integer"),
    (torch.zeros(1, 2, 2, dtype=torch.bool), "integer"),
    (torch.full((1, 2, 2), 1000), r"\[0, 999\]"),
    (torch.full((1, 2, 2), -1), r"\[0, 999\]"),
    (torch.zeros(1, 0, 2, dtype=torch.int64), "empty"),
]


@pytest.mark.parametrize("indices,message", BAD_INDICES)
def test_decode_bad_indices_is_a_clear_value_error(indices, message):
    with pytest.raises(ValueError, match=message):
        make_tokenizer().decode(indices)


def test_config_validation():
    with pytest.raises(ValueError, match="quantizer must be one of"):
        TokenizerConfig(quantizer="pq")
    with pytest.raises(ValueError, match="must be 4, 8 or 16"):
        TokenizerConfig(channels=[8])
    with pytest.raises(ValueError, match="must be 4, 8 or 16"):
        TokenizerConfig(channels=[8, 8, 8], patch_size=4)  # factor 32
    with pytest.raises(ValueError, match="patch_size must be 1, 2 or 4"):
        TokenizerConfig(channels=[8, 8], patch_size=3)
    with pytest.raises(ValueError, match="attention_heads"):
        TokenizerConfig(channels=[8, 8, 10], attention=True, attention_heads=4)
    with pytest.raises(ValueError, match="levels must each be >= 3"):
        make_tokenizer(levels=[2, 5])
