"""The stand-in accelerator's decode (export/runtimes/synthetic.py): each index's grey level
over its 8x8 block in every channel, as a writable C-contiguous uint8 array - written by one
broadcast now, so the stand-in spends little CPU of its own and a CPU measurement of the
decode reply path measures the path."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vqserve.export.runtimes.synthetic import CODEBOOK_SIZE, FACTOR, SyntheticRuntime


@settings(max_examples=50, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 5), w=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_decode_paints_each_block_with_its_index_grey_level(b, h, w, seed):
    indices = np.random.default_rng(seed).integers(0, CODEBOOK_SIZE, (b, h, w)).astype(np.uint16)
    pixels = SyntheticRuntime("synthetic:0").decode(indices)
    assert pixels.shape == (b, h * FACTOR, w * FACTOR, 3) and pixels.dtype == np.uint8
    assert pixels.flags.c_contiguous and pixels.flags.writeable
    naive = np.repeat(np.repeat((indices % 256).astype(np.uint8), FACTOR, 1), FACTOR, 2)
    np.testing.assert_array_equal(pixels, np.stack([naive] * 3, axis=-1))
