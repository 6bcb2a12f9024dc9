"""Convolutional encoder/decoder: residual blocks, GroupNorm (or per-pixel norm), SiLU, optional attention.

Every block casts its input to its own parameter dtype at the door (failure 5 in
docs/DESIGN.md): a model cast wholesale to fp16 still meets fp32 tensors from outside.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vqserve.model.precision import cast_to


class GroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` that casts a low-precision input of the other kind to its own dtype.

    PyTorch's CPU kernel accepts a mixed input only with fp32 parameters. Under autocast a
    convolution's output takes the autocast dtype, so a model cast to fp16 and run under
    bf16 autocast (or the reverse) handed fp16 parameters a bf16 input and raised "mixed
    dtype (CPU): expect parameter to have scalar type of Float" (failure 5 in
    docs/DESIGN.md). fp32 parameters keep the kernel's own mixed path, so fp32 and
    autocast-on-fp32 numerics are unchanged. Same parameters and state-dict keys.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and self.weight.dtype != torch.float32:
            x = cast_to(x, self.weight.dtype)
        return super().forward(x)


class PixelNorm(GroupNorm):
    """Normalises each position over its channels (a LayerNorm per pixel), with a learnt
    per-channel scale and shift: **the same output for a pixel whatever the image size**.

    GroupNorm's mean and variance are taken over the whole image, so a network trained on
    64-pixel crops sees other statistics on a whole photograph, and the same pixels decode
    differently as 64-pixel tiles and as a whole photo (issue 17: 29.8 vs 26.1 dB on one
    photograph). Per-position statistics remove that dependence. It subclasses GroupNorm
    (one group, same ``weight``/``bias`` keys) so every precision policy that keeps norms in
    fp32 (``vqserve.model.mixed_precision``) treats it as the norm it is.
    """

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__(1, channels, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # LayerNorm over the channels of a channels-last view: the stock kernel reads each
        # pixel's channels contiguously, measured ~25x faster on CPU than reducing over dim 1
        # of an NCHW tensor. The result keeps channels-last strides; convolutions take either.
        dtype = x.dtype
        h = F.layer_norm(cast_to(x, self.weight.dtype).permute(0, 2, 3, 1), (self.num_channels,),
                         self.weight, self.bias, self.eps)
        return cast_to(h.permute(0, 3, 1, 2), dtype)


NORMS = ("group", "pixel")


def _norm(channels: int, kind: str = "group") -> GroupNorm:
    if kind == "pixel":
        return PixelNorm(channels, eps=1e-6)
    # at least two channels per group, so even a 1x1 latent has >1 value to normalise
    return GroupNorm(math.gcd(32, max(1, channels // 2)), channels, eps=1e-6)


class ResBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, norm: str = "group"):
        super().__init__()
        self.norm1 = _norm(in_ch, norm)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.norm2 = _norm(out_ch, norm)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class AttentionBlock(nn.Module):
    """Self-attention over spatial positions with ``nn.TransformerEncoderLayer``.

    Built on the stock layer on purpose: its eval-mode fast path is where failure 3
    (bf16 autocast, eval only) lived, so our tests exercise exactly that path.
    """

    def __init__(self, channels: int, heads: int):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d_model=channels, nhead=heads, dim_feedforward=2 * channels, dropout=0.0,
            activation="gelu", batch_first=True, norm_first=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        seq = x.flatten(2).transpose(1, 2)
        own = self.layer.linear1.weight.dtype
        if own != torch.float32 and _autocast_to_other(x.device.type, own):
            # fp16 weights under bf16 autocast (or the reverse): its linears would hand
            # LayerNorm an input of the other low-precision kind, which the CPU kernel
            # refuses. The block runs in its own dtype, cast explicitly at the door.
            with torch.autocast(x.device.type, enabled=False):
                seq = self.layer(cast_to(seq, own))
        else:
            seq = self.layer(seq)
        return seq.transpose(1, 2).reshape(b, c, h, w)


def _autocast_to_other(device_type: str, own: torch.dtype) -> bool:
    """Whether autocast is on for ``device_type`` with a dtype other than ``own``."""
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != own


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _mid(channels: int, attention: bool, heads: int, norm: str = "group") -> nn.Sequential:
    layers: list[nn.Module] = [ResBlock(channels, channels, norm)]
    if attention:
        layers += [AttentionBlock(channels, heads), ResBlock(channels, channels, norm)]
    return nn.Sequential(*layers)


class _DtypeDoor(nn.Module):
    """Casts the input to this network's parameter dtype, explicitly, before anything runs."""

    def _door(self, x: torch.Tensor) -> torch.Tensor:
        return cast_to(x, self.conv_in.weight.dtype)


class Encoder(_DtypeDoor):
    """Pixels ``[B,3,H,W]`` in [-1,1] -> latents ``[B,latent_dim,H/f,W/f]``.

    ``patch_size`` p > 1 folds each p x p pixel block into channels first (pixel unshuffle),
    so no convolution runs at full resolution: on a CPU budget that buys far more width
    where it matters (the low-resolution stages) for the same time per step.
    """

    def __init__(self, channels: list[int], num_res_blocks: int, latent_dim: int,
                 attention: bool = False, heads: int = 4, patch_size: int = 1, norm: str = "group"):
        super().__init__()
        self.patch_size = patch_size
        self.conv_in = nn.Conv2d(3 * patch_size * patch_size, channels[0], 3, padding=1)
        blocks: list[nn.Module] = []
        prev = channels[0]
        for ch in channels:
            for _ in range(num_res_blocks):
                blocks.append(ResBlock(prev, ch, norm))
                prev = ch
            blocks.append(Downsample(ch))
        self.down = nn.Sequential(*blocks)
        self.mid = _mid(prev, attention, heads, norm)
        self.norm_out = _norm(prev, norm)
        self.conv_out = nn.Conv2d(prev, latent_dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._door(x)
        if self.patch_size > 1:
            x = F.pixel_unshuffle(x, self.patch_size)
        h = self.mid(self.down(self.conv_in(x)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(_DtypeDoor):
    """Codes ``[B,latent_dim,h,w]`` -> pixels ``[B,3,h*f,w*f]`` (unclamped, ~[-1,1]).

    With ``patch_size`` p > 1 the last convolution predicts each p x p pixel block as
    channels and a pixel shuffle lays them out (the mirror of the encoder's stem).
    """

    def __init__(self, channels: list[int], num_res_blocks: int, latent_dim: int,
                 attention: bool = False, heads: int = 4, patch_size: int = 1, norm: str = "group"):
        super().__init__()
        self.patch_size = patch_size
        top = channels[-1]
        self.conv_in = nn.Conv2d(latent_dim, top, 3, padding=1)
        self.mid = _mid(top, attention, heads, norm)
        blocks: list[nn.Module] = []
        prev = top
        for ch in reversed(channels):
            for _ in range(num_res_blocks):
                blocks.append(ResBlock(prev, ch, norm))
                prev = ch
            blocks.append(Upsample(ch))
        self.up = nn.Sequential(*blocks)
        self.norm_out = _norm(prev, norm)
        self.conv_out = nn.Conv2d(prev, 3 * patch_size * patch_size, 3, padding=1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(self._door(codes))
        h = self.up(self.mid(h))
        out = self.conv_out(F.silu(self.norm_out(h)))
        return F.pixel_shuffle(out, self.patch_size) if self.patch_size > 1 else out
