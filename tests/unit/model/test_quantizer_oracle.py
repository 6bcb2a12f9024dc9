"""FSQ and LFQ produce exactly vector-quantize-pytorch's indices (test-only oracle).

Tokens must be interchangeable with models trained with that library, so agreement is
asserted at 100% in fp32, over random inputs that span the whole bounded range.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vector_quantize_pytorch import FSQ as OracleFSQ
from vector_quantize_pytorch import LFQ as OracleLFQ

from vqserve.model import FSQ, LFQ

LEVEL_SETS = [[8, 5, 5, 5], [8, 8, 8, 5, 5, 5], [7, 5, 5, 5, 5], [8, 6, 5], [3, 3, 3, 3]]


@pytest.mark.parametrize("levels", LEVEL_SETS, ids=str)
@pytest.mark.parametrize("scale", [0.5, 2.0, 6.0])
def test_fsq_indices_match_oracle(levels, scale):
    torch.manual_seed(len(levels) * 100 + int(scale * 10))
    z = torch.randn(3, 2048, len(levels)) * scale
    oracle_codes, oracle_indices = OracleFSQ(levels)(z)
    codes, indices = FSQ(levels)(z)
    assert torch.equal(indices, oracle_indices.long())
    assert torch.equal(codes, oracle_codes)


@pytest.mark.parametrize("levels", LEVEL_SETS, ids=str)
def test_fsq_indices_to_codes_match_oracle(levels):
    q, oracle = FSQ(levels), OracleFSQ(levels)
    indices = torch.arange(q.codebook_size)
    assert q.codebook_size == oracle.codebook_size
    assert torch.equal(q.indices_to_codes(indices), oracle.indices_to_codes(indices))


@settings(max_examples=25, deadline=None)
@given(
    levels=st.lists(st.integers(min_value=3, max_value=9), min_size=1, max_size=6),
    n=st.integers(min_value=1, max_value=300),
    seed=st.integers(0, 2**16),
)
def test_fsq_property_agreement(levels, n, seed):
    if any(level == 2 for level in levels):
        return
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, n, len(levels), generator=g) * 3
    assert torch.equal(FSQ(levels)(z)[1], OracleFSQ(levels)(z)[1].long())


@pytest.mark.parametrize("dim", [16, 10, 4])
def test_lfq_indices_match_oracle(dim):
    torch.manual_seed(dim)
    z = torch.randn(4, 1024, dim)
    oracle = OracleLFQ(dim=dim).eval()
    ours = LFQ(dim).eval()
    oracle_codes, oracle_indices, _ = oracle(z)
    codes, indices = ours(z)
    assert torch.equal(indices, oracle_indices.long())
    assert torch.equal(codes, oracle_codes)
    sample = torch.randint(0, 2**dim, (257,))
    assert torch.equal(ours.indices_to_codes(sample), oracle.indices_to_codes(sample))
