"""taming-transformers' tensor names <-> vqserve's names for the same VQGAN networks.

taming-transformers (``taming/modules/diffusionmodules/model.py``) names its encoder levels
``encoder.down.{i}.block.{j}`` / ``.attn.{j}`` / ``.downsample``, its decoder levels
``decoder.up.{i}...`` with ``i`` the resolution level (0 = full resolution, stored in that
order although the decoder runs them from the lowest), the middle ``mid.block_1`` /
``mid.attn_1`` / ``mid.block_2``, and keeps ``quant_conv``, ``post_quant_conv`` and the
codebook ``quantize.embedding.weight`` at the top. vqserve's rebuild
(``vqserve.model.families.llamagen.networks``) runs the same operations under LlamaGen's
names: ``conv_blocks.{i}.res.{j}``, decoder levels in the order they run, ``quant_conv``
inside the encoder and ``post_quant_conv`` inside the decoder, because vqserve's encoder ends
at the quantizer's input and its decoder starts at its output.

Every family that ships taming's layout (taming itself and Meta's Chameleon VQGAN, IBQ,
SBER-MoVQGAN) maps its checkpoint through these two tables, so an error can name a tensor as
the user's checkpoint does. Sub-module names below a block (``norm1.weight``,
``norm1.norm_layer.weight`` in MoVQGAN's spatial norm, ``q.weight``) are kept as they are.
"""

from __future__ import annotations

import re

# taming name -> vqserve name for the levels and the middle (all a network in taming's layout
# shares, Show-o's MAGVIT-v2 included); "{r}" is the decoder level counted from the lowest resolution
LEVEL_RENAMES = (
    (r"encoder\.down\.(\d+)\.block\.(\d+)\.(.*)", "encoder.conv_blocks.{0}.res.{1}.{2}"),
    (r"encoder\.down\.(\d+)\.attn\.(\d+)\.(.*)", "encoder.conv_blocks.{0}.attn.{1}.{2}"),
    (r"encoder\.down\.(\d+)\.downsample\.(.*)", "encoder.conv_blocks.{0}.downsample.{1}"),
    (r"decoder\.up\.(\d+)\.block\.(\d+)\.(.*)", "decoder.conv_blocks.{r}.res.{1}.{2}"),
    (r"decoder\.up\.(\d+)\.attn\.(\d+)\.(.*)", "decoder.conv_blocks.{r}.attn.{1}.{2}"),
    (r"decoder\.up\.(\d+)\.upsample\.(.*)", "decoder.conv_blocks.{r}.upsample.{1}"),
    (r"(encoder|decoder)\.mid\.block_1\.(.*)", "{0}.mid.0.{1}"),
    (r"(encoder|decoder)\.mid\.attn_1\.(.*)", "{0}.mid.1.{1}"),
    (r"(encoder|decoder)\.mid\.block_2\.(.*)", "{0}.mid.2.{1}"),
)
# the whole model: the levels plus taming's top-level convolutions and codebook
RENAMES = LEVEL_RENAMES + (
    (r"quant_conv\.(.*)", "encoder.quant_conv.{0}"),
    (r"post_quant_conv\.(.*)", "decoder.post_quant_conv.{0}"),
    (r"quantize\.embedding\.weight", "quantizer.embedding"),
)
# vqserve name -> taming name (the inverse), to name expected tensors as the checkpoint does
LEVEL_INVERSE = (
    (r"encoder\.conv_blocks\.(\d+)\.res\.(\d+)\.(.*)", "encoder.down.{0}.block.{1}.{2}"),
    (r"encoder\.conv_blocks\.(\d+)\.attn\.(\d+)\.(.*)", "encoder.down.{0}.attn.{1}.{2}"),
    (r"encoder\.conv_blocks\.(\d+)\.downsample\.(.*)", "encoder.down.{0}.downsample.{1}"),
    (r"decoder\.conv_blocks\.(\d+)\.res\.(\d+)\.(.*)", "decoder.up.{r}.block.{1}.{2}"),
    (r"decoder\.conv_blocks\.(\d+)\.attn\.(\d+)\.(.*)", "decoder.up.{r}.attn.{1}.{2}"),
    (r"decoder\.conv_blocks\.(\d+)\.upsample\.(.*)", "decoder.up.{r}.upsample.{1}"),
    (r"(encoder|decoder)\.mid\.0\.(.*)", "{0}.mid.block_1.{1}"),
    (r"(encoder|decoder)\.mid\.1\.(.*)", "{0}.mid.attn_1.{1}"),
    (r"(encoder|decoder)\.mid\.2\.(.*)", "{0}.mid.block_2.{1}"),
)
INVERSE = LEVEL_INVERSE + (
    (r"encoder\.quant_conv\.(.*)", "quant_conv.{0}"),
    (r"decoder\.post_quant_conv\.(.*)", "post_quant_conv.{0}"),
    (r"quantizer\.embedding", "quantize.embedding.weight"),
)


def rename(name: str, table: tuple[tuple[str, str], ...], levels: int) -> str:
    for pattern, template in table:
        m = re.fullmatch(pattern, name)
        if m:
            groups = m.groups()
            flipped = levels - 1 - int(groups[0]) if "{r}" in template else None
            return template.format(*groups, r=flipped)
    return name


def to_vqserve_name(name: str, levels: int) -> str:
    """A taming tensor name -> vqserve's (``levels``: the number of resolution levels)."""
    return rename(name, RENAMES, levels)


def to_taming_name(name: str, levels: int) -> str:
    """A vqserve tensor name -> taming's (the inverse of ``to_vqserve_name``)."""
    return rename(name, INVERSE, levels)
