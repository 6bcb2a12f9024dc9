"""The encoder and decoder of Open-MAGVIT2's image tokenizers, rebuilt op for op.

Open-MAGVIT2 (TencentARC, github.com/TencentARC/SEED-Voken,
``src/Open_MAGVIT2/modules/diffusionmodules/improved_model.py``) is MAGVIT-v2's
convolutional tokenizer: no attention anywhere. The encoder is a bias-free 3x3 stem, per
resolution level ``num_res_blocks`` residual blocks (GroupNorm(32, eps 1e-6) -> swish ->
bias-free 3x3 conv, twice, plus a bias-free 1x1 skip when the width changes) and a stride-2
3x3 conv (padding 1) between levels, a middle of ``num_res_blocks`` blocks, then GroupNorm
-> swish -> 1x1 conv to ``z_channels`` latents, one per LFQ bit (there is no quant_conv).
The decoder mirrors it, with two changes MAGVIT-v2 introduced: upsampling is a 3x3 conv to
four times the width followed by depth-to-space, and every level starts with an *adaptive*
GroupNorm whose scale and bias are linear maps of the per-channel standard deviation and
mean of the quantized codes over the *whole* token grid.

That last point is a property of the model, kept here: a token's decoded pixels depend on
every other token of the image (through those two statistics), so a grid decoded in tiles
differs from the grid decoded whole, and a grid of a single token decodes to NaN (the
unbiased variance of one value), exactly as in the original.

Why every operation is spelled the way it is: vqserve must reproduce Open-MAGVIT2's
*indices*, and an LFQ bit flips when a latent crosses zero by one ulp; so each op is the
same floating-point operation in the same order as the original (``x * sigmoid(x)``, not
``F.silu``), and tensors have the original's memory layout where PyTorch's CPU kernels
round differently per layout: the encoder runs on contiguous NCHW, as Open-MAGVIT2's
autoregressive stage feeds it (``cond_transformer.get_input``); the decoder starts from
channels-last codes, which is what the original's ``LFQ.get_codebook_entry`` (and its
``encode``) hand to its decoder, and turns contiguous at the first depth-to-space, as the
original does. Checked against fixtures produced by the original code
(tests/integration/families/test_magvit2.py). Parameter names are the original's state-dict names
(``down.0.block.1.norm1.weight``, ``adaptive.2.gamma.weight``...), so a checkpoint maps on
them one to one.

Pixels: the encoder takes float pixels in [0, 255] and computes ``(2x - 255) / 255`` in fp32,
which is bit for bit the value Open-MAGVIT2's data pipeline gives (``image / 127.5 - 1.0`` in
numpy float64, then cast to float32; ``x / 127.5 - 1`` in fp32 differs on 128 of the 256
values). The decoder returns the original's uint8 rule (``custom_to_pil`` in its
reconstruction and evaluation scripts): ``trunc(255 * ((clamp(y, -1, 1) + 1) / 2))`` in fp32,
as integer-valued floats, so vqserve's clamp-and-round leaves them unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from vqserve.model.precision import cast_to, module_dtype

GROUPS = 32  # Open-MAGVIT2's GroupNorm: 32 groups, eps 1e-6
EPS = 1e-6


def group_norm(channels: int, affine: bool = True) -> nn.GroupNorm:
    if channels % GROUPS:
        raise ValueError(f"Open-MAGVIT2's GroupNorm needs channel counts divisible by {GROUPS}, got {channels}")
    return nn.GroupNorm(GROUPS, channels, eps=EPS, affine=affine)


def swish(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``, written out: ``F.silu`` may round differently in the last bit."""
    return x * torch.sigmoid(x)


