"""The encoder and decoder of Show-o's MAGVIT-v2 (showlab/magvitv2), rebuilt op for op.

Show-o (github.com/showlab/Show-o, ``models/modeling_magvitv2.py`` and
``models/common_modules.py``; MMaDA loads the same ``showlab/magvitv2`` weights) calls its
tokenizer MAGVIT-v2, but its networks are not Open-MAGVIT2's: they are the
taming-transformers VQGAN layout (biased 3x3 convolutions, GroupNorm(32, eps 1e-6) ->
``x * sigmoid(x)``, a 1x1 skip when the width changes, a pad-then-stride-2 downsampler,
nearest x2 + 3x3 conv upsampler, a middle of block / single-head attention / block), with
three differences from LlamaGen's or IBQ's use of that layout, all kept here:

* ``num_res_blocks`` is a list, one count per level, and the decoder has those blocks
  (not ``num_res_blocks + 1``): encoder ``[4, 3, 4, 3, 4]`` over ``ch_mult [1, 2, 2, 4, 4]``,
  decoder ``[4, 4, 3, 4, 3]`` over ``ch_mult [1, 1, 2, 2, 4]`` (the two are not mirrors);
* attention only in the middle: ``attn_resolutions`` is ``[5]``, which no level of a
  256-pixel model reaches (256, 128, 64, 32, 16), so no level has attention blocks;
* ``quant_conv`` (13 -> 13) is the encoder's last layer and ``post_quant_conv`` the
  decoder's first, under those names.

So vqserve reuses its taming rebuild (``vqserve.model.families.llamagen.networks``: the
blocks, in the same floating-point order) and only lays it out differently; tensor names
are LlamaGen's (``conv_blocks.{i}.res.{j}``), renamed from Show-o's at import
(``showo_import``). Pixels: Show-o's ``image_transform`` is torchvision's ``ToTensor`` then
``Normalize(0.5, 0.5)``, i.e. ``(x / 255 - 0.5) / 0.5`` in fp32, which is what the LlamaGen
encoder computes. Decoded pixels follow Show-o's inference scripts:
``clamp((y + 1) / 2, 0, 1) * 255`` in fp32, then numpy ``astype(uint8)`` (truncation),
returned as integer-valued floats so vqserve's clamp-and-round leaves them unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from vqserve.model.families.llamagen.networks import (
    Level,
    LlamaGenDecoder,
    LlamaGenEncoder,
    NearestThenConv,
    PadThenStrideConv,
    conv1x1,
    conv3x3,
    group_norm,
    middle,
)


def _blocks(c_in: int, c_out: int, count: int) -> list[tuple[int, int]]:
    return [(c_in if j == 0 else c_out, c_out) for j in range(count)]


class ShowoEncoder(LlamaGenEncoder):
    """float pixels NCHW in [0, 255] -> LFQ latents NCHW (``z_channels``, one per bit), after
    ``quant_conv``. The forward pass is the taming one (``LlamaGenEncoder.forward``)."""

    def __init__(self, base_channels: int, ch_mult: list[int], num_res_blocks: list[int], z_channels: int):
        nn.Module.__init__(self)
        widths = [base_channels * m for m in ch_mult]
        last = len(widths) - 1
        self.conv_in = conv3x3(3, base_channels)
        levels, c_in = [], base_channels
        for i, (c_out, count) in enumerate(zip(widths, num_res_blocks, strict=True)):
            down = PadThenStrideConv(c_out) if i != last else None
            levels.append(Level(_blocks(c_in, c_out, count), attention=False, resample=down,
                                resample_name="downsample"))
            c_in = c_out
        self.conv_blocks = nn.ModuleList(levels)
        self.mid = middle(c_in)
        self.norm_out = group_norm(c_in)
        self.conv_out = conv3x3(c_in, z_channels)
        self.quant_conv = conv1x1(z_channels, z_channels)


class ShowoDecoder(LlamaGenDecoder):
    """LFQ codes (+-1) NCHW -> integer-valued float pixels NCHW in [0, 255] (Show-o's rule).
    The forward pass is the taming one (``LlamaGenDecoder.forward``, contiguous NCHW codes,
    as Show-o's ``get_codebook_entry`` returns them)."""

    def __init__(self, base_channels: int, ch_mult: list[int], num_res_blocks: list[int], z_channels: int):
        nn.Module.__init__(self)
        widths = [base_channels * m for m in ch_mult]
        c_in = widths[-1]
        self.post_quant_conv = conv1x1(z_channels, z_channels)
        self.conv_in = conv3x3(z_channels, c_in)
        self.mid = middle(c_in)
        levels = []
        for i in reversed(range(len(widths))):  # from the lowest resolution, as the original builds
            up = NearestThenConv(widths[i]) if i != 0 else None
            levels.append(Level(_blocks(c_in, widths[i], num_res_blocks[i]), attention=False, resample=up,
                                resample_name="upsample"))
            c_in = widths[i]
        self.conv_blocks = nn.ModuleList(levels)
        self.norm_out = group_norm(c_in)
        self.conv_out = conv3x3(c_in, 3)

    @staticmethod
    def to_pixels(y: torch.Tensor) -> torch.Tensor:
        # Show-o's inference scripts: clamp((y + 1) / 2, 0, 1) * 255, then astype(uint8)
        return torch.floor(torch.clamp((y + 1.0) / 2.0, 0.0, 1.0) * 255.0)
