"""The convolutional encoder and decoder of LlamaGen's VQ tokenizers (VQ-8, VQ-16), rebuilt.

LlamaGen (github.com/FoundationVision/LlamaGen, ``tokenizer/tokenizer_image/vq_model.py``)
uses the taming-transformers VQGAN layout: per resolution level a stack of residual blocks
(GroupNorm(32, eps 1e-6) -> swish -> 3x3 conv, twice, plus a 1x1 skip when the width
changes), single-head spatial self-attention after every block of the lowest-resolution
level (``attention_levels`` names other levels, as taming's ``attn_resolutions`` may), a middle of block/attention/block, then GroupNorm -> swish -> 3x3 conv. Downsampling
is a stride-2 3x3 conv after padding one row and column at the bottom/right; upsampling is
nearest-neighbour x2 followed by a 3x3 conv.

Why every operation is spelled the way it is: vqserve must reproduce LlamaGen's *indices*,
and a token flips when a latent moves across a nearest-code boundary by one ulp. So each
op here is the same floating-point operation in the same order as the original (``x *
sigmoid(x)`` rather than ``F.silu``, the attention's two ``bmm`` in the same layouts, the
1/sqrt(c) scale applied after the product), checked against fixtures produced by the
original code (tests/integration/families/test_llamagen.py). The parameter names are those of LlamaGen's
state dict (``conv_blocks.0.res.1.norm1.weight`` ...) so an imported checkpoint maps onto
them one to one; ``quant_conv`` lives in the encoder and ``post_quant_conv`` in the decoder,
because vqserve's encoder ends at the quantizer's input and its decoder starts at its output.

Pixels: the encoder takes float pixels in [0, 255] and applies the normalisation LlamaGen's
code-extraction and reconstruction scripts use (torchvision ``ToTensor`` then
``Normalize(0.5, 0.5)``: ``(x / 255 - 0.5) / 0.5`` in fp32) on a contiguous NCHW tensor: the
memory layout matters, because a channels-last input makes PyTorch's CPU convolutions round
differently. The decoder returns LlamaGen's own uint8 rule
``floor(clamp(127.5 * y + 128, 0, 255))`` as integer-valued fp32, so vqserve's
clamp-and-round to uint8 leaves it unchanged and decoded pixels equal the original's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vqserve.model.precision import cast_to, module_dtype

GROUPS = 32  # LlamaGen's GroupNorm: 32 groups, eps 1e-6, affine


def group_norm(channels: int) -> nn.GroupNorm:
    if channels % GROUPS:
        raise ValueError(f"LlamaGen's GroupNorm needs channel counts divisible by {GROUPS}, got {channels}")
    return nn.GroupNorm(GROUPS, channels, eps=1e-6, affine=True)


def swish(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``, written out: ``F.silu`` may round differently in the last bit."""
    return x * torch.sigmoid(x)


def conv3x3(c_in: int, c_out: int, stride: int = 1, padding: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=padding)


def conv1x1(c_in: int, c_out: int) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=1)


class LlamaGenResBlock(nn.Module):
    """norm -> swish -> conv, twice, added to the input (through a 1x1 conv when widths differ).

    ``conv1``/``conv2`` are the residual branch: the only convolutions vqserve's bf16/fp16
    encoder policy runs in low precision (``vqserve.model.mixed_precision``)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1 = group_norm(c_in)
        self.conv1 = conv3x3(c_in, c_out)
        self.norm2 = group_norm(c_out)
        self.conv2 = conv3x3(c_out, c_out)
        self.nin_shortcut = conv1x1(c_in, c_out) if c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class LlamaGenAttention(nn.Module):
    """Single-head self-attention over all positions, 1x1 convs for q, k, v and the output."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q = conv1x1(channels, channels)
        self.k = conv1x1(channels, channels)
        self.v = conv1x1(channels, channels)
        self.proj_out = conv1x1(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(x, self.norm(x))

    def attend(self, x: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """``x`` plus attention over ``normed`` (a subclass brings its own normalisation)."""
        b, c, h, w = x.shape
        queries = self.q(normed).reshape(b, c, h * w).permute(0, 2, 1)      # b, hw, c
        keys = self.k(normed).reshape(b, c, h * w)                          # b, c, hw
        weights = torch.softmax(torch.bmm(queries, keys) * (int(c) ** -0.5), dim=2)
        values = self.v(normed).reshape(b, c, h * w)
        attended = torch.bmm(values, weights.permute(0, 2, 1)).reshape(b, c, h, w)
        return x + self.proj_out(attended)


class PadThenStrideConv(nn.Module):
    """Halve the resolution: pad one zero row/column at the bottom/right, 3x3 conv stride 2."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = conv3x3(channels, channels, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class NearestThenConv(nn.Module):
    """Double the resolution: nearest-neighbour x2, then a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = conv3x3(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """One resolution level: residual blocks (``res``), attention after each block on the
    lowest-resolution level (``attn``, else empty) and an optional resampler."""

    def __init__(self, widths: list[tuple[int, int]], attention: bool, resample: nn.Module | None,
                 resample_name: str):
        super().__init__()
        self.res = nn.ModuleList(LlamaGenResBlock(c_in, c_out) for c_in, c_out in widths)
        self.attn = nn.ModuleList(LlamaGenAttention(c_out) for _, c_out in widths) if attention else nn.ModuleList()
        self.resample_name = resample_name
        if resample is not None:
            self.add_module(resample_name, resample)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.res):
            x = block(x)
            if len(self.attn):
                x = self.attn[i](x)
        resample = getattr(self, self.resample_name, None)
        return x if resample is None else resample(x)


def middle(channels: int) -> nn.ModuleList:
    """block, attention, block at the lowest resolution."""
    return nn.ModuleList([LlamaGenResBlock(channels, channels), LlamaGenAttention(channels),
                          LlamaGenResBlock(channels, channels)])


class LlamaGenEncoder(nn.Module):
    """float pixels NCHW in [0, 255] -> pre-quantizer latents NCHW (``codebook_dim`` channels)."""

    residual_block_types = (LlamaGenResBlock,)  # for vqserve.model.mixed_precision

    def __init__(self, base_channels: int, ch_mult: list[int], num_res_blocks: int,
                 z_channels: int, codebook_dim: int, attention_levels: list[int] | frozenset[int] | None = None):
        super().__init__()
        widths = [base_channels * m for m in ch_mult]
        last = len(widths) - 1
        attend = {last} if attention_levels is None else set(attention_levels)  # taming's attn_resolutions
        self.conv_in = conv3x3(3, base_channels)
        levels, c_in = [], base_channels
        for i, c_out in enumerate(widths):
            blocks = [(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks)]
            down = PadThenStrideConv(c_out) if i != last else None
            levels.append(Level(blocks, attention=i in attend, resample=down, resample_name="downsample"))
            c_in = c_out
        self.conv_blocks = nn.ModuleList(levels)
        self.mid = middle(c_in)
        self.norm_out = group_norm(c_in)
        self.conv_out = conv3x3(c_in, z_channels)
        self.quant_conv = conv1x1(z_channels, codebook_dim)

    @staticmethod
    def normalise(pixels: torch.Tensor) -> torch.Tensor:
        """float pixels [0, 255] -> the network's input, fp32, contiguous NCHW: LlamaGen's
        (torchvision ToTensor + Normalize(0.5, 0.5)); a family with another rule overrides only this."""
        return (pixels.to(torch.float32).contiguous() / 255.0 - 0.5) / 0.5

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.normalise(pixels)
        h = self.conv_in(cast_to(x, module_dtype(self.conv_in)))
        for level in self.conv_blocks:
            h = level(h)
        for block in self.mid:
            h = block(h)
        h = self.conv_out(swish(self.norm_out(h)))
        return self.quant_conv(h)


class LlamaGenDecoder(nn.Module):
    """quantized codes NCHW -> integer-valued float pixels NCHW in [0, 255] (LlamaGen's rule)."""

    def __init__(self, base_channels: int, ch_mult: list[int], num_res_blocks: int,
                 z_channels: int, codebook_dim: int, attention_levels: list[int] | frozenset[int] | None = None):
        super().__init__()
        widths = [base_channels * m for m in ch_mult]
        attend = {len(widths) - 1} if attention_levels is None else set(attention_levels)
        c_in = widths[-1]
        self.post_quant_conv = conv1x1(codebook_dim, z_channels)
        self.conv_in = conv3x3(z_channels, c_in)
        self.mid = middle(c_in)
        levels = []
        for i in reversed(range(len(widths))):
            c_out = widths[i]
            blocks = [(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks + 1)]
            up = NearestThenConv(c_out) if i != 0 else None
            levels.append(Level(blocks, attention=i in attend, resample=up, resample_name="upsample"))
            c_in = c_out
        self.conv_blocks = nn.ModuleList(levels)
        self.norm_out = group_norm(c_in)
        self.conv_out = conv3x3(c_in, 3)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        # contiguous NCHW, as LlamaGen's get_codebook_entry returns its codes
        codes = cast_to(codes, module_dtype(self.post_quant_conv)).contiguous()
        h = self.conv_in(self.post_quant_conv(codes))
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            h = level(h)
        return self.to_pixels(self.conv_out(swish(self.norm_out(h))).to(torch.float32))

    @staticmethod
    def to_pixels(y: torch.Tensor) -> torch.Tensor:
        """The network's fp32 output -> pixel values [0, 255], floored: LlamaGen's uint8 rule
        (a family with another rule overrides only this)."""
        return torch.floor(torch.clamp(127.5 * y + 128.0, 0.0, 255.0))
