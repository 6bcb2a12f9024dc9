"""SBER-MoVQGAN's spatially-normalised decoder, rebuilt op for op.

MoVQGAN (github.com/ai-forever/MoVQGAN, ``movqgan/modules/vqvae/movq_modules.py``) keeps
taming's encoder and changes only the decoder: every GroupNorm becomes a *spatial norm*
(``SpatialNorm``): the normalised features times ``conv_y(zq)`` plus ``conv_b(zq)``, where
``zq`` is the quantized codes (before ``post_quant_conv``) resized to the features' size by
nearest-neighbour interpolation. Everything else (residual blocks, single-head attention,
nearest x2 + conv upsampling, the level order) is taming's decoder, so this reuses vqserve's
rebuild of it (``llamagen.networks``) and only threads ``zq`` through.

Because the codes modulate every normalisation, a token's pixels depend on the codes of its
neighbourhood only through the convolutions (nearest interpolation of ``zq`` is local), as in
the original. The original's ``decode_code`` is fixed to one 32x32 grid of 4-dimensional
codes (batch 1, 256 px); here any batch and grid size decode, with the same operations.

Parameter names follow the original's state dict under vqserve's level names
(``conv_blocks.{i}.res.{j}.norm1.norm_layer.weight``, ``...norm1.conv_y.weight``), so the
taming name map (``vqserve.model.families.taming.layout``) applies unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vqserve.model.families.llamagen.networks import (
    LlamaGenAttention,
    LlamaGenResBlock,
    NearestThenConv,
    conv1x1,
    conv3x3,
    group_norm,
    swish,
)
from vqserve.model.precision import cast_to, module_dtype


class SpatialNorm(nn.Module):
    """``norm_layer(f) * conv_y(zq') + conv_b(zq')`` with ``zq'`` = ``zq`` resized (nearest) to ``f``."""

    def __init__(self, channels: int, zq_channels: int):
        super().__init__()
        self.norm_layer = group_norm(channels)
        self.conv_y = conv1x1(zq_channels, channels)
        self.conv_b = conv1x1(zq_channels, channels)

    def forward(self, f: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        zq = F.interpolate(zq, size=f.shape[-2:], mode="nearest")
        return self.norm_layer(f) * self.conv_y(zq) + self.conv_b(zq)


class MovqResBlock(LlamaGenResBlock):
    """taming's residual block with both norms spatial."""

    def __init__(self, c_in: int, c_out: int, zq_channels: int):
        super().__init__(c_in, c_out)
        self.norm1 = SpatialNorm(c_in, zq_channels)
        self.norm2 = SpatialNorm(c_out, zq_channels)

    def forward(self, x: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        h = self.conv1(swish(self.norm1(x, zq)))
        h = self.conv2(swish(self.norm2(h, zq)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class MovqAttention(LlamaGenAttention):
    """taming's attention block with a spatial norm."""

    def __init__(self, channels: int, zq_channels: int):
        super().__init__(channels)
        self.norm = SpatialNorm(channels, zq_channels)

    def forward(self, x: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        return self.attend(x, self.norm(x, zq))


class MovqLevel(nn.Module):
    """One decoder level: blocks (``res``), attention after each where the config puts it
    (``attn``), then ``upsample`` unless it is the full-resolution level."""

    def __init__(self, widths: list[tuple[int, int]], attention: bool, upsample: bool, zq_channels: int):
        super().__init__()
        self.res = nn.ModuleList(MovqResBlock(c_in, c_out, zq_channels) for c_in, c_out in widths)
        self.attn = nn.ModuleList(MovqAttention(c_out, zq_channels) for _, c_out in widths) if attention \
            else nn.ModuleList()
        self.upsample = NearestThenConv(widths[-1][1]) if upsample else None

    def forward(self, x: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.res):
            x = block(x, zq)
            if len(self.attn):
                x = self.attn[i](x, zq)
        return x if self.upsample is None else self.upsample(x)


class MovqDecoder(nn.Module):
    """quantized codes NCHW -> integer-valued float pixels NCHW in [0, 255] (MoVQGAN's rule)."""

    def __init__(self, base_channels: int, ch_mult: list[int], num_res_blocks: int, z_channels: int,
                 codebook_dim: int, attention_levels: frozenset[int]):
        super().__init__()
        widths = [base_channels * m for m in ch_mult]
        c_in = widths[-1]
        self.post_quant_conv = conv1x1(codebook_dim, z_channels)
        self.conv_in = conv3x3(z_channels, c_in)
        self.mid = nn.ModuleList([MovqResBlock(c_in, c_in, codebook_dim), MovqAttention(c_in, codebook_dim),
                                  MovqResBlock(c_in, c_in, codebook_dim)])
        levels = []
        for i in reversed(range(len(widths))):
            c_out = widths[i]
            blocks = [(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks + 1)]
            levels.append(MovqLevel(blocks, i in attention_levels, upsample=i != 0, zq_channels=codebook_dim))
            c_in = c_out
        self.conv_blocks = nn.ModuleList(levels)
        self.norm_out = SpatialNorm(c_in, codebook_dim)
        self.conv_out = conv3x3(c_in, 3)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        # contiguous NCHW, as MOVQ.decode_code rearranges its codes
        zq = cast_to(codes, module_dtype(self.post_quant_conv)).contiguous()
        h = self.conv_in(self.post_quant_conv(zq))
        for block in self.mid:
            h = block(h, zq)
        for level in self.conv_blocks:
            h = level(h, zq)
        return self.to_pixels(self.conv_out(swish(self.norm_out(h, zq))).to(torch.float32))

    @staticmethod
    def to_pixels(y: torch.Tensor) -> torch.Tensor:
        """MoVQGAN's own uint8 rule (its notebook's ``show_images``):
        ``round((y + 1) * 127.5)`` clamped to [0, 255], half to even as ``torch.round``."""
        return torch.round((y + 1.0) * 127.5).clamp(0.0, 255.0)
