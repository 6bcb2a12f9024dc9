"""LFQ's bit order is a property of the island: msb_first (vqserve, vector-quantize-pytorch,
Show-o's MAGVIT-v2) and lsb_first (Open-MAGVIT2) give each other's indices bit-reversed,
round-trip on their own, and keep the sign rule (z > 0) of the default."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vqserve.model import LFQ
from vqserve.model.families.magvit2.family import open_magvit2_lfq


def reverse_bits(indices: torch.Tensor, dim: int) -> torch.Tensor:
    out = torch.zeros_like(indices)
    for k in range(dim):
        out |= ((indices >> k) & 1) << (dim - 1 - k)
    return out


latents = st.integers(1, 20).flatmap(lambda dim: st.tuples(
    st.just(dim),
    st.lists(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=dim, max_size=dim),
             min_size=1, max_size=8)))


@settings(max_examples=60, deadline=None)
@given(latents, st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_the_two_orders_are_each_others_bit_reversal(case, dtype):
    dim, rows = case
    z = torch.tensor(rows, dtype=torch.float32).to(dtype)
    msb = LFQ(dim, max_entropy_codebook=0).eval()
    lsb = LFQ(dim, max_entropy_codebook=0, bit_order="lsb_first").eval()
    codes_m, idx_m = msb(z)
    codes_l, idx_l = lsb(z)
    assert torch.equal(codes_m, codes_l)  # the order changes the integer, never the code
    assert torch.equal(idx_l, reverse_bits(idx_m, dim))
    bits = (z.to(torch.float32) > 0).to(torch.int64)  # the sign rule: 0, -0 and NaN are bit 0
    assert torch.equal(idx_m, (bits * 2 ** torch.arange(dim - 1, -1, -1)).sum(-1))
    assert torch.equal(idx_l, (bits * 2 ** torch.arange(dim)).sum(-1))
    for q, idx in ((msb, idx_m), (lsb, idx_l)):
        assert torch.equal(q(q.indices_to_codes(idx))[1], idx)  # each order round-trips alone


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.data())
def test_indices_to_codes_puts_channel_zero_where_the_order_says(dim, data):
    index = data.draw(st.integers(0, 2**dim - 1))
    msb = LFQ(dim, max_entropy_codebook=0).indices_to_codes(torch.tensor([index]))[0]
    lsb = LFQ(dim, max_entropy_codebook=0, bit_order="lsb_first").indices_to_codes(torch.tensor([index]))[0]
    assert (msb[0] > 0) == bool(index >> (dim - 1) & 1)  # channel 0: the most significant bit
    assert (lsb[0] > 0) == bool(index & 1)               # channel 0: the least significant bit


def test_open_magvit2_keeps_lsb_first_and_vqserve_keeps_msb_first():
    one_hot = torch.where(torch.eye(5, dtype=torch.bool), 1.0, -1.0)
    assert open_magvit2_lfq(5)(one_hot)[1].tolist() == [1, 2, 4, 8, 16]
    assert LFQ(5)(one_hot)[1].tolist() == [16, 8, 4, 2, 1]
    assert "bit_order=lsb_first" in repr(open_magvit2_lfq(5))
    with pytest.raises(ValueError, match=r"bit_order must be one of \['msb_first', 'lsb_first'\], got 'big'"):
        LFQ(4, bit_order="big")
