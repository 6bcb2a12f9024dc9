"""The encoder and decoder of NVIDIA's Cosmos-Tokenizer DI (discrete image) models, rebuilt.

Cosmos-Tokenizer (github.com/NVIDIA/Cosmos-Tokenizer, ``cosmos_tokenizer/modules/layers2d.py``
and ``patching.py``) wraps the taming-transformers / Stable Diffusion VQGAN layout in a Haar
wavelet transform: the image is first split into ``patch_size``-x-``patch_size`` wavelet
sub-bands (two Haar levels for patch 4: 3 -> 48 channels at a quarter of the resolution), the
convolutional encoder downsamples the rest of the way (DI8x8: once, DI16x16: twice), and the
decoder ends with the inverse Haar transform. The residual blocks, the single-head attention
and the stride-2 / nearest-x2 resamplers are the same operations as LlamaGen's, so the block
classes of ``llamagen.networks`` are reused (same parameter names: ``norm1``, ``conv1``, ...).

Why every operation is spelled the way it is: vqserve must reproduce Cosmos's *indices*, and a
token flips when a latent crosses an FSQ rounding boundary by one ulp. So the Haar transform
is the same grouped 1x2 / 2x1 convolutions in the same order, with the filter rounded to the
working dtype the way Cosmos's buffer is; the pixels are normalised in float64 exactly as
``cosmos_tokenizer.utils.numpy2tensor`` does (``x / 255 * 2 - 1`` in float64, then one rounding
to fp32: fp32 arithmetic differs on half of the 256 values); and both networks run on
channels-last tensors, because that is the memory layout Cosmos's own pipeline hands them
(``numpy2tensor`` transposes a NHWC array; ``indices_to_codes`` permutes NHWC codes), and
PyTorch's CPU convolutions round differently on the two layouts. The decoder returns
``tensor2numpy``'s uint8 rule (``floor(clamp((y + 1) / 2, 0, 1) * 255 + 0.5)`` in fp32) as
integer-valued fp32, so vqserve's clamp-and-round leaves it unchanged.

Parameter names follow Cosmos's state dict (``down.0.block.1.conv2.weight``, ``mid.attn_1.q``,
``up.2.upsample.conv``); ``quant_conv`` lives in the encoder and ``post_quant_conv`` in the
decoder, because vqserve's encoder ends at the quantizer's input and its decoder starts at
its output. Checked against the original code in tests/integration/families/test_cosmos.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vqserve.model.families.llamagen.networks import (
    LlamaGenAttention,
    LlamaGenResBlock,
    PadThenStrideConv,
    conv1x1,
    conv3x3,
    group_norm,
    swish,
)
from vqserve.model.precision import cast_to, module_dtype

HAAR = 0.7071067811865476  # Cosmos's Haar filter tap, held as an fp32 buffer there
PATCH_METHODS = ("haar",)  # what the published DI models use ("rearrange" is not supported)


def _haar_filters(channels: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(low-pass, high-pass) per-channel filters ``[channels, 1, 2]`` in ``dtype``.

    The taps are rounded to fp32 first and then to ``dtype``, as Cosmos's fp32 buffer is when
    the model is cast, so a bf16 transform uses the same 0.70703125 the original does."""
    tap = torch.full((), HAAR, dtype=torch.float32, device=device).to(dtype)
    low = torch.stack([tap, tap]).reshape(1, 1, 2).repeat(channels, 1, 1)
    high = torch.stack([tap, -tap]).reshape(1, 1, 2).repeat(channels, 1, 1)
    return low, high


def haar_analysis(x: torch.Tensor) -> torch.Tensor:
    """One Haar level: ``[B, C, H, W] -> [B, 4C, H/2, W/2]`` as ``[LL, LH, HL, HH]``, halved.

    Rows first (1x2 filters, stride 2 along W), then columns (2x1, stride 2 along H); the
    input is reflect-padded by one column and row at the end first, as Cosmos pads (the
    padding is never read for even sizes, but it is kept so the convolutions see the same
    shapes)."""
    channels = x.shape[1]
    low, high = _haar_filters(channels, x.dtype, x.device)
    x = F.pad(x, (0, 1, 0, 1), mode="reflect")
    rows_low = F.conv2d(x, low.unsqueeze(2), groups=channels, stride=(1, 2))
    rows_high = F.conv2d(x, high.unsqueeze(2), groups=channels, stride=(1, 2))
    col_low, col_high = low.unsqueeze(3), high.unsqueeze(3)
    bands = [F.conv2d(rows_low, col_low, groups=channels, stride=(2, 1)),
             F.conv2d(rows_low, col_high, groups=channels, stride=(2, 1)),
             F.conv2d(rows_high, col_low, groups=channels, stride=(2, 1)),
             F.conv2d(rows_high, col_high, groups=channels, stride=(2, 1))]
    return torch.cat(bands, dim=1) / 2


