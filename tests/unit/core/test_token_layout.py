"""The one token-shape rule (vqserve.core.token_layout): grids keep their shapes and records,
pyramids are flat, split back into their scales, and refuse other sizes in one line; a
sequence (TiTok) is flat too, of one length for its one image size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vqserve.core.runtime_info import RuntimeInfo
from vqserve.core.token_layout import PYRAMID, SEQUENCE, TokenLayout, as_schedule, schedule_length

VAR_256 = as_schedule([1, 2, 3, 4, 5, 6, 8, 10, 13, 16])
VAR_512 = as_schedule([1, 2, 3, 4, 6, 9, 13, 18, 24, 32])
PYR = TokenLayout(factor=16, kind=PYRAMID, schedules=(VAR_256, VAR_512))


def test_grid_shapes_and_no_record():
    grid = TokenLayout(factor=8)
    assert grid.token_shape(64, 32) == (8, 4)
    assert TokenLayout(factor=8, codes_per_position=4).token_shape(64, 32) == (8, 4, 4)
    assert grid.image_size((8, 4)) == (64, 32)
    assert grid.to_dict() == {}  # files of grid models carry no layout key
    assert grid.shape_rule((2, 8, 4)) is None
    assert grid.shape_rule((2, 8)) == "must be [B,h,w], got [2, 8]"
    assert TokenLayout(factor=8, codes_per_position=4).shape_rule((1, 2, 2, 3)) == "must be [B,h,w,4], got [1, 2, 2, 3]"


def test_grid_runtime_identity_is_unchanged():
    info = RuntimeInfo(backend="eager", dtype="fp32", device="cpu", quantizer="fsq", codebook_size=1000, factor=8,
                       model_hash="h", exact=True)
    assert set(info.identity()) == {"model_hash", "source_hash", "dtype", "backend", "exact"}
    assert info.layout.is_grid


def test_pyramid_var_lengths_and_identity():
    assert PYR.token_shape(256, 256) == (680,)
    assert schedule_length(VAR_512) == 2240
    assert PYR.token_shape(512, 512) == (2240,)
    assert PYR.image_size((680,)) == (256, 256)
    info = RuntimeInfo(backend="eager", dtype="fp32", device="cpu", quantizer="msvq", codebook_size=4096, factor=16,
                       model_hash="h", token_layout=PYR.to_dict())
    assert info.identity()["token_layout"]["kind"] == "pyramid"
    assert TokenLayout.from_info(info.to_dict()) == PYR
    assert TokenLayout.from_info(info) == PYR


def test_pyramid_refusals_are_one_line_and_name_the_scales():
    rule = PYR.size_rule(320, 320)
    assert "256x256, 512x512" in rule and "\n" not in rule
    with pytest.raises(ValueError, match="got 320x256"):
        PYR.token_shape(320, 256)
    rule = PYR.shape_rule((1, 679))
    assert "680 (scales 1,2,3,4,5,6,8,10,13,16)" in rule and "[679]" in rule
    assert PYR.shape_rule((1, 16, 16)).startswith("must be [B,L] with L=680")


@given(st.integers(1, 3), st.sampled_from([VAR_256, VAR_512, as_schedule([(1, 2), (2, 3), (4, 6)])]))
def test_split_is_coarse_to_fine_row_major(batch, schedule):
    layout = TokenLayout(factor=16, kind=PYRAMID, schedules=(schedule,))
    flat = np.arange(batch * schedule_length(schedule)).reshape(batch, -1)
    parts = layout.split(flat)
    assert [p.shape[1:] for p in parts] == list(schedule)
    assert np.array_equal(np.concatenate([p.reshape(batch, -1) for p in parts], 1), flat)
    assert [e - s for s, e in layout.scale_bounds(flat.shape[1])] == [h * w for h, w in schedule]


def test_unknown_kind_and_ambiguous_lengths_refused():
    with pytest.raises(ValueError, match="unknown token layout"):
        TokenLayout.from_dict({"kind": "hologram"}, 8)
    with pytest.raises(ValueError, match="distinct lengths"):
        TokenLayout(factor=16, kind=PYRAMID, schedules=(as_schedule([1, 2]), as_schedule([(1, 1), (1, 4)])))


SEQ = TokenLayout(factor=16, kind=SEQUENCE, length=32, size=(256, 256))


def test_sequence_is_one_flat_length_for_one_size_and_travels_as_a_record():
    assert SEQ.token_shape(256, 256) == (32,) and SEQ.image_size((32,)) == (256, 256)
    assert SEQ.item_rank() == 1 and not SEQ.is_grid
    assert SEQ.shape_rule((3, 32)) is None
    assert SEQ.shape_rule((3, 31)) == "must be [B,32] (a 1-D sequence of 32 tokens per image), got per-image shape [31]"
    assert SEQ.shape_rule((3, 2, 16)).startswith("must be [B,L] with L=32 (a 1-D sequence, 256x256 images)")
    assert SEQ.size_rule(512, 512) == "this 1-D tokenizer takes 256x256 images only (32 tokens each), got 512x512"
    assert SEQ.size_rule(250, 256).startswith("H and W must be positive multiples")
    assert SEQ.square_size_near(100) == 256 and SEQ.square_sides() == [256]
    assert SEQ.shard_grid(256, 256) == (1, 32) and PYR.shard_grid(256, 256) == (16, 16)
    flat = np.arange(64).reshape(2, 32)
    assert len(SEQ.split(flat)) == 1 and SEQ.scale_bounds(32) == [(0, 32)]
    assert SEQ.to_dict() == {"kind": "sequence", "length": 32, "size": [256, 256]}
    info = RuntimeInfo(backend="eager", dtype="fp32", device="cpu", quantizer="vq", codebook_size=4096, factor=16,
                       model_hash="h", token_layout=SEQ.to_dict())
    assert info.identity()["token_layout"]["kind"] == "sequence"
    assert TokenLayout.from_info(info.to_dict()) == SEQ == TokenLayout.from_info(info)
    with pytest.raises(ValueError, match="needs a positive length"):
        TokenLayout(factor=16, kind=SEQUENCE)
