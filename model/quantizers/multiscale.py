"""VAR's multi-scale residual VQ as one vqserve fp32 island: same indices, in any compute dtype.

VAR (FoundationVision/VAR, ``models/quant.py``, ``VectorQuantizer2.f_to_idxBl_or_fhat``)
tokenizes a latent ``f`` of ``C x H x W`` into a pyramid of token maps, coarse to fine::

    f_rest = f; f_hat = 0
    for each scale (ph, pw) of the schedule (the last one is H x W):
        z   = area-downsample(f_rest, (ph, pw))           (the last scale: f_rest itself)
        idx = argmin_k |z|^2 + |e_k|^2 - 2 z.e_k           (addmm, first minimum)
        h   = bicubic-upsample(e[idx], (H, W))             (the last scale: e[idx] itself)
        h   = Phi_k(h) = (1 - r) h + r conv3x3(h)          (one of K shared convolutions)
        f_hat += h; f_rest -= h

and decodes (``embed_to_fhat``) by summing the same upsampled, Phi-convolved code maps.
A token flipped at an early scale changes ``f_rest`` and so every later scale, so the whole
loop - downsampling, search, upsampling, the Phi convolutions and the running sums - is the
island here: fp32 with autocast off, whatever dtype the encoder and decoder run in.

Every op is VAR's own, in its order and memory layout (the code maps' ``permute`` then
``.contiguous()`` after the upsampling in encode; decode's ``transpose().view()`` maps,
not made contiguous), since a different layout can round a convolution differently. The
search runs over fixed chunks of rows (``first_argmin_in_chunks``), so a position's token
does not depend on the batch it came in; tests/integration/families/test_var.py checks
the indices against fixtures made by VAR's own code.

Which Phi serves scale ``si`` of ``SN``: the one whose tick is nearest ``si / (SN - 1)``
(``PhiPartiallyShared``: ticks ``linspace(1/3K, 1 - 1/3K, K)`` for K = 4, else
``linspace(1/2K, 1 - 1/2K, K)``; the first of equal distances).

Tokens are one flat sequence per image, ``torch.cat(img_to_idxBl(x), 1)``: ``[B, L]``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vqserve.core.token_layout import Schedule, schedule_length
from vqserve.model.precision import Fp32StateModule, fp32_island
from vqserve.model.quantizers.common import check_indices, to_fp32
from vqserve.model.quantizers.l2_nearest import first_argmin_in_chunks


def phi_ticks(count: int) -> np.ndarray:
    """VAR's ticks of ``count`` shared Phi convolutions on [0, 1], computed as VAR computes them
    (numpy's linspace in float64: scales 2/9 and 7/9 of ten lie exactly between two ticks in
    real arithmetic, so the rounding of these very numbers decides which Phi they use)."""
    if count == 4:
        return np.linspace(1 / 3 / count, 1 - 1 / 3 / count, count)
    return np.linspace(1 / 2 / count, 1 - 1 / 2 / count, count)


def phi_index(si: int, scales: int, count: int) -> int:
    """Which of ``count`` Phi convolutions scale ``si`` of ``scales`` uses (VAR's argmin)."""
    return int(np.argmin(np.abs(phi_ticks(count) - si / (scales - 1))))


class Phi(nn.Conv2d):
    """``(1 - r) h + r conv3x3(h)``, written as VAR writes it (``mul`` then ``mul_``)."""

    def __init__(self, dim: int, ratio: float):
        super().__init__(dim, dim, kernel_size=3, stride=1, padding=1)
        self.ratio = abs(float(ratio))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mul(1 - self.ratio) + super().forward(h).mul_(self.ratio)


class MultiScaleResidualVQ(Fp32StateModule):
    """``MultiScaleResidualVQ(codebook_size, dim, phi_count, quant_resi, using_znorm)``.

    ``encode(f NCHW, schedule) -> int64 [B, L]``; ``decode_fhat(indices [B, L], schedule)
    -> f_hat NCHW`` (fp32). ``embedding`` is VAR's codebook, ``phi`` its shared convolutions
    (``quantize.quant_resi.qresi_ls.K``). Inference only."""

    def __init__(self, codebook_size: int, dim: int, phi_count: int = 4, quant_resi: float = 0.5,
                 using_znorm: bool = False):
        super().__init__()
        if codebook_size < 2 or dim < 1 or phi_count < 1:
            raise ValueError(f"MultiScaleResidualVQ needs codebook_size >= 2, dim >= 1, phi_count >= 1, "
                             f"got {codebook_size}, {dim}, {phi_count}")
        self.codebook_size = int(codebook_size)
        self.dim = int(dim)
        self.using_znorm = bool(using_znorm)
        self.quant_resi = float(quant_resi)
        self.register_buffer("embedding", torch.zeros(self.codebook_size, self.dim))
        self.phi = nn.ModuleList([Phi(dim, quant_resi) for _ in range(phi_count)]) \
            if abs(quant_resi) > 1e-6 else nn.ModuleList()

    def extra_repr(self) -> str:
        return (f"codebook_size={self.codebook_size}, dim={self.dim}, phi={len(self.phi)}, "
                f"quant_resi={self.quant_resi}, using_znorm={self.using_znorm}")

    def _phi(self, h: torch.Tensor, si: int, scales: int) -> torch.Tensor:
        if not len(self.phi):  # quant_resi 0: VAR's nn.Identity
            return h
        return self.phi[phi_index(si, scales, len(self.phi))](h)

    @staticmethod
    def _argmin(z: torch.Tensor, code_sq: torch.Tensor, codebook_t: torch.Tensor) -> torch.Tensor:
        # VAR's own: d = sum(z^2) + sum(e^2); d.addmm_(z, e^T, alpha=-2, beta=1); argmin
        d = torch.sum(z.square(), dim=1, keepdim=True) + code_sq
        return torch.argmin(d.addmm_(z, codebook_t, alpha=-2, beta=1), dim=1)

    @staticmethod
    def _argmax_cos(z: torch.Tensor, codebook_n: torch.Tensor) -> torch.Tensor:
        return torch.argmax(F.normalize(z, dim=-1) @ codebook_n, dim=1)

    def _nearest(self, z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
        if self.using_znorm:
            return first_argmin_in_chunks(z, self.codebook_size, self._argmax_cos, F.normalize(codebook.T, dim=0))
        return first_argmin_in_chunks(z, self.codebook_size, self._argmin, torch.sum(codebook.square(), dim=1),
                                      codebook.T)

    def encode(self, f: torch.Tensor, schedule: Schedule) -> torch.Tensor:
        """Latent ``f`` NCHW (any float dtype) -> int64 tokens ``[B, L]``, coarse to fine."""
        return self.encode_with_fhat(f, schedule)[0]

    def encode_with_fhat(self, f: torch.Tensor, schedule: Schedule) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens ``[B, L]``, the reconstructed latent ``f_hat`` NCHW in fp32)."""
        B, C, H, W = f.shape
        if tuple(schedule[-1]) != (H, W):
            raise ValueError(f"the scales end at {schedule[-1][0]}x{schedule[-1][1]}, the latent is {H}x{W}")
        with fp32_island(f.device.type):
            codebook = to_fp32(self.embedding)
            f_rest = to_fp32(f).detach().clone()
            f_hat = torch.zeros_like(f_rest)
            tokens = []
            last = len(schedule) - 1
            for si, (ph, pw) in enumerate(schedule):
                z = f_rest if si == last else F.interpolate(f_rest, size=(ph, pw), mode="area")
                idx = self._nearest(z.permute(0, 2, 3, 1).reshape(-1, C), codebook)
                code_map = F.embedding(idx.view(B, ph, pw), codebook).permute(0, 3, 1, 2)
                h = code_map.contiguous() if si == last else \
                    F.interpolate(code_map, size=(H, W), mode="bicubic").contiguous()
                h = self._phi(h, si, len(schedule))
                f_hat.add_(h)
                f_rest.sub_(h)
                tokens.append(idx.reshape(B, ph * pw))
        return torch.cat(tokens, 1), f_hat

    def decode_fhat(self, tokens: torch.Tensor, schedule: Schedule) -> torch.Tensor:
        """int tokens ``[B, L]`` -> ``f_hat`` NCHW in fp32 (VAR's ``embed_to_fhat``, all to the last scale)."""
        if tokens.shape[1] != schedule_length(schedule):
            raise ValueError(f"tokens have length {tokens.shape[1]}, the scales need {schedule_length(schedule)}")
        B = tokens.shape[0]
        H, W = schedule[-1]
        with fp32_island(tokens.device.type):
            codebook = to_fp32(self.embedding)
            f_hat = torch.zeros(B, self.dim, H, W, dtype=torch.float32, device=tokens.device)
            at, last = 0, len(schedule) - 1
            for si, (ph, pw) in enumerate(schedule):
                idx = tokens[:, at:at + ph * pw].to(torch.int64)
                at += ph * pw
                h = F.embedding(idx, codebook).transpose(1, 2).view(B, self.dim, ph, pw)
                if si < last:
                    h = F.interpolate(h, size=(H, W), mode="bicubic")
                f_hat.add_(self._phi(h, si, len(schedule)))
        return f_hat

    def forward(self, z: torch.Tensor, return_aux: bool = False):
        raise NotImplementedError("MultiScaleResidualVQ has no single-scale forward: use encode(f, schedule)")

    def check_indices(self, indices: torch.Tensor) -> None:
        check_indices(indices, self.codebook_size, "MultiScaleResidualVQ")
