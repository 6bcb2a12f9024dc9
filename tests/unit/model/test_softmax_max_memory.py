"""IBQ's index rule (max of softmax(z . codebook), the lowest index among equal probabilities):
ties that softmax rounds to one probability are decided as the original decides them, and the
memory plan (the probabilities written over the logits) gives the same bits as the
functional softmax while holding one score tensor instead of two."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from vqserve.model.quantizers.softmax_max import SoftmaxMaxVQ, softmax_max_index

pytestmark = pytest.mark.usefixtures("one_thread")


def functional_rule(z_nchw: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """The original's three operations as it writes them (two score tensors)."""
    logits = torch.einsum("b d h w, n d -> b n h w", z_nchw, codebook)
    return F.softmax(logits, dim=1).max(dim=1)[1]


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
    assert bool((softmax_max_index(z, codebook) == 3).all())
    assert torch.equal(softmax_max_index(z, codebook), functional_rule(z, codebook))


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 37), dim=st.sampled_from([2, 4, 8, 32]),
       codes=st.integers(2, 3000), scale=st.sampled_from([0.01, 1.0, 30.0]),
       near_ties=st.integers(0, 8), seed=st.integers(0, 2**31 - 1))
def test_scoring_in_place_gives_the_functional_softmax_bits(h, w, dim, codes, scale, near_ties, seed):
    """Any image shape (positions that fill whole vectors and ones that leave a tail), any
    codebook size, near-equal codes that softmax may round together: the in-place softmax picks
    what the functional one picks, and its probabilities are the same bits."""
    g = torch.Generator().manual_seed(seed)
    codebook = torch.randn(codes, dim, generator=g) * scale
    for k in range(min(near_ties, codes - 1)):  # codes an ulp or two from code 0
        codebook[k + 1] = torch.nextafter(codebook[0], codebook[0] + (k + 1) * (-1) ** k)
    z = torch.randn(1, dim, h, w, generator=g)
    z[..., : w // 2] = codebook[0].view(1, dim, 1, 1)  # some positions exactly on code 0
    assert torch.equal(softmax_max_index(z, codebook), functional_rule(z, codebook))
    logits = torch.einsum("b d h w, n d -> b n h w", z, codebook)
    expected = F.softmax(logits, dim=1)
    logits = logits.contiguous()
    assert torch.equal(torch.ops.aten._softmax.out(logits, 1, False, out=logits), expected)


def test_the_island_scores_every_image_of_a_batch_whole_and_alone():
    """A batch gives each image's own whole-image indices (the island never splits an image)."""
    q = SoftmaxMaxVQ(500, 8)
    q.embedding.normal_(generator=torch.Generator().manual_seed(3))
    z = torch.randn(3, 5, 7, 8, generator=torch.Generator().manual_seed(4))
    together = q(z)[1]
    for i in range(3):
        assert torch.equal(together[i], functional_rule(z[i:i + 1].permute(0, 3, 1, 2), q.embedding)[0])


PEAK_PROBE = """
import json, torch
import torch.nn.functional as F
from vqserve.model.quantizers.softmax_max import softmax_max_index
torch.set_num_threads(1)

def peak_added_kib(call):
    with open("/proc/self/clear_refs", "w") as f:  # 5: reset the peak resident size (VmHWM)
        f.write("5")
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    before = int(status["VmRSS"].split()[0])
    call()
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmHWM"].split()[0]) - before

z = torch.randn(1, 8, 8, 8)
codebook = torch.randn(262144, 8)
softmax_max_index(torch.randn(1, 8, 2, 2), codebook[:16])  # warm the kernels
functional = lambda: F.softmax(torch.einsum("b d h w, n d -> b n h w", z, codebook), dim=1).argmax(1)
functional()
print(json.dumps({"island": peak_added_kib(lambda: softmax_max_index(z, codebook)),
                  "functional": peak_added_kib(functional)}))
"""


def test_one_image_holds_one_score_tensor_not_two():
    """64 positions x 262,144 codes are 64 MiB of fp32 scores: the island's call raises the
    process's peak resident memory by about that, the functional softmax (logits plus
    probabilities) by about twice that (each measured from a reset peak, in a fresh process)."""
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE], capture_output=True, text=True, check=True)
    added = {k: v / 1024 for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    assert 56 < added["island"] < 100, added
    assert added["functional"] - added["island"] > 56, added


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check runs it)")
def test_scoring_in_place_gives_the_functional_softmax_bits_on_cuda():
    """The CUDA softmax kernel written over its input: the same indices as the functional rule."""
    g = torch.Generator().manual_seed(5)
    for h, w, codes in [(1, 1, 7), (16, 16, 131072), (5, 37, 3000), (3, 1, 50)]:
        codebook = torch.randn(codes, 16, generator=g).cuda()
        z = torch.randn(1, 16, h, w, generator=g).cuda()
        assert torch.equal(softmax_max_index(z, codebook), functional_rule(z, codebook))
