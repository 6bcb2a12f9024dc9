"""Shards record a pyramid's scales and nothing new for a grid: grid shards keep their bytes,
pyramid rows come back flat with the layout beside them (Parquet metadata, WebDataset member)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vqserve.core.token_layout import PYRAMID, SEQUENCE, TokenLayout, as_schedule
from vqserve.offline import shards

GRID = TokenLayout(factor=8)
PYR = TokenLayout(factor=16, kind=PYRAMID, schedules=(as_schedule([1, 2, 3, 4, 5, 6, 8, 10, 13, 16]),))


def _row(key: str, tokens: np.ndarray, side: int) -> shards.TokenRow:
    return shards.TokenRow(key=key, source=f"/x/{key}.png", orig_height=side, orig_width=side,
                           crop=(0, 0, side, side), height=side, width=side, tokens=tokens)


@pytest.mark.parametrize("fmt", shards.FORMATS)
def test_grid_shards_are_byte_identical_with_or_without_the_layout(tmp_path, fmt):
    rows = [_row(f"k{i}", np.arange(64, dtype=np.uint16).reshape(8, 8) + i, 64) for i in range(3)]
    write = shards.WRITERS[fmt]
    write(tmp_path / "a", rows, "uint16", "fp", "plan", [])
    write(tmp_path / "b", rows, "uint16", "fp", "plan", [], shards.CURRENT_LAYOUT, GRID)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


@pytest.mark.parametrize("fmt", shards.FORMATS)
def test_pyramid_rows_come_back_flat_with_their_finest_scale(tmp_path, fmt):
    rows = [_row(f"k{i}", (np.arange(680) % 4096).astype(np.uint16) + i, 256) for i in range(2)]
    path = tmp_path / shards.shard_name(0, fmt)
    shards.WRITERS[fmt](path, rows, "uint16", "fp", "plan", [], shards.CURRENT_LAYOUT, PYR)
    back = shards.read_rows(path)
    assert [r["tokens"].shape for r in back] == [(680,), (680,)]
    assert all((r["grid_height"], r["grid_width"]) == (16, 16) for r in back)
    np.testing.assert_array_equal(back[1]["tokens"], rows[1].tokens)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        meta = pq.read_metadata(path).metadata
        assert json.loads(meta[shards.META_TOKEN_LAYOUT]) == PYR.to_dict()


@pytest.mark.parametrize("fmt", shards.FORMATS)
def test_sequence_rows_come_back_flat_as_one_row_of_tokens(tmp_path, fmt):
    seq = TokenLayout(factor=16, kind=SEQUENCE, length=32, size=(256, 256))
    rows = [_row(f"k{i}", np.arange(32, dtype=np.uint16) + i, 256) for i in range(2)]
    path = tmp_path / shards.shard_name(0, fmt)
    shards.WRITERS[fmt](path, rows, "uint16", "fp", "plan", [], shards.CURRENT_LAYOUT, seq)
    back = shards.read_rows(path)
    assert [r["tokens"].shape for r in back] == [(32,), (32,)]
    assert all((r["grid_height"], r["grid_width"]) == (1, 32) for r in back)
    np.testing.assert_array_equal(back[1]["tokens"], rows[1].tokens)