def haar_synthesis(x: torch.Tensor) -> torch.Tensor:
    """The inverse of ``haar_analysis``: ``[B, 4C, h, w] -> [B, C, 2h, 2w]``, doubled.

    Columns first (transposed 2x1 convolutions), then rows, each as two transposed
    convolutions added, in Cosmos's order."""
    channels = x.shape[1] // 4
    low, high = _haar_filters(channels, x.dtype, x.device)
    ll, lh, hl, hh = torch.chunk(x, 4, dim=1)
    col_low, col_high = low.unsqueeze(3), high.unsqueeze(3)
    rows_low = (F.conv_transpose2d(ll, col_low, groups=channels, stride=(2, 1))
                + F.conv_transpose2d(lh, col_high, groups=channels, stride=(2, 1)))
    rows_high = (F.conv_transpose2d(hl, col_low, groups=channels, stride=(2, 1))
                 + F.conv_transpose2d(hh, col_high, groups=channels, stride=(2, 1)))
    y = (F.conv_transpose2d(rows_low, low.unsqueeze(2), groups=channels, stride=(1, 2))
         + F.conv_transpose2d(rows_high, high.unsqueeze(2), groups=channels, stride=(1, 2)))
    return y * 2


class HaarPatcher(nn.Module):
    """``log2(patch_size)`` Haar levels: ``[B, 3, H, W] -> [B, 3 p^2, H/p, W/p]``."""

    def __init__(self, patch_size: int):
        super().__init__()
        self.levels = patch_size.bit_length() - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.levels):
            x = haar_analysis(x)
        return x


class HaarUnpatcher(nn.Module):
    """The inverse of ``HaarPatcher``."""

    def __init__(self, patch_size: int):
        super().__init__()
        self.levels = patch_size.bit_length() - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.levels):
            x = haar_synthesis(x)
        return x


class RepeatThenConv(nn.Module):
    """Double the resolution: nearest x2, then a 3x3 conv; the upsampled tensor is contiguous
    NCHW. Cosmos upsamples with ``repeat_interleave``, which returns a contiguous tensor even
    from a channels-last input, where ``F.interpolate`` keeps channels-last; same values, but
    the convolution that follows rounds differently on the two layouts (1 pixel in ~8,000 off
    by one level in the decoded image). ``interpolate`` exports everywhere, so it is used with
    an explicit ``.contiguous()`` (a no-op in exported graphs)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = conv3x3(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest").contiguous())


class Stage(nn.Module):
    """One resolution level as Cosmos names it: ``block`` (residual blocks), ``attn`` (one
    attention after each block, or empty) and an optional ``downsample`` / ``upsample``."""

    def __init__(self, widths: list[tuple[int, int]], attention: bool,
                 resample_name: str | None, resample: nn.Module | None):
        super().__init__()
        self.block = nn.ModuleList(LlamaGenResBlock(c_in, c_out) for c_in, c_out in widths)
        self.attn = nn.ModuleList(LlamaGenAttention(c_out) for _, c_out in widths) if attention else nn.ModuleList()
        self.resample_name = resample_name
        if resample_name is not None:
            self.add_module(resample_name, resample)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.block):
            x = block(x)
            if len(self.attn):
                x = self.attn[i](x)
        return x if self.resample_name is None else getattr(self, self.resample_name)(x)


class Middle(nn.Module):
    """``block_1``, ``attn_1``, ``block_2`` at the lowest resolution."""

    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = LlamaGenResBlock(channels, channels)
        self.attn_1 = LlamaGenAttention(channels)
        self.block_2 = LlamaGenResBlock(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


def normalise_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """float pixels in [0, 255] -> fp32 in [-1, 1] exactly as ``numpy2tensor``: float64
    ``x / 255`` then ``2 x - 1``, one rounding to fp32 at the end, channels-last."""
    x = pixels.to(torch.float64) / 255.0
    x = (2.0 * x - 1.0).to(torch.float32)
    return x.contiguous(memory_format=torch.channels_last)


def to_cosmos_uint8(y: torch.Tensor) -> torch.Tensor:
    """Decoder output in [-1, 1] -> ``tensor2numpy``'s uint8 values, as integer-valued fp32."""
    y = ((y.to(torch.float32) + 1.0) / 2.0).clamp(0, 1)
    return torch.floor(y * 255.0 + 0.5)


class CosmosEncoder(nn.Module):
    """float pixels NCHW in [0, 255] -> FSQ latents NCHW (``embedding_dim`` channels).

    ``attention[i]``: whether level ``i`` has attention after each block; ``downsamples``:
    how many of the first levels end with a stride-2 convolution."""

    residual_block_types = (LlamaGenResBlock,)  # for vqserve.model.mixed_precision

    def __init__(self, channels: int, channels_mult: list[int], num_res_blocks: int,
                 attention: list[bool], downsamples: int, patch_size: int, z_channels: int,
                 embedding_dim: int):
        super().__init__()
        self.patcher = HaarPatcher(patch_size)
        self.conv_in = conv3x3(3 * patch_size * patch_size, channels)
        in_mult = [1, *channels_mult]
        stages = []
        for i, mult in enumerate(channels_mult):
            c_in, c_out = channels * in_mult[i], channels * mult
            widths = [(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks)]
            down = i < downsamples
            stages.append(Stage(widths, attention[i], "downsample" if down else None,
                                PadThenStrideConv(c_out) if down else None))
        self.down = nn.ModuleList(stages)
        width = channels * channels_mult[-1]
        self.mid = Middle(width)
        self.norm_out = group_norm(width)
        self.conv_out = conv3x3(width, z_channels)
        self.quant_conv = conv1x1(z_channels, embedding_dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = cast_to(normalise_pixels(pixels), module_dtype(self.conv_in))
        h = self.conv_in(self.patcher(x))
        for stage in self.down:
            h = stage(h)
        h = self.mid(h)
        h = self.conv_out(swish(self.norm_out(h)))
        return self.quant_conv(h)


class CosmosDecoder(nn.Module):
    """FSQ codes NCHW -> integer-valued float pixels NCHW in [0, 255] (Cosmos's uint8 rule).

    ``attention[i]`` and ``upsamples`` as for the encoder; ``up[i]`` is level ``i``, run from
    the last level to the first, as Cosmos indexes and runs it."""

    def __init__(self, channels: int, channels_mult: list[int], num_res_blocks: int,
                 attention: list[bool], upsamples: int, patch_size: int, z_channels: int,
                 embedding_dim: int):
        super().__init__()
        levels = len(channels_mult)
        c_in = channels * channels_mult[-1]
        self.post_quant_conv = conv1x1(embedding_dim, z_channels)
        self.conv_in = conv3x3(z_channels, c_in)
        self.mid = Middle(c_in)
        stages: list[Stage] = []
        for i in reversed(range(levels)):
            c_out = channels * channels_mult[i]
            widths = [(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks + 1)]
            up = i >= levels - upsamples
            stages.insert(0, Stage(widths, attention[i], "upsample" if up else None,
                                   RepeatThenConv(c_out) if up else None))
            c_in = c_out
        self.up = nn.ModuleList(stages)
        self.norm_out = group_norm(c_in)
        self.conv_out = conv3x3(c_in, 3 * patch_size * patch_size)
        self.unpatcher = HaarUnpatcher(patch_size)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        codes = cast_to(codes, module_dtype(self.post_quant_conv))
        h = self.conv_in(self.post_quant_conv(codes.contiguous(memory_format=torch.channels_last)))
        h = self.mid(h)
        for stage in reversed(self.up):
            h = stage(h)
        y = self.unpatcher(self.conv_out(swish(self.norm_out(h))))
        return to_cosmos_uint8(y)
