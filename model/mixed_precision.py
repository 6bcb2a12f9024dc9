"""How an encoder runs in bf16 without flipping tokens: low precision only inside residual branches.

A token flips when the low-precision encoder moves a latent across one of the quantizer's
rounding boundaries. Measured on the shipped default (whole validation photos, token
agreement of a bf16 encoder with the fp32 one; docs/EXPORT.md):

==============================================================  =========
the whole encoder cast to bf16                                   98.08 %
+ first and last convolutions in fp32                             98.71 %
+ the residual stream, norms and downsample in fp32 (this policy) 99.60 %
==============================================================  =========

The rounding that hurts is the rounding *of the residual stream*: every block adds its
branch to the stream, and a bf16 stream is re-rounded to 8 mantissa bits at every add and
at every layer that rewrites it (the stem, a downsample). The branch convolutions
themselves (``ResBlock.conv1`` / ``conv2``, about 93% of the default encoder's
multiply-adds) tolerate bf16 well. So the ``fp32_stream`` policy casts only those to the
low-precision dtype and keeps everything that reads or writes the stream in fp32: the stem,
the norms, skip and downsample convolutions, attention, the final norm and projection.

Each layer casts its input to its own parameter dtype (a forward pre-hook), so a bf16
branch output added to the fp32 stream promotes to fp32, and no layer ever sees a dtype it
cannot take. Hooks keep every module's name, so state dicts, exported graphs and the
manifest's ``fp32_layers`` name layers exactly as the fp32 model does.

Training is not changed: a margin term that pushes latents away from the boundaries was
measured and cannot help much, because the encoder is a continuous map and must cross
every boundary somewhere between two images (docs/TRAINING.md).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from vqserve.model.networks import AttentionBlock, ResBlock
from vqserve.model.precision import cast_to, module_dtype, parse_dtype

# layers whose input is cast to their own dtype (Linear layers live only inside AttentionBlock)
_CASTING_LAYERS = (nn.Conv2d, nn.GroupNorm, AttentionBlock)


def _cast_input_to_own_dtype(module: nn.Module, args: tuple) -> tuple:
    return (cast_to(args[0], module_dtype(module)), *args[1:])


def default_fp32_stream(dtype: str | torch.dtype) -> bool:
    """On for bf16 (8-bit mantissa), where it lifts agreement from ~98% to ~99.6%. fp16's
    10-bit mantissa already gives ~99.9% with the whole encoder in fp16, so it stays fp16."""
    return parse_dtype(dtype) == torch.bfloat16


def low_precision_encoder(encoder: nn.Module, dtype: str | torch.dtype,
                          fp32_stream: bool | None = None) -> tuple[nn.Module, list[str]]:
    """A copy of ``encoder`` for inference in ``dtype`` (eval mode, gradients off), and the
    names of its convolutions kept in fp32 (empty when the whole copy runs in ``dtype``).

    ``fp32_stream`` None follows ``default_fp32_stream``. The copy is always made from the
    fp32 weights the caller holds, so the fp32 layers carry every bit of them.
    """
    dtype = parse_dtype(dtype)
    if fp32_stream is None:
        fp32_stream = default_fp32_stream(dtype)
    enc = copy.deepcopy(encoder).float().eval().requires_grad_(False)
    if dtype == torch.float32 or not fp32_stream:
        return enc.to(dtype), []
    for block in enc.modules():
        if isinstance(block, ResBlock):
            block.conv1.to(dtype)
            block.conv2.to(dtype)
    for layer in enc.modules():
        if isinstance(layer, _CASTING_LAYERS):
            layer.register_forward_pre_hook(_cast_input_to_own_dtype)
    kept = [name for name, m in enc.named_modules()
            if isinstance(m, nn.Conv2d) and m.weight.dtype == torch.float32]
    return enc, kept
