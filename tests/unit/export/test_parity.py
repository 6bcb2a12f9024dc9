"""Parity helpers: the validation photos mirror the training split; metrics are sane."""

from __future__ import annotations

import numpy as np
import pytest

from vqserve.export.parity import VALIDATION_PHOTOS, measure_parity, psnr, validation_photos
from vqserve.export.runtimes.loader import EagerRuntime


def test_validation_photos_mirror_the_training_split():
    data = pytest.importorskip("vqserve.training.data")
    assert VALIDATION_PHOTOS == tuple(data.BUILTIN_VAL)
    ref = data.tile_crops([data.load_builtin_photo(n) for n in data.BUILTIN_VAL], 128)
    ours, info = validation_photos(128)
    np.testing.assert_array_equal(ours, ref)
    assert info["count"] == len(ref) == 18 and info["split"] == "val"


def test_validation_photos_round_robin_count():
    batch, info = validation_photos(32, 4)
    assert batch.shape == (4, 32, 32, 3) and batch.dtype == np.uint8
    with pytest.raises(ValueError, match="validation tiles"):
        validation_photos(256, 50)


def test_psnr():
    a = np.zeros((2, 8, 8, 3), np.uint8)
    assert psnr(a, a) == float("inf")
    b = a.copy()
    b[..., 0] = 255
    assert abs(psnr(a, b) - 10 * np.log10(3)) < 1e-9


def test_eager_against_itself_is_perfect(tiny_checkpoint, photos):
    rt = EagerRuntime(tiny_checkpoint)
    p = measure_parity(rt, rt, photos[:, :32, :32])
    assert p["index_agreement"] == 1.0 and p["decode_max_abs_diff"] == 0
    assert p["psnr_db"] == p["reference_psnr_db"] and p["decode_psnr_vs_reference_db"] == "inf"
    assert p["positions"] == 4 * 4 * 4
