"""IBQ's index rule (max of softmax(z . codebook), the lowest index among equal probabilities):
ties that softmax rounds to one probability are decided as the original decides them; the
island scores every image whole by default (runs of positions are not the same bits), and
the measurement-only budget arithmetic."""

from __future__ import annotations

import pytest
import torch

from vqserve.model.quantizers.softmax_max import (
    SoftmaxMaxVQ,
    positions_per_chunk,
    softmax_max_index,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_island_scores_each_image_whole_by_default():
    """Runs of positions are not the same bits (hypothesis found a position whose index
    differs between a run of 32 positions and a whole 35-position image, module docstring):
    by default the island never chunks, however large the scores."""
    assert SoftmaxMaxVQ(262144, 4).score_budget is None


def test_softmax_rounding_ties_are_decided_like_the_original_not_by_the_logits():
    """Code 7's logit is 1.0, code 3's one ulp below: both round to one probability (with this
    codebook's other 62 codes), and the rule (first index of the maximal probability) gives 3,
    as the original decides it; the argmax of the logits, what a running max over codebook chunks
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


def test_positions_per_chunk_is_the_budget_in_whole_vectors():
    assert positions_per_chunk(4096, 131072) == 256           # 256 MiB of fp32 logits + probabilities
    assert positions_per_chunk(256, 262144) == 128            # IBQ 262,144 codes at 256 px: 2 runs
    assert positions_per_chunk(256, 16384) == 256             # fits: whole
    assert positions_per_chunk(4096, 131072, budget=1) == 16  # never below one vector
    with pytest.raises(ValueError, match="score_budget must be a positive number of bytes"):
        SoftmaxMaxVQ(8, 2, score_budget=0)