class Magvit2ResBlock(nn.Module):
    """norm -> swish -> conv (no bias), twice, plus the input (through a 1x1 conv when
    widths differ). ``conv1``/``conv2`` are the residual branch: the convolutions vqserve's
    bf16/fp16 encoder policy runs in low precision (``vqserve.model.mixed_precision``)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1 = group_norm(c_in)
        self.norm2 = group_norm(c_out)
        self.conv1 = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(c_out, c_out, kernel_size=3, padding=1, bias=False)
        self.nin_shortcut = nn.Conv2d(c_in, c_out, kernel_size=1, bias=False) if c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return h + skip  # the original's order (branch + residual)


class EncoderLevel(nn.Module):
    """One resolution level: residual blocks (``block``), then a stride-2 conv (``downsample``)
    on every level but the last."""

    def __init__(self, c_in: int, c_out: int, num_res_blocks: int, downsample: bool):
        super().__init__()
        self.block = nn.ModuleList(Magvit2ResBlock(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks))
        self.downsample = nn.Conv2d(c_out, c_out, kernel_size=3, stride=2, padding=1) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        return x if self.downsample is None else self.downsample(x)


class Magvit2Encoder(nn.Module):
    """float pixels NCHW in [0, 255] -> latents NCHW (``z_channels``: one per LFQ bit)."""

    residual_block_types = (Magvit2ResBlock,)  # for vqserve.model.mixed_precision

    def __init__(self, base_channels: int, ch_mult: list[int], num_res_blocks: int, z_channels: int):
        super().__init__()
        widths = [base_channels * m for m in ch_mult]
        self.conv_in = nn.Conv2d(3, base_channels, kernel_size=3, padding=1, bias=False)
        levels, c_in = [], base_channels
        for i, c_out in enumerate(widths):
            levels.append(EncoderLevel(c_in, c_out, num_res_blocks, downsample=i < len(widths) - 1))
            c_in = c_out
        self.down = nn.ModuleList(levels)
        self.mid_block = nn.ModuleList(Magvit2ResBlock(c_in, c_in) for _ in range(num_res_blocks))
        self.norm_out = group_norm(c_in)
        self.conv_out = nn.Conv2d(c_in, z_channels, kernel_size=1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # the original's (x / 127.5 - 1.0) in float64 rounded to fp32, exactly; contiguous NCHW
        x = (pixels.to(torch.float32).contiguous() * 2.0 - 255.0) / 255.0
        h = self.conv_in(cast_to(x, module_dtype(self.conv_in)))
        for level in self.down:
            h = level(h)
        for block in self.mid_block:
            h = block(h)
        return self.conv_out(swish(self.norm_out(h)))


class AdaptiveGroupNorm(nn.Module):
    """GroupNorm without affine parameters, then ``scale * x + bias`` where scale and bias are
    linear maps (``gamma``, ``beta``) of the codes' per-channel standard deviation (unbiased
    variance + eps, square-rooted) and mean over all positions of the image."""

    def __init__(self, z_channels: int, channels: int):
        super().__init__()
        self.gn = group_norm(channels, affine=False)
        self.gamma = nn.Linear(z_channels, channels)
        self.beta = nn.Linear(z_channels, channels)

    def forward(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        b, c = x.shape[0], x.shape[1]
        flat = codes.reshape(codes.shape[0], codes.shape[1], -1)
        scale = self.gamma((flat.var(dim=-1) + EPS).sqrt()).view(b, c, 1, 1)
        bias = self.beta(flat.mean(dim=-1)).view(b, c, 1, 1)
        return scale * self.gn(x) + bias


def depth_to_space(x: torch.Tensor, block: int = 2) -> torch.Tensor:
    """[B, C*block^2, H, W] -> [B, C, H*block, W*block], the original's DCR order; the result
    is contiguous NCHW whatever the input's layout (as in the original)."""
    b, c, h, w = x.shape
    x = x.reshape(b, block, block, c // (block * block), h, w)
    x = x.permute(0, 3, 4, 1, 5, 2).contiguous()
    return x.view(b, c // (block * block), h * block, w * block)


class Upsampler(nn.Module):
    """3x3 conv to four times the width, then depth-to-space x2 (``conv1`` is the original's name)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels * 4, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return depth_to_space(self.conv1(x), 2)


class DecoderLevel(nn.Module):
    """One resolution level: residual blocks (``block``), then an ``upsample`` on every level
    but the first (the adaptive norm that opens a level lives in ``Magvit2Decoder.adaptive``)."""

    def __init__(self, c_in: int, c_out: int, num_res_blocks: int, upsample: bool):
        super().__init__()
        self.block = nn.ModuleList(Magvit2ResBlock(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks))
        self.upsample = Upsampler(c_out) if upsample else None


class Magvit2Decoder(nn.Module):
    """LFQ codes (+-1) NCHW -> integer-valued float pixels NCHW in [0, 255] (the original's rule)."""

    def __init__(self, base_channels: int, ch_mult: list[int], num_res_blocks: int, z_channels: int):
        super().__init__()
        widths = [base_channels * m for m in ch_mult]
        c_in = widths[-1]
        self.conv_in = nn.Conv2d(z_channels, c_in, kernel_size=3, padding=1)
        self.mid_block = nn.ModuleList(Magvit2ResBlock(c_in, c_in) for _ in range(num_res_blocks))
        up: list[DecoderLevel] = []
        adaptive: list[AdaptiveGroupNorm] = []
        for i in reversed(range(len(widths))):  # the original builds from the lowest resolution
            adaptive.insert(0, AdaptiveGroupNorm(z_channels, c_in))
            up.insert(0, DecoderLevel(c_in, widths[i], num_res_blocks, upsample=i > 0))
            c_in = widths[i]
        self.up = nn.ModuleList(up)          # up[i] is resolution level i, as in the original
        self.adaptive = nn.ModuleList(adaptive)
        self.norm_out = group_norm(c_in)
        self.conv_out = nn.Conv2d(c_in, 3, kernel_size=3, padding=1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        # channels-last, as the original's get_codebook_entry returns codes (see the module docstring)
        codes = cast_to(codes, module_dtype(self.conv_in)).contiguous(memory_format=torch.channels_last)
        h = self.conv_in(codes)
        for block in self.mid_block:
            h = block(h)
        for i in reversed(range(len(self.up))):
            h = self.adaptive[i](h, codes)
            level = self.up[i]
            for block in level.block:
                h = block(h)
            if level.upsample is not None:
                h = level.upsample(h)
        y = self.conv_out(swish(self.norm_out(h))).to(torch.float32)
        # custom_to_pil: clamp to [-1, 1], (y + 1) / 2, 255 * that, truncated to uint8
        return torch.floor(((torch.clamp(y, -1.0, 1.0) + 1.0) / 2.0) * 255.0)
