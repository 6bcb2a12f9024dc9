"""Self-contained encode / decode modules: the exact graphs every exported format holds.

``EncodeGraph``: uint8 ``[B,H,W,3]`` -> int64 indices ``[B,H/f,W/f]`` (``[...,Q]`` residual).
``DecodeGraph``: int64 indices -> uint8 ``[B,H,W,3]``.

Normalisation, NHWC<->NCHW layout, clamping and rounding all live inside the graph, so an
artifact needs no Python around it. The networks run in the export dtype; the quantizer
runs inside ``Fp32Island``, a submodule of its own whose first op is an explicit cast to
float32 and whose output is integer indices (encode) or float32 codes (decode). Because
the island is a named submodule (``island``), every format keeps it identifiable: ONNX
name scopes, TorchScript submodules and torch.export ``nn_module_stack`` all say
``island``, which is what ``vqserve.export.inspect_graph`` checks.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from vqserve.model.precision import QUANTIZER_DTYPE, parse_dtype
from vqserve.model.tokenizer import float_to_pixels, pixels_to_float

ISLAND = "island"  # the submodule name every graph check looks for


class Fp32Island(nn.Module):
    """The quantizer, fed float32 explicitly; integer index arithmetic inside.

    ``forward(latents_nhwc)`` -> indices (encode). ``codes(indices)`` -> float32 codes NHWC
    (decode). The quantizer's own forward / ``indices_to_codes`` run unchanged, so indices
    match the eager model bit for bit when the latents do.
    """

    def __init__(self, quantizer: nn.Module):
        super().__init__()
        self.quantizer = quantizer

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(QUANTIZER_DTYPE)  # border cast in (a no-op for fp32 graphs)
        _, indices = self.quantizer(z)
        return indices.to(torch.int64)


class Fp32CodesIsland(nn.Module):
    """Decode side of the island: integer indices -> float32 codes (channel-last)."""

    def __init__(self, quantizer: nn.Module):
        super().__init__()
        self.quantizer = quantizer

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.quantizer.indices_to_codes(indices.to(torch.int64), QUANTIZER_DTYPE)


def _network_copy(tokenizer: nn.Module, part: str, dtype: torch.dtype) -> nn.Module:
    net = copy.deepcopy(getattr(tokenizer, part)).to(dtype).eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def _quantizer_copy(tokenizer: nn.Module) -> nn.Module:
    q = copy.deepcopy(tokenizer.quantizer).eval()  # Fp32StateModule: state stays fp32
    q.float()
    for p in q.parameters():
        p.requires_grad_(False)
    return q


class Fp32Head(nn.Module):
    """The encoder's final projection kept in fp32: casts its input explicitly, so the
    latents reach the island already in float32 (measured: bf16 agreement +0.26 points)."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.to(torch.float32))


FP32_HEAD = "encoder.conv_out"
FP32_STEM = "encoder.conv_in"


class Fp32Stem(nn.Module):
    """The encoder's first convolution kept in fp32, fed the fp32 pixels directly.

    Why: normalised uint8 pixels are not exact in bf16 (8-bit mantissa) and neither are
    the first layer's weights; that first rounding, amplified by the rest of the encoder,
    caused most of the bf16 token flips of the shipped default (bf16 agreement 98.21% with
    the whole encoder in bf16, 99.23% with only this convolution in fp32, docs/EXPORT.md).
    It is a few percent of the encoder's work. ``weight`` is exposed so the encoder's dtype
    door casts its input to fp32, not to the compute dtype.
    """

    def __init__(self, conv: nn.Module, out_dtype: torch.dtype):
        super().__init__()
        self.conv = conv.float()
        self.out_dtype = out_dtype

    @property
    def weight(self) -> torch.Tensor:
        return self.conv.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.to(torch.float32)).to(self.out_dtype)


def default_fp32_ends(dtype: str | torch.dtype) -> bool:
    """Keep the final projection (and the first convolution) in fp32 where it measurably
    helps: bf16 (8-bit mantissa). For fp16 it made no difference, so the whole encoder stays
    fp16."""
    return parse_dtype(dtype) == torch.bfloat16


def keep_encoder_ends_fp32(encoder: nn.Module, fp32_conv_in: nn.Module, fp32_conv_out: nn.Module,
                           dtype: torch.dtype, head: bool, stem: bool) -> list[str]:
    """Swap ``encoder``'s first / last convolutions for fp32 copies of the given fp32 ones
    (copied from the fp32 weights: a bf16 module cast back would have lost the bits).
    Shared by the export graphs and the eager runtime, so both compute the same thing.
    Returns the manifest's ``fp32_layers``."""
    if head:
        encoder.conv_out = Fp32Head(copy.deepcopy(fp32_conv_out))
    if stem:
        encoder.conv_in = Fp32Stem(copy.deepcopy(fp32_conv_in), dtype)
    return [name for name, on in ((FP32_STEM, stem), (FP32_HEAD, head)) if on]


class EncodeGraph(nn.Module):
    """uint8 NHWC pixels -> int64 indices. Networks in ``dtype``; quantizer in fp32.

    ``fp32_head`` (default: on for bf16) keeps the encoder's final 1x1 projection in fp32;
    ``fp32_stem`` (default: on for bf16) its first convolution.
    """

    def __init__(self, tokenizer: nn.Module, dtype: str | torch.dtype = "fp32",
                 fp32_head: bool | None = None, fp32_stem: bool | None = None):
        super().__init__()
        self.dtype = parse_dtype(dtype)
        self.factor = int(tokenizer.config.factor)
        self.encoder = _network_copy(tokenizer, "encoder", self.dtype)
        if fp32_head is None:
            fp32_head = default_fp32_ends(self.dtype)
        self.fp32_head = bool(fp32_head) and self.dtype != torch.float32
        if fp32_stem is None:
            fp32_stem = default_fp32_ends(self.dtype)
        self.fp32_stem = bool(fp32_stem) and self.dtype != torch.float32
        self.fp32_layers = keep_encoder_ends_fp32(self.encoder, tokenizer.encoder.conv_in,
                                                  tokenizer.encoder.conv_out, self.dtype,
                                                  self.fp32_head, self.fp32_stem)
        self.island = Fp32Island(_quantizer_copy(tokenizer))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # the eager model's own normalisation (fp32), then an explicit cast (the fp32 stem
        # takes the fp32 pixels and casts its own output)
        pixels = pixels_to_float(images)
        latents = self.encoder(pixels if self.fp32_stem else pixels.to(self.dtype))
        return self.island(latents.permute(0, 2, 3, 1))


class DecodeGraph(nn.Module):
    """int64 indices -> uint8 NHWC pixels. Quantizer codes in fp32; decoder in ``dtype``."""

    def __init__(self, tokenizer: nn.Module, dtype: str | torch.dtype = "fp32"):
        super().__init__()
        self.dtype = parse_dtype(dtype)
        self.factor = int(tokenizer.config.factor)
        self.island = Fp32CodesIsland(_quantizer_copy(tokenizer))
        self.decoder = _network_copy(tokenizer, "decoder", self.dtype)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        codes = self.island(indices).permute(0, 3, 1, 2)
        x = self.decoder(codes.to(self.dtype))  # border cast out of the island
        return float_to_pixels(x)  # clamp and round in fp32, as the eager model does


def build_graphs(tokenizer: nn.Module, dtype: str | torch.dtype = "fp32",
                 device: str | torch.device = "cpu",
                 fp32_head: bool | None = None,
                 fp32_stem: bool | None = None) -> tuple[EncodeGraph, DecodeGraph]:
    """Both wrappers, on ``device``, in eval mode, gradients off."""
    enc = EncodeGraph(tokenizer, dtype, fp32_head, fp32_stem).to(device).eval()
    dec = DecodeGraph(tokenizer, dtype).to(device).eval()
    return enc, dec


def example_inputs(tokenizer: nn.Module, batch: int = 2, size: int | None = None,
                   device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Example uint8 images and int64 indices for tracing / export (batch and h,w >= 2,
    so no dimension is specialised to 0 or 1)."""
    cfg = tokenizer.config
    f = cfg.factor
    size = size or 2 * f
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=g)
    shape = (batch, size // f, size // f) + ((cfg.codes_per_position,) if cfg.codes_per_position > 1 else ())
    indices = torch.randint(0, cfg.codebook_size, shape, dtype=torch.int64, generator=g)
    return images.to(device), indices.to(device)
