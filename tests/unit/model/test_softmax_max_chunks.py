"""IBQ's index rule (max of softmax(z . codebook), the lowest index among equal probabilities)
scored in runs of positions gives the same indices as scored whole, at one intra-op thread
(how vqserve runs every model call): on random latents and on adversarial ties, equal
logits and near-equal logits that softmax rounds to one probability, where the rule's
answer is not the argmax of the logits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vqserve.model.quantizers.softmax_max import (
    SoftmaxMaxVQ,
    positions_per_chunk,
    softmax_max_index,
    softmax_max_index_chunked,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tied_codebook(n: int, d: int, seed: int, near: int) -> torch.Tensor:
    """Random rows, with ``near`` of them replaced by exact copies of row 0 (equal logits) and
    by copies scaled by 1 - k * 2^-24 (logits a few ulps apart), scattered over the indices."""
    g = torch.Generator().manual_seed(seed)
    codebook = torch.randn(n, d, generator=g)
    slots = torch.randperm(n, generator=g)[: min(near, n - 1)]
    for j, slot in enumerate(slots.tolist()):
        codebook[slot] = codebook[0] * (1.0 - (j % 4) * 2.0**-24)
    return codebook


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 700), d=st.integers(1, 8), h=st.integers(1, 11), w=st.integers(1, 13),
       chunk=st.integers(1, 80), near=st.integers(0, 40), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1.0, 30.0, 1e4]))
def test_chunked_equals_whole_on_random_and_tied_scores(n, d, h, w, chunk, near, seed, scale):
    codebook = tied_codebook(n, d, seed, near)
    g = torch.Generator().manual_seed(seed + 1)
    z = torch.randn(1, h, w, d, generator=g) * 0.1
    z[0, 0, 0] = codebook[0]  # a latent on the tied row: its column holds the ties
    z = (z * scale).permute(0, 3, 1, 2)  # the island's view: NCHW of channel-last latents
    whole = softmax_max_index(z, codebook)
    assert torch.equal(softmax_max_index_chunked(z, codebook, chunk), whole)


def test_softmax_rounding_ties_are_decided_like_the_original_not_by_the_logits():
    """Code 7's logit is 1.0, code 3's one ulp below: both round to one probability (with this
    codebook's other 62 codes), and the rule (first index of the maximal probability) gives 3,
    whole and chunked; the argmax of the logits, what a running max over codebook chunks
    finds, would give 7."""
    d, n = 4, 64
    codebook = torch.randn(n, d, generator=torch.Generator().manual_seed(2)) * 0.3
    codebook[7] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    codebook[3] = torch.tensor([1.0 - 2.0**-24, 0.0, 0.0, 0.0])
    z = torch.zeros(1, d, 1, 40)
    z[0, 0] = 1.0
    logits = torch.einsum("b d h w, n d -> b n h w", z, codebook)
    assert bool((logits[0, 3] < logits[0, 7]).all()) and bool((logits.argmax(1) == 7).all())
    whole = softmax_max_index(z, codebook)
    assert bool((whole == 3).all())
    for chunk in (1, 16, 17):
        assert torch.equal(softmax_max_index_chunked(z, codebook, chunk), whole)


def test_the_island_chunks_by_its_budget_and_keeps_the_indices():
    n, d = 4096, 16
    g = torch.Generator().manual_seed(3)
    whole = SoftmaxMaxVQ(n, d)
    small = SoftmaxMaxVQ(n, d, score_budget=32 * 8 * n)  # room for 32 positions per call
    small.embedding.copy_(torch.randn(n, d, generator=g))
    whole.embedding.copy_(small.embedding)
    z = torch.randn(2, 9, 14, d, generator=g)
    codes, indices = whole(z)
    assert positions_per_chunk(9 * 14, n, small.score_budget) == 32
    small_codes, small_indices = small(z)
    assert torch.equal(small_indices, indices) and torch.equal(small_codes, codes)


def test_positions_per_chunk_is_the_budget_in_whole_vectors():
    assert positions_per_chunk(4096, 131072) == 256           # 256 MiB of fp32 logits + probabilities
    assert positions_per_chunk(256, 262144) == 128            # IBQ 262,144 codes at 256 px: 2 runs
    assert positions_per_chunk(256, 16384) == 256             # fits: whole
    assert positions_per_chunk(4096, 131072, budget=1) == 16  # never below one vector
    with pytest.raises(ValueError, match="score_budget must be a positive number of bytes"):
        SoftmaxMaxVQ(8, 2, score_budget=0)
