"""How an encoder runs in bf16/fp16 without flipping tokens: low precision only inside residual branches.

A token flips when the low-precision encoder moves a latent across one of the quantizer's
rounding boundaries. Measured on the shipped default, whole photographs, one thread, batch
1 (token agreement with the fp32 encoder; scikit-image validation photos / six held-out
photographs; docs/EXPORT.md, "Speed / agreement frontier"):

========================================================  ================  ================
encoder policy                                            bf16              fp16
========================================================  ================  ================
the whole encoder cast                                    97.89 / 97.72 %   99.74 / 99.73 %
residual-branch convolutions only (``fp32_stream``)       99.36 / 99.29 %   99.91 / 99.91 %
========================================================  ================  ================

The rounding that hurts most is the rounding *of the residual stream*: every block adds its
branch to the stream, and a low-precision stream is re-rounded at every add and at every
layer that rewrites it (the stem, a downsample). The branch convolutions themselves
(``ResBlock.conv1`` / ``conv2``, about 93% of the default encoder's multiply-adds) tolerate
low precision much better. So the ``fp32_stream`` policy casts only those to the
low-precision dtype and keeps everything that reads or writes the stream in fp32: the stem,
the norms, skip and downsample convolutions, attention, the final norm and projection. It
is the default for bf16 and fp16 alike.

What is left is mostly the rounding of the branch convolutions' *outputs*: PyTorch's bf16 and
fp16 convolutions accumulate in fp32 but return their own dtype. (Simulated on the validation
photos: rounding only the bf16 outputs flips 34 of the 37 tokens that bf16 flips, rounding
only the inputs 15, only the weights 2.) bf16 keeps 8 significant bits, so no choice of layers that
leaves a useful share of the work in bf16 reaches 99.9%: the only one that does on the
validation photos keeps just the last block's two convolutions (7% of the multiply-adds) in
bf16. fp16 keeps 11 significant bits, rounds 8x finer, and reaches 99.9% with the stream policy.

Each layer casts its input to its own parameter dtype (a forward pre-hook), so a low-precision
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
# the convolutions inside a residual branch, the ones the fp32-stream policy runs in low precision
BRANCH_CONVS = ("conv1", "conv2")


def _cast_input_to_own_dtype(module: nn.Module, args: tuple) -> tuple:
    return (cast_to(args[0], module_dtype(module)), *args[1:])


def default_fp32_stream(dtype: str | torch.dtype) -> bool:
    """On for every low precision: it lifts whole-photo token agreement from ~97.8% to ~99.3%
    in bf16 and from ~99.73% to ~99.91% in fp16, at the same speed within a few percent on
    the 2-vCPU Xeon measured (docs/EXPORT.md, "Speed / agreement frontier"). fp32 has nothing to keep."""
    return parse_dtype(dtype) != torch.float32


def branch_convolutions(encoder: nn.Module, which: tuple[str, ...] = BRANCH_CONVS) -> list[str]:
    """Names of ``encoder``'s residual-branch convolutions (``ResBlock.conv1``/``conv2``, or
    only those named in ``which``), in module order.

    A model family's encoder names its own residual block classes in
    ``residual_block_types`` (diffusers' ``ResnetBlock2D`` has the same ``norm1 -> conv1 ->
    norm2 -> conv2`` branch added to an untouched input), so foreign encoders get the same
    fp32 residual stream; a block whose branch layers have other names lists them in
    ``branch_layers`` (TiTok's transformer block: ``attn``, ``mlp``; it casts their inputs
    itself); an encoder with no known blocks has no branch convolutions and runs wholly in
    fp32 under this policy."""
    blocks = (ResBlock, *getattr(encoder, "residual_block_types", ()))
    return [f"{name}.{conv}" for name, m in encoder.named_modules() if isinstance(m, blocks)
            for conv in getattr(m, "branch_layers", which)]


def mixed_encoder(encoder: nn.Module, dtype: str | torch.dtype,
                  low_precision: list[str] | tuple[str, ...] | None) -> tuple[nn.Module, list[str]]:
    """A copy of ``encoder`` (eval mode, gradients off) with only the layers named in
    ``low_precision`` cast to ``dtype`` and everything else in fp32, and the names of its
    convolutions kept in fp32. ``None`` casts the whole copy (no fp32 layers, no hooks).

    Every layer casts its input to its own dtype (forward pre-hooks), so any choice of
    layers runs. The copy is made from the fp32 weights the caller holds.
    """
    dtype = parse_dtype(dtype)
    enc = copy.deepcopy(encoder).float().eval().requires_grad_(False)
    if dtype == torch.float32 or low_precision is None:
        return enc.to(dtype), []
    modules = dict(enc.named_modules())
    unknown = [name for name in low_precision if name not in modules]
    if unknown:
        raise ValueError(f"the encoder has no layer(s) {unknown}")
    for name in low_precision:
        modules[name].to(dtype)
    for layer in enc.modules():
        if isinstance(layer, _CASTING_LAYERS):
            layer.register_forward_pre_hook(_cast_input_to_own_dtype)
    kept = [name for name, m in enc.named_modules()
            if isinstance(m, nn.Conv2d) and m.weight.dtype == torch.float32]
    return enc, kept


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
    return mixed_encoder(encoder, dtype, branch_convolutions(encoder) if fp32_stream else None)
