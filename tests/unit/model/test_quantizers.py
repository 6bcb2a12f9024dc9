"""Quantizer behaviour: dtypes, ranges, inverses, gradients, VQ training mechanics."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vqserve.model import FSQ, LFQ, VQ, ResidualFSQ

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@settings(max_examples=30, deadline=None)
@given(
    levels=st.lists(st.integers(3, 8), min_size=1, max_size=5),
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
)
def test_fsq_properties(levels, shape, dtype, seed):
    q = FSQ(levels)
    z = (torch.randn(*shape, len(levels), generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    codes, indices = q(z)
    assert codes.dtype == dtype and codes.shape == z.shape
    assert indices.dtype == torch.int64 and indices.shape == z.shape[:-1]
    assert int(indices.min()) >= 0 and int(indices.max()) < q.codebook_size
    # the codes are exactly the codebook entries of the indices
    assert torch.equal(q.indices_to_codes(indices, dtype=dtype), codes)
    assert torch.equal(q.codes_to_indices(codes), indices)


@settings(max_examples=20, deadline=None)
@given(dim=st.integers(1, 20), n=st.integers(1, 50), dtype=st.sampled_from(DTYPES))
def test_lfq_properties(dim, n, dtype):
    q = LFQ(dim, max_entropy_codebook=2**12).eval()
    z = torch.randn(n, dim).to(dtype)
    codes, indices = q(z)
    assert codes.dtype == dtype
    assert int(indices.max()) < 2**dim and int(indices.min()) >= 0
    assert torch.equal(q.indices_to_codes(indices, dtype=dtype), codes)


@pytest.mark.parametrize("make", [lambda: FSQ([8, 5, 5, 5]), lambda: LFQ(4),
                                  lambda: ResidualFSQ([5, 5, 5, 5], 2)])
def test_straight_through_gradient(make):
    q = make().train()
    z = torch.randn(10, 4, requires_grad=True)
    codes = q(z)[0]
    codes.sum().backward()
    assert z.grad is not None and z.grad.abs().sum() > 0


def test_indices_to_codes_rejects_nothing_but_check_indices_does():
    q = FSQ([8, 5, 5, 5])
    with pytest.raises(ValueError, match=r"\[0, 999\]"):
        q.check_indices(torch.tensor([0, 1000]))
    with pytest.raises(ValueError, match="integer"):
        q.check_indices(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="channel-last"):
        q(torch.randn(3, 5))


def test_residual_fsq_refines_and_inverts():
    torch.manual_seed(0)
    z = torch.tanh(torch.randn(2000, 4))
    errs = []
    for n in (1, 2, 3):
        q = ResidualFSQ([7, 7, 7, 7], n)
        codes, indices = q(torch.atanh(z.clamp(-0.999, 0.999)) * 0 + z)
        assert indices.shape == (2000, n)
        assert torch.allclose(q.indices_to_codes(indices), codes, atol=1e-6)
        errs.append((codes - z).abs().mean().item())
    assert errs[0] > errs[1] > errs[2]


class TestVQ:
    def test_kmeans_init_on_first_training_batch(self):
        torch.manual_seed(0)
        centres = torch.randn(8, 3) * 5
        data = (centres.repeat(64, 1) + 0.01 * torch.randn(512, 3))
        q = VQ(8, 3, kmeans_iters=20).train()
        assert not bool(q.initted)
        q(data)
        assert bool(q.initted)
        # every true centre has a code within reach after k-means
        assert torch.cdist(centres, q.embed).min(dim=1).values.max() < 1.0

    def test_ema_update_pulls_codes_and_commitment_loss(self):
        torch.manual_seed(0)
        q = VQ(4, 2, kmeans_init=False, decay=0.5, dead_code_threshold=0.0).train()
        target = torch.tensor([[3.0, 3.0]])
        data = target.repeat(32, 1)
        before = q.embed.clone()
        for _ in range(10):
            _, indices, aux = q(data, return_aux=True)
        moved = (q.embed - target).norm(dim=1).min()
        assert moved < (before - target).norm(dim=1).min()
        assert moved < 0.1
        assert "commitment" in aux and aux["commitment"] >= 0

    def test_dead_codes_are_replaced_from_the_batch(self):
        torch.manual_seed(0)
        q = VQ(16, 2, kmeans_init=False, decay=0.5, dead_code_threshold=0.5).train()
        data = torch.randn(256, 2) * 0.01 + 10.0  # far from all initial codes
        for _ in range(5):
            q(data)
        _, indices = q.eval()(data)
        # codes that were never used got moved onto the data: many codes now live there
        assert (q.embed - 10.0).abs().max(dim=1).values.lt(1.0).sum() >= 8
        assert indices.unique().numel() > 1

    def test_eval_does_not_update_and_dtypes(self):
        q = VQ(32, 4).eval()
        before = q.embed.clone()
        for dtype in DTYPES:
            codes, indices = q(torch.randn(5, 7, 4).to(dtype))
            assert codes.dtype == dtype and indices.shape == (5, 7)
        assert torch.equal(before, q.embed)
        assert torch.equal(q.indices_to_codes(indices), q.embed[indices])
