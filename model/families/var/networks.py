"""The convolutional encoder and decoder of VAR's VQ-VAE (``vae_ch160v4096z32``), rebuilt.

VAR (github.com/FoundationVision/VAR, ``models/basic_vae.py``) takes the latent-diffusion
vq-f16 layout: per resolution level residual blocks (GroupNorm(32, eps 1e-6) -> SiLU ->
3x3 conv, twice, with a 1x1 ``nin_shortcut`` when the width changes), single-head
self-attention after each block of the lowest-resolution level (one ``qkv`` 1x1 conv), a
middle of block/attention/block, then GroupNorm -> SiLU -> 3x3 conv; a stride-2 3x3 conv
after padding one row and column at the bottom/right to go down, nearest x2 then a 3x3
conv to go up. The released VAE: ``ch=160``, ``ch_mult=(1, 1, 2, 2, 4)`` (factor 16),
two blocks per level, ``z_channels=32``; ``quant_conv``/``post_quant_conv`` are 3x3.

Every op is VAR's own (``F.silu``, the attention's ``reshape``/``unbind``/``bmm`` in its
layouts, the scale applied with ``mul_`` after the product), because a token flips when a
latent crosses a boundary by one ulp; the parameter names are VAR's state dict's, so an
import maps one to one. ``quant_conv`` lives in the encoder and ``post_quant_conv`` in the
decoder (vqserve's encoder ends at the quantizer's input). The encoder makes its input
contiguous NCHW (VAR's ToTensor gives that; a channels-last input rounds differently).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vqserve.model.families.cosmos.networks import Middle as CosmosMiddle
from vqserve.model.families.llamagen.networks import NearestThenConv, PadThenStrideConv
from vqserve.model.precision import cast_to, module_dtype

GROUPS = 32


def group_norm(channels: int) -> nn.GroupNorm:
    if channels % GROUPS:
        raise ValueError(f"VAR's GroupNorm needs channel counts divisible by {GROUPS}, got {channels}")
    return nn.GroupNorm(GROUPS, channels, eps=1e-6, affine=True)


def conv(c_in: int, c_out: int, k: int = 3, stride: int = 1, padding: int | None = None) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=k, stride=stride, padding=k // 2 if padding is None else padding)


class ResnetBlock(nn.Module):
    """``conv1(silu(norm1 x))``, ``conv2(silu(norm2 h))``, added to the (1x1-projected) input."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1 = group_norm(c_in)
        self.conv1 = conv(c_in, c_out)
        self.norm2 = group_norm(c_out)
        self.conv2 = conv(c_out, c_out)
        self.nin_shortcut = conv(c_in, c_out, k=1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.nin_shortcut(x) + h


class AttnBlock(nn.Module):
    """VAR's single-head attention over all positions, one ``qkv`` conv, op for op."""

    def __init__(self, channels: int):
        super().__init__()
        self.C = channels
        self.norm = group_norm(channels)
        self.qkv = conv(channels, 3 * channels, k=1)
        self.w_ratio = int(channels) ** (-0.5)
        self.proj_out = conv(channels, channels, k=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.norm(x))
        B, _, H, W = qkv.shape
        C = self.C
        q, k, v = qkv.reshape(B, 3, C, H, W).unbind(1)
        q = q.view(B, C, H * W).contiguous().permute(0, 2, 1).contiguous()
        k = k.view(B, C, H * W).contiguous()
        w = F.softmax(torch.bmm(q, k).mul_(self.w_ratio), dim=2)
        v = v.view(B, C, H * W).contiguous()
        w = w.permute(0, 2, 1).contiguous()
        h = torch.bmm(v, w).view(B, C, H, W).contiguous()
        return x + self.proj_out(h)


class Level(nn.Module):
    """One resolution level under VAR's names: ``block.J``, ``attn.J`` (lowest resolution
    only), and ``downsample`` / ``upsample`` where the level changes resolution."""

    def __init__(self, widths: list[tuple[int, int]], attention: bool):
        super().__init__()
        self.block = nn.ModuleList([ResnetBlock(a, b) for a, b in widths])
        self.attn = nn.ModuleList([AttnBlock(b) for _, b in widths] if attention else [])

    def blocks(self, h: torch.Tensor) -> torch.Tensor:
        for j, block in enumerate(self.block):
            h = block(h)
            if len(self.attn):
                h = self.attn[j](h)
        return h


class Middle(CosmosMiddle):
    """``block_1``, ``attn_1``, ``block_2`` (Cosmos's middle, under VAR's blocks)."""

    def __init__(self, channels: int):
        nn.Module.__init__(self)
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)


class VAREncoder(nn.Module):
    """float pixels NCHW in [-1, 1] -> ``quant_conv``'s latent NCHW (``z_channels``)."""

    residual_block_types = (ResnetBlock,)  # for vqserve.model.mixed_precision

    def __init__(self, ch: int, ch_mult: list[int], num_res_blocks: int, z_channels: int, quant_conv_ks: int = 3):
        super().__init__()
        self.conv_in = conv(3, ch)
        in_mult = (1, *ch_mult)
        last = len(ch_mult) - 1
        self.down = nn.ModuleList()
        block_in = ch
        for i, mult in enumerate(ch_mult):
            block_in, block_out = ch * in_mult[i], ch * mult
            level = Level([(block_in if j == 0 else block_out, block_out) for j in range(num_res_blocks)],
                          attention=i == last)
            block_in = block_out
            if i != last:
                level.downsample = PadThenStrideConv(block_in)  # VAR's Downsample2x, the same ops
            self.down.append(level)
        self.mid = Middle(block_in)
        self.norm_out = group_norm(block_in)
        self.conv_out = conv(block_in, z_channels)
        self.quant_conv = conv(z_channels, z_channels, k=quant_conv_ks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(cast_to(x.contiguous(), module_dtype(self.conv_in)))
        for level in self.down:
            h = level.blocks(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = self.mid(h)
        h = self.conv_out(F.silu(self.norm_out(h)))
        return self.quant_conv(h)


class VARDecoder(nn.Module):
    """``f_hat`` NCHW -> float pixels NCHW in [-1, 1] (VAR's ``fhat_to_img``, clamped)."""

    def __init__(self, ch: int, ch_mult: list[int], num_res_blocks: int, z_channels: int, quant_conv_ks: int = 3):
        super().__init__()
        self.post_quant_conv = conv(z_channels, z_channels, k=quant_conv_ks)
        block_in = ch * ch_mult[-1]
        self.conv_in = conv(z_channels, block_in)
        self.mid = Middle(block_in)
        levels: list[Level] = [None] * len(ch_mult)  # type: ignore[list-item]
        last = len(ch_mult) - 1
        for i in reversed(range(len(ch_mult))):
            block_out = ch * ch_mult[i]
            level = Level([(block_in if j == 0 else block_out, block_out) for j in range(num_res_blocks + 1)],
                          attention=i == last)
            block_in = block_out
            if i != 0:
                level.upsample = NearestThenConv(block_in)  # VAR's Upsample2x, the same ops
            levels[i] = level
        self.up = nn.ModuleList(levels)
        self.norm_out = group_norm(block_in)
        self.conv_out = conv(block_in, 3)

    def forward(self, f_hat: torch.Tensor) -> torch.Tensor:
        h = self.post_quant_conv(cast_to(f_hat, module_dtype(self.post_quant_conv)))
        h = self.mid(self.conv_in(h))
        for i in reversed(range(len(self.up))):
            level = self.up[i]
            h = level.blocks(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        h = self.conv_out(F.silu(self.norm_out(h)))
        return h.to(torch.float32).clamp_(-1, 1)
