"""Vector quantization with an EMA codebook, k-means init and dead-code replacement.

The codebook is a buffer updated by exponential moving averages (no codebook gradients),
so the only trained path is the encoder's commitment to its nearest code. Distances,
argmin and EMA statistics are fp32; a bf16 distance matrix would tie many codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import (
    check_indices,
    check_last_dim,
    straight_through,
    to_fp32,
)


def kmeans(samples: torch.Tensor, num_clusters: int, iters: int = 10,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Lloyd's k-means in fp32 with k-means++ seeding (D^2 sampling avoids merged centres)."""
    n = samples.shape[0]
    first = torch.randint(0, n, (1,), generator=generator, device=samples.device)
    centers = [samples[first]]
    nearest = torch.cdist(samples, centers[0]).squeeze(1).pow(2)
    for _ in range(1, num_clusters):
        weights = nearest if float(nearest.sum()) > 0 else torch.ones_like(nearest)
        pick = torch.multinomial(weights, 1, generator=generator)
        centers.append(samples[pick])
        nearest = torch.minimum(nearest, torch.cdist(samples, centers[-1]).squeeze(1).pow(2))
    centers = torch.cat(centers).clone()
    for _ in range(iters):
        assign = torch.cdist(samples, centers).argmin(dim=-1)
        sums = torch.zeros_like(centers).index_add_(0, assign, samples)
        counts = torch.bincount(assign, minlength=num_clusters).to(samples.dtype)
        filled = counts > 0
        centers[filled] = sums[filled] / counts[filled].unsqueeze(-1)
    return centers


class VQ(Fp32StateModule):
    """``VQ(codebook_size, dim)``: nearest-code quantization of ``z[..., dim]``.

    Training (``.train()``) updates the codebook by EMA, initialises it by k-means on the
    first batch, and replaces codes whose EMA usage falls below ``dead_code_threshold``
    with random vectors from the current batch.
    """

    def __init__(
        self,
        codebook_size: int,
        dim: int,
        decay: float = 0.99,
        eps: float = 1e-5,
        commitment_weight: float = 0.25,
        kmeans_init: bool = True,
        kmeans_iters: int = 10,
        dead_code_threshold: float = 1.0,
    ):
        super().__init__()
        if codebook_size < 2 or dim < 1:
            raise ValueError(f"VQ needs codebook_size >= 2 and dim >= 1, got {codebook_size}, {dim}")
        self.codebook_size = codebook_size
        self.dim = dim
        self.decay = decay
        self.eps = eps
        self.commitment_weight = commitment_weight
        self.kmeans_iters = kmeans_iters
        self.dead_code_threshold = dead_code_threshold
        embed = torch.randn(codebook_size, dim) * (1.0 / dim**0.5)
        self.register_buffer("embed", embed)
        self.register_buffer("embed_avg", embed.clone())
        self.register_buffer("cluster_size", torch.ones(codebook_size))
        self.register_buffer("initted", torch.tensor(not kmeans_init))

    def extra_repr(self) -> str:
        return f"codebook_size={self.codebook_size}, dim={self.dim}"

    def _nearest(self, flat: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        dist = (
            flat.pow(2).sum(dim=-1, keepdim=True)
            - 2 * flat @ embed.t()
            + embed.pow(2).sum(dim=-1).unsqueeze(0)
        )
        return dist.argmin(dim=-1)

    def forward(self, z: torch.Tensor, return_aux: bool = False):
        check_last_dim(z, self.dim, "VQ")
        orig_dtype = z.dtype
        aux: dict[str, torch.Tensor] = {}
        with fp32_island(z.device.type):
            z32 = to_fp32(z)
            flat = z32.reshape(-1, self.dim)
            if self.training:
                self._maybe_init(flat.detach())
            embed = to_fp32(self.embed)
            indices = self._nearest(flat.detach(), embed)
            quantized = F.embedding(indices, embed).view_as(z32)
            if self.training:
                self._ema_update(flat.detach(), indices)
                if return_aux and self.commitment_weight > 0:
                    aux["commitment"] = self.commitment_weight * F.mse_loss(z32, quantized.detach())
            codes = straight_through(z32, quantized) if self.training else quantized
        indices = indices.view(z.shape[:-1])
        codes = codes.to(orig_dtype)
        if return_aux:
            return codes, indices, aux
        return codes, indices

    @torch.no_grad()
    def _maybe_init(self, flat: torch.Tensor) -> None:
        if bool(self.initted):
            return
        centers = kmeans(flat, self.codebook_size, self.kmeans_iters)
        self.embed.copy_(centers)
        self.embed_avg.copy_(centers)
        self.cluster_size.fill_(1.0)
        self.initted.fill_(True)

    @torch.no_grad()
    def _ema_update(self, flat: torch.Tensor, indices: torch.Tensor) -> None:
        onehot_counts = torch.bincount(indices, minlength=self.codebook_size).to(torch.float32)
        sums = torch.zeros(self.codebook_size, self.dim, device=flat.device).index_add_(0, indices, flat)
        self.cluster_size.mul_(self.decay).add_(onehot_counts, alpha=1 - self.decay)
        self.embed_avg.mul_(self.decay).add_(sums, alpha=1 - self.decay)
        n = self.cluster_size.sum()
        smoothed = (self.cluster_size + self.eps) / (n + self.codebook_size * self.eps) * n
        self.embed.copy_(self.embed_avg / smoothed.unsqueeze(-1))
        self._replace_dead_codes(flat)

    @torch.no_grad()
    def _replace_dead_codes(self, flat: torch.Tensor) -> None:
        dead = self.cluster_size < self.dead_code_threshold
        num_dead = int(dead.sum())
        if num_dead == 0 or flat.shape[0] == 0:
            return
        pick = torch.randint(0, flat.shape[0], (num_dead,), device=flat.device)
        self.embed[dead] = flat[pick]
        self.embed_avg[dead] = flat[pick] * self.dead_code_threshold
        self.cluster_size[dead] = self.dead_code_threshold

    def indices_to_codes(self, indices: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return F.embedding(indices.to(torch.int64), to_fp32(self.embed)).to(dtype)

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "VQ")
