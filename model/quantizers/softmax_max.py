"""IBQ's index rule as a vqserve fp32 island: the same indices as the original, in any compute dtype.

IBQ (Index Backpropagation Quantization, TencentARC SEED-Voken,
``src/IBQ/modules/vqvae/quantize.py``, ``IndexPropagationQuantize``) does not search for the
nearest code. It scores every code by its dot product with the latent,
``logits = einsum('b d h w, n d -> b n h w', z, codebook)``, takes ``softmax`` over the codes
and picks ``max`` of the probabilities (the first index among equal ones). That is the
argmax of the logits, except where the softmax rounds two near-equal logits to the same
probability: then the lower index wins. To give the original's index there too, this
module runs the very same three operations on the same tensor shapes (NCHW, one image per
call), in fp32 with autocast off, whatever dtype the networks run in. The shapes matter:
PyTorch's softmax over a strided dimension sums in an order that depends on the number of
positions, so splitting an image into row chunks changes probabilities in their last bit;
splitting a batch into images does not (both checked, tests/integration/families/test_ibq.py).

The memory plan: one score tensor, scored in place. Done as the original writes it, an image
costs ``positions x codebook_size`` fp32 logits *and* as many probabilities (a 1-megapixel
image at factor 16 with Emu3.5's 131,072 codes: 4,096 x 131,072 = 2 x 2.1 GB). Here the
softmax writes its probabilities over the logits (``aten._softmax.out`` with the logits as
its output): the same kernel on the same tensor, so the same bits (hypothesis checks it
against ``F.softmax``), in half the memory. Splitting the work further is NOT the same bits,
and the island never does it: runs of positions change the kernels' blocking (hypothesis
found a position whose index differs between a run of 32 positions and the whole
35-position image, one ulp between two codes), and a running max over codebook chunks finds
the argmax of the logits, while IBQ's rule decides two codes that round to one probability
by the lower index, and whether they round together depends on the sum over every code.
What remains is bounded by the server's pixel budget (``--max-pixels``). Traced and exported
graphs compute the whole batch in one product with the functional softmax (a traced loop
would be unrolled to the example's size). Codes are the codebook rows, as the original's
``get_codebook_entry`` returns them. A naive bf16 model runs this search in bf16, where the softmax of 262,144
codes ties massively and the lowest index wins (docs/MODELS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import check_indices, check_last_dim, to_fp32
from vqserve.model.quantizers.l2_nearest import in_graph_capture


def softmax_max_index(z_nchw: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """IBQ's rule on ``z [B, d, H, W]`` and ``codebook [n, d]`` in their dtype: int64 [B, H, W].

    ``argmax`` returns what the original's ``max(dim)[1]`` does (the first of equal maxima;
    the tie fixtures check it) and exports as ArgMax, the op the island proof looks for."""
    logits = torch.einsum("b d h w, n d -> b n h w", z_nchw, codebook)
    if in_graph_capture():  # an exported graph says softmax (the island proof looks for its ops)
        return F.softmax(logits, dim=1).argmax(dim=1)
    # eager: the probabilities overwrite the logits, the same kernel F.softmax runs (module
    # docstring). The kernel works on a contiguous tensor (F.softmax makes one too); einsum
    # returns some shapes (one column) in another layout, and writing over those would be wrong.
    logits = logits.contiguous()
    return torch.ops.aten._softmax.out(logits, 1, False, out=logits).argmax(dim=1)


class SoftmaxMaxVQ(Fp32StateModule):
    """``SoftmaxMaxVQ(codebook_size, dim)``: IBQ's code for ``z[..., dim]`` (channel-last).

    ``embedding`` holds the codebook as the checkpoint stores it. Every image is scored whole,
    one score tensor at a time (the memory plan in the module docstring). Inference only."""

    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        if codebook_size < 2 or dim < 1:
            raise ValueError(f"SoftmaxMaxVQ needs codebook_size >= 2 and dim >= 1, got {codebook_size}, {dim}")
        self.codebook_size = int(codebook_size)
        self.dim = int(dim)
        self.register_buffer("embedding", torch.zeros(self.codebook_size, self.dim))

    def extra_repr(self) -> str:
        return f"codebook_size={self.codebook_size}, dim={self.dim}, rule=max(softmax(z.e))"

    def forward(self, z: torch.Tensor, return_aux: bool = False):
        """channel-last ``z[B, H, W, dim]`` -> (codes in z's dtype, int64 indices [B, H, W][, {}])."""
        check_last_dim(z, self.dim, "SoftmaxMaxVQ")
        if z.ndim != 4:
            raise ValueError(f"SoftmaxMaxVQ expects z[B, H, W, {self.dim}], got shape {tuple(z.shape)}")
        with fp32_island(z.device.type):
            codebook = to_fp32(self.embedding)
            # back to the original's NCHW view (a permuted view of NCHW latents is their own layout)
            z_nchw = to_fp32(z).permute(0, 3, 1, 2)
            if in_graph_capture():
                indices = softmax_max_index(z_nchw, codebook)
            else:  # one image at a time: one image's scores held at once, each scored whole
                indices = torch.cat([softmax_max_index(one, codebook) for one in z_nchw.split(1)])
            codes = F.embedding(indices, codebook)
        codes = codes.to(z.dtype)
        return (codes, indices, {}) if return_aux else (codes, indices)

    def indices_to_codes(self, indices: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """integer indices -> codebook rows, channel-last, in ``dtype``."""
        return F.embedding(indices.to(torch.int64), to_fp32(self.embedding)).to(dtype)

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "SoftmaxMaxVQ")
