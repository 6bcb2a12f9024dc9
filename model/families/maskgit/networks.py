"""MaskGIT-VQGAN's encoder and decoder (open-muse's ``MaskGitVQGAN``), rebuilt op for op.

Google's MaskGIT tokenizer (github.com/google-research/maskgit, JAX) was ported to PyTorch by
open-muse (github.com/huggingface/open-muse, ``muse/modeling_maskgit_vqgan.py``) and released
as ``openMUSE/maskgit-vqgan-imagenet-f16-256``, its weights converted from the JAX checkpoint
(``scripts/convert_maskgit_vqgan.py``). It is a VQGAN, but not taming's: vqserve's taming
rebuild (``llamagen.networks``) cannot be reused, because every one of these differs:

* ``Conv2dSame``: TensorFlow "same" padding, asymmetric (``pad // 2`` before, the rest after),
  then an unpadded convolution. Every convolution of this model has stride 1, where the
  original's run-time formula ``(ceil(i / s) - 1) * s + (k - 1) * d + 1 - i`` is ``(k - 1) * d``
  for every input size ``i``: the padding is fixed here at construction (so traced and
  exported graphs serve any size), and a unit test replays the formula;
* residual blocks have no biases in their convolutions and no attention anywhere (the
  ``attn_resolutions`` config key is ignored by the original too); ``F.silu`` as written;
* **the shortcut quirk, kept bug for bug**: where a block changes width, the original's
  ``residual = self.nin_shortcut(hidden_states)`` is applied to the block's *output* (a 1x1
  convolution from ``out`` to ``out`` channels), not to its input. The released weights were
  converted into, and are only right with, that graph (``nin_shortcut.weight`` is
  ``[out, out, 1, 1]``), so this rebuild computes ``h + nin_shortcut(h)`` there too;
* downsampling is ``avg_pool2d(2, 2)`` after each level but the last; upsampling is nearest x2
  then a 3x3 ``Conv2dSame`` (``upsample_conv``); the decoder has ``num_res_blocks`` blocks per
  level (taming has one more);
* no ``quant_conv``: the encoder's ``conv_out`` (1x1) gives the quantizer's input directly.

Parameter names are the original's (``down.{i}.block.{j}``, ``mid.{j}``, ``up.{i}`` stored
from full resolution and run from the lowest), so a released state dict loads one to one
(only ``quantize.embedding.weight`` becomes vqserve's ``quantizer.embedding``).

Layout: the decoder takes the codes as the original's ``get_codebook_entry`` returns them, a
channel-last tensor permuted to NCHW (not made contiguous), which is what
``TokenizerBase.indices_to_codes`` gives, because PyTorch's CPU convolutions may round a
channels-last input differently; the encoder makes its pixels contiguous NCHW, as
torchvision's ``ToTensor`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vqserve.model.precision import cast_to, module_dtype

GROUPS = 32  # GroupNorm(32, eps 1e-6, affine) everywhere in the original


def same_padding(size: int, kernel: int, stride: int = 1, dilation: int = 1) -> int:
    """The original's ``Conv2dSame.calc_same_pad``: TensorFlow's total "same" padding."""
    return max((-(-size // stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)


def group_norm(channels: int) -> nn.GroupNorm:
    if channels % GROUPS:
        raise ValueError(f"MaskGIT-VQGAN's GroupNorm needs channel counts divisible by {GROUPS}, got {channels}")
    return nn.GroupNorm(GROUPS, channels, eps=1e-6, affine=True)


class SameConv(nn.Conv2d):
    """``Conv2dSame`` at stride 1: zero-pad ``(k - 1) // 2`` before and the rest after (each
    spatial side), then convolve without padding, as the original does at run time."""

    def __init__(self, c_in: int, c_out: int, kernel: int, bias: bool = True):
        super().__init__(c_in, c_out, kernel_size=kernel, bias=bias)
        total = same_padding(1, kernel)  # the same for every size at stride 1 (module docstring)
        self.same_pad = (total // 2, total - total // 2) * 2  # (left, right, top, bottom)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(self.same_pad):
            x = F.pad(x, list(self.same_pad))
        return super().forward(x)


class MaskgitResBlock(nn.Module):
    """norm -> silu -> conv (no bias), twice; plus the input, or, when the width changes, plus
    ``nin_shortcut`` of the *output* (the original's quirk, module docstring)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1 = group_norm(c_in)
        self.conv1 = SameConv(c_in, c_out, 3, bias=False)
        self.norm2 = group_norm(c_out)
        self.conv2 = SameConv(c_out, c_out, 3, bias=False)
        self.nin_shortcut = SameConv(c_out, c_out, 1, bias=False) if c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))  # dropout: identity at inference
        residual = x if self.nin_shortcut is None else self.nin_shortcut(h)
        return h + residual


def res_blocks(c_in: int, c_out: int, count: int) -> nn.ModuleList:
    return nn.ModuleList(MaskgitResBlock(c_in if j == 0 else c_out, c_out) for j in range(count))


class DownLevel(nn.Module):
    """``DownsamplingBlock``: blocks, then ``avg_pool2d(2, 2)`` unless it is the last level."""

    def __init__(self, c_in: int, c_out: int, count: int, downsample: bool):
        super().__init__()
        self.block = res_blocks(c_in, c_out, count)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        return F.avg_pool2d(x, kernel_size=2, stride=2) if self.downsample else x


class UpLevel(nn.Module):
    """``UpsamplingBlock``: blocks, then nearest x2 and ``upsample_conv`` unless it is level 0."""

    def __init__(self, c_in: int, c_out: int, count: int, upsample: bool):
        super().__init__()
        self.block = res_blocks(c_in, c_out, count)
        self.upsample_conv = SameConv(c_out, c_out, 3) if upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        if self.upsample_conv is not None:
            x = self.upsample_conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return x


class MaskgitEncoder(nn.Module):
    """float pixels NCHW in [0, 255] -> the quantizer's input NCHW (``z_channels``)."""

    residual_block_types = (MaskgitResBlock,)  # for vqserve.model.mixed_precision

    def __init__(self, hidden_channels: int, channel_mult: list[int], num_res_blocks: int, z_channels: int):
        super().__init__()
        widths = [hidden_channels * m for m in channel_mult]
        inputs = [hidden_channels, *widths[:-1]]
        self.conv_in = SameConv(3, hidden_channels, 3, bias=False)
        self.down = nn.ModuleList(DownLevel(inputs[i], widths[i], num_res_blocks, i != len(widths) - 1)
                                  for i in range(len(widths)))
        self.mid = res_blocks(widths[-1], widths[-1], num_res_blocks)
        self.norm_out = group_norm(widths[-1])
        self.conv_out = SameConv(widths[-1], z_channels, 1)

    @staticmethod
    def normalise(pixels: torch.Tensor) -> torch.Tensor:
        """float pixels [0, 255] -> [0, 1] as torchvision's ``ToTensor`` (open-muse's
        transforms, MaskGIT's tokenizer): ``x / 255`` in fp32, contiguous NCHW."""
        return pixels.to(torch.float32).contiguous() / 255.0

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(cast_to(self.normalise(pixels), module_dtype(self.conv_in)))
        for level in self.down:
            h = level(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class MaskgitDecoder(nn.Module):
    """codes NCHW -> integer-valued float pixels NCHW in [0, 255] (open-muse's uint8 rule)."""

    def __init__(self, hidden_channels: int, channel_mult: list[int], num_res_blocks: int, z_channels: int):
        super().__init__()
        widths = [hidden_channels * m for m in channel_mult]
        self.conv_in = SameConv(z_channels, widths[-1], 3)
        self.mid = res_blocks(widths[-1], widths[-1], num_res_blocks)
        inputs = [*widths[1:], widths[-1]]  # level i takes level i+1's width (the last its own)
        self.up = nn.ModuleList(UpLevel(inputs[i], widths[i], num_res_blocks, i != 0) for i in range(len(widths)))
        self.norm_out = group_norm(widths[0])
        self.conv_out = SameConv(widths[0], 3, 3)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(cast_to(codes, module_dtype(self.conv_in)))  # layout kept (module docstring)
        for block in self.mid:
            h = block(h)
        for level in reversed(self.up):
            h = level(h)
        return self.to_pixels(self.conv_out(F.silu(self.norm_out(h))).to(torch.float32))

    @staticmethod
    def to_pixels(y: torch.Tensor) -> torch.Tensor:
        """open-muse's pipeline (``to_pil_image``, the README, ``train_muse.py``), in fp32:
        ``trunc(255 * ((clamp(2y - 1, -1, 1) + 1) / 2))``, the last step numpy's ``astype(uint8)``."""
        t = torch.clamp(2.0 * y - 1.0, -1.0, 1.0)
        return torch.trunc((t + 1.0) / 2.0 * 255.0)
