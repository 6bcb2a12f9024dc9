"""Self-contained encode / decode modules: the exact graphs every exported format holds.

``EncodeGraph``: uint8 ``[B,H,W,3]`` -> int64 indices ``[B,H/f,W/f]`` (``[...,Q]`` residual).
``DecodeGraph``: int64 indices -> uint8 ``[B,H,W,3]``.

Normalisation, NHWC<->NCHW layout, clamping and rounding all live inside the graph, so an
artifact needs no Python around it. The networks run in the export dtype; the quantizer
runs inside ``Fp32Island``, a submodule of its own whose first op is an explicit cast to
float32 and whose output is integer indices (encode) or float32 codes (decode). Because
the island is a named submodule (``island``), every format keeps it identifiable: ONNX
name scopes, TorchScript submodules and torch.export ``nn_module_stack`` all say
``island``, which is what ``vqserve.export.formats.inspect_graph`` checks.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from vqserve.model.mixed_precision import low_precision_encoder
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


class EncodeGraph(nn.Module):
    """uint8 NHWC pixels -> int64 indices. Networks in ``dtype``; quantizer in fp32.

    ``fp32_stream`` (default: on for bf16 and fp16) runs only the residual branches' convolutions in
    ``dtype`` and keeps the encoder's residual stream, norms, stem, downsample and final
    projection in fp32 (``vqserve.model.mixed_precision``); ``fp32_layers`` names the
    convolutions it kept in fp32.
    """

    def __init__(self, tokenizer: nn.Module, dtype: str | torch.dtype = "fp32",
                 fp32_stream: bool | None = None):
        super().__init__()
        self.dtype = parse_dtype(dtype)
        self.factor = int(tokenizer.config.factor)
        self.pixel_range = tuple(tokenizer.pixel_range)
        self.encoder, kept = low_precision_encoder(tokenizer.encoder, self.dtype, fp32_stream)
        self.fp32_layers = [f"encoder.{name}" for name in kept]
        self.island = Fp32Island(_quantizer_copy(tokenizer))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # the eager model's own normalisation (fp32); the encoder's door casts it explicitly
        # to its first convolution's dtype (fp32 under the fp32-stream policy)
        latents = self.encoder(pixels_to_float(images, self.pixel_range))
        return self.island(latents.permute(0, 2, 3, 1))


class DecodeGraph(nn.Module):
    """int64 indices -> uint8 NHWC pixels. Quantizer codes in fp32; decoder in ``dtype``."""

    def __init__(self, tokenizer: nn.Module, dtype: str | torch.dtype = "fp32"):
        super().__init__()
        self.dtype = parse_dtype(dtype)
        self.factor = int(tokenizer.config.factor)
        self.pixel_range = tuple(tokenizer.pixel_range)
        self.island = Fp32CodesIsland(_quantizer_copy(tokenizer))
        self.decoder = _network_copy(tokenizer, "decoder", self.dtype)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        codes = self.island(indices).permute(0, 3, 1, 2)
        x = self.decoder(codes.to(self.dtype))  # border cast out of the island
        return float_to_pixels(x, self.pixel_range)  # clamp and round in fp32, as the eager model does


def build_graphs(tokenizer: nn.Module, dtype: str | torch.dtype = "fp32",
                 device: str | torch.device = "cpu",
                 fp32_stream: bool | None = None) -> tuple[EncodeGraph, DecodeGraph | None]:
    """Both wrappers, on ``device``, in eval mode, gradients off (no decode graph for an
    encode-only model: ``tokenizer.decoder`` is None)."""
    enc = EncodeGraph(tokenizer, dtype, fp32_stream).to(device).eval()
    dec = DecodeGraph(tokenizer, dtype).to(device).eval() if tokenizer.decoder is not None else None
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
