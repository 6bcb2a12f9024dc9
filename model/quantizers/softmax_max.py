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

The memory plan (not in use). Done whole, an image costs ``positions x codebook_size``
logits and as many probabilities (256 positions x 262,144 codes = 2 x 268 MB in fp32; a
1-megapixel image at factor 16 with Emu3.5's 131,072 codes, 4,096 x 131,072 = 2 x 2.1 GB),
bounded only by the server's pixel budget. Scoring runs of positions
(``softmax_max_index_chunked``) bounds that memory but is NOT the same bits: the dot
products' kernels block their loops by the number of positions, and hypothesis found a
position whose index differs between a run of 32 positions and the whole 35-position image
(one ulp between two tied codes). So the island always scores an image whole, as the
original does; the chunked function stays for measurement only (``score_budget`` set by
hand), never by default. Chunking the *codebook* axis with a running max is not this rule
either: two codes whose logits differ by less than ~2^-22 can round to the same probability,
and then the lower index wins even when its logit is smaller. Traced and exported graphs compute the whole batch in one
product, unchunked (a traced loop would be unrolled to the example's size). Codes are the codebook rows, as the original's ``get_codebook_entry``
returns them. A naive bf16 model runs this search in bf16, where the softmax of 262,144
codes ties massively and the lowest index wins (docs/MODELS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import check_indices, check_last_dim, to_fp32
from vqserve.model.quantizers.l2_nearest import in_graph_capture

SCORE_BUDGET = 256 * 2**20  # bytes of fp32 logits + probabilities, for a hand-set score_budget (measurement)
CHUNK_ALIGN = 16  # chunks are whole multiples of this many positions (one AVX-512 vector of fp32)


def positions_per_chunk(positions: int, codebook_size: int, budget: int = SCORE_BUDGET) -> int:
    """How many positions one call scores: all of them when their logits and probabilities
    (``2 x 4 x codebook_size`` bytes each) fit ``budget``, else the most that fit, rounded
    down to a multiple of ``CHUNK_ALIGN`` (at least ``CHUNK_ALIGN``)."""
    fit = budget // (8 * codebook_size)
    if fit >= positions:
        return positions
    return max(CHUNK_ALIGN, fit // CHUNK_ALIGN * CHUNK_ALIGN)


def softmax_max_index_chunked(z_nchw: torch.Tensor, codebook: torch.Tensor, chunk: int) -> torch.Tensor:
    """``softmax_max_index`` over runs of ``chunk`` positions (row-major), every code in each
    call: the same indices (module docstring), ``chunk x codebook_size`` scores at a time."""
    b, d, h, w = z_nchw.shape
    positions = h * w
    flat = z_nchw.reshape(b, d, 1, positions)
    runs = -(-positions // chunk)
    if runs * chunk > positions:  # the last run padded to a whole one: every call has one shape, so
        # no run is scored by another kernel (a single column goes to a matrix-vector product,
        # whose last bits differ: hypothesis found it)
        flat = F.pad(flat, (0, runs * chunk - positions, 0, 0), mode="replicate")
    parts = [softmax_max_index(flat[..., start:start + chunk].contiguous(), codebook)
             for start in range(0, runs * chunk, chunk)]
    return torch.cat(parts, dim=-1)[..., :positions].reshape(b, h, w)


def softmax_max_index(z_nchw: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """IBQ's rule on ``z [B, d, H, W]`` and ``codebook [n, d]`` in their dtype: int64 [B, H, W].

    ``argmax`` returns what the original's ``max(dim)[1]`` does (the first of equal maxima;
    the tie fixtures check it) and exports as ArgMax, the op the island proof looks for."""
    logits = torch.einsum("b d h w, n d -> b n h w", z_nchw, codebook)
    return F.softmax(logits, dim=1).argmax(dim=1)


class SoftmaxMaxVQ(Fp32StateModule):
    """``SoftmaxMaxVQ(codebook_size, dim)``: IBQ's code for ``z[..., dim]`` (channel-last).

    ``embedding`` holds the codebook as the checkpoint stores it. ``score_budget``: the bytes
    of scores one call may hold before the image is scored in runs of positions: None (the
    default) scores every image whole, the exact rule; a number is for measurement only (not
    the same bits; module docstring). Inference only."""

    def __init__(self, codebook_size: int, dim: int, score_budget: int | None = None):
        super().__init__()
        if codebook_size < 2 or dim < 1:
            raise ValueError(f"SoftmaxMaxVQ needs codebook_size >= 2 and dim >= 1, got {codebook_size}, {dim}")
        self.codebook_size = int(codebook_size)
        self.dim = int(dim)
        if score_budget is not None and score_budget < 1:
            raise ValueError(f"SoftmaxMaxVQ score_budget must be a positive number of bytes, got {score_budget}")
        self.score_budget = None if score_budget is None else int(score_budget)  # None: whole, exact
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
            elif self.score_budget is None:  # the default: each image whole, exact
                indices = torch.cat([softmax_max_index(one, codebook) for one in z_nchw.split(1)])
            else:  # measurement only: runs of positions are not the same bits (module docstring)
                positions = z_nchw.shape[2] * z_nchw.shape[3]
                chunk = positions_per_chunk(positions, self.codebook_size, self.score_budget)
                if chunk >= positions:
                    indices = torch.cat([softmax_max_index(one, codebook) for one in z_nchw.split(1)])
                else:
                    indices = torch.cat([softmax_max_index_chunked(one, codebook, chunk) for one in z_nchw.split(1)])
            codes = F.embedding(indices, codebook)
        codes = codes.to(z.dtype)
        return (codes, indices, {}) if return_aux else (codes, indices)

    def indices_to_codes(self, indices: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """integer indices -> codebook rows, channel-last, in ``dtype``."""
        return F.embedding(indices.to(torch.int64), to_fp32(self.embedding)).to(dtype)

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "SoftmaxMaxVQ")
