"""Tokenizer: encoder -> fp32 quantizer island -> decoder, with uint8 and float paths.

``encode(uint8 [B,H,W,3]) -> int64 [B,H/f,W/f]`` (``[..., Q]`` for residual FSQ) and
``decode(indices) -> uint8 [B,H,W,3]`` are the serving paths; ``forward`` is the float
training path. Every input is checked with an error that names the rule it broke.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from vqserve.core.input_rules import (  # noqa: F401 - re-exported: the model's input rules
    DecodeUnsupported,
    check_image_batch,
    check_index_shape,
    check_spatial,
    decode_unsupported,
    index_range_text,
)
from vqserve.core.token_layout import TokenLayout
from vqserve.model.config import TokenizerConfig
from vqserve.model.networks import Decoder, Encoder
from vqserve.model.precision import cast_to, module_dtype
from vqserve.model.quantizers import FSQ, LFQ, VQ, ResidualFSQ


def build_quantizer(config: TokenizerConfig) -> nn.Module:
    if config.quantizer == "fsq":
        return FSQ(config.levels, dither=config.dither)
    if config.quantizer == "rfsq":
        return ResidualFSQ(config.levels, config.num_quantizers)
    if config.quantizer == "lfq":
        return LFQ(config.lfq_dim)
    return VQ(config.vq_codebook_size, config.vq_dim)


def _as_tensor(x, what: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if torch.is_tensor(x):
        return x
    raise ValueError(f"{what} must be a torch.Tensor or numpy array, got {type(x).__name__}")


PixelRange = tuple[float, float]
SIGNED_UNIT: PixelRange = (-1.0, 1.0)  # what vqserve's own networks (and most VQ models) see


def pixels_to_float(images: torch.Tensor, pixel_range: PixelRange = SIGNED_UNIT) -> torch.Tensor:
    """uint8 NHWC -> fp32 NCHW in ``pixel_range`` (computed in fp32, cast later by each network).

    [-1, 1] keeps the exact arithmetic vqserve has always used, so tokens of existing
    checkpoints and exports do not move by one ulp."""
    x = images.permute(0, 3, 1, 2).to(torch.float32)
    low, high = pixel_range
    if (low, high) == SIGNED_UNIT:
        return x / 127.5 - 1.0
    return x * ((high - low) / 255.0) + low


def float_to_pixels(x: torch.Tensor, pixel_range: PixelRange = SIGNED_UNIT) -> torch.Tensor:
    """float NCHW ~``pixel_range`` -> uint8 NHWC, clamped and rounded in fp32."""
    x = x.to(torch.float32)
    low, high = pixel_range
    if (low, high) == SIGNED_UNIT:
        x = (x + 1.0) * 127.5
    else:
        x = (x - low) * (255.0 / (high - low))
    x = x.clamp(0, 255).round()
    return x.to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class TokenizerBase(nn.Module):
    """encoder -> fp32 quantizer island -> decoder, with the uint8 serving paths.

    Everything downstream (exports, runtimes, the server, ``vqserve tokenize``/``eval``)
    relies only on what this class holds, so a model family (``vqserve.model.families``)
    subclasses it and supplies three modules and a config:

    * ``encoder``: float NCHW pixels in ``pixel_range`` -> latents NCHW. It casts its input
      to its own parameter dtype (the dtype door), since it may run in bf16/fp16;
    * ``quantizer``: an fp32-island module like ``vqserve.model.quantizers.VQ``:
      ``forward(z_nhwc, return_aux=False) -> (codes, indices[, aux])``,
      ``indices_to_codes(indices, dtype)``, ``check_indices(indices)``, ``codebook_size``;
    * ``decoder``: codes NCHW -> float NCHW pixels ~``pixel_range`` (also with a door), or
      None for an encode-only model (its original has no decoder): ``decodes`` is then
      False and ``decode`` raises ``DecodeUnsupported`` naming ``no_decoder_reason``;
    * ``config``: ``factor``, ``codes_per_position``, ``codebook_size``, ``latent_dim``,
      ``quantizer``, ``levels`` and ``to_dict()``.
    """

    config: Any  # TokenizerConfig, or a family's config with the same facts
    pixel_range: PixelRange = SIGNED_UNIT  # what ``encoder`` takes and ``decoder`` returns
    no_decoder_reason: str = "it has no decoder"  # why ``decoder`` is None, for the one-line refusal

    # -- facts ---------------------------------------------------------------------------
    @property
    def factor(self) -> int:
        return self.config.factor

    @property
    def codebook_size(self) -> int:
        return self.quantizer.codebook_size

    @property
    def token_layout(self) -> TokenLayout:
        """The per-image token shape (``vqserve.core.token_layout``): a grid ``[h, w(, Q)]``
        here; a multi-scale family (VAR) returns its pyramid."""
        return TokenLayout(factor=self.factor, codes_per_position=self.config.codes_per_position)

    @property
    def decodes(self) -> bool:
        """False for an encode-only model: indices out, but no way back to pixels."""
        return self.decoder is not None

    @property
    def compute_dtype(self) -> torch.dtype:
        # the decoder's: a bf16 encoder may keep its stem in fp32 (vqserve.model.mixed_precision)
        return module_dtype(self.decoder if self.decoder is not None else self.encoder)

    def refuse_decode(self) -> None:
        """Raise ``DecodeUnsupported`` (one line) when this model cannot decode."""
        if not self.decodes:
            raise decode_unsupported(getattr(self.config, "family", "this model"), self.no_decoder_reason)

    @property
    def device(self) -> torch.device:
        return next(self.encoder.parameters()).device

    # -- float paths (training, export) -------------------------------------------------
    def encode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """float NCHW pixels in ``pixel_range`` -> pre-quantizer latents NCHW (network dtype)."""
        return self.encoder(x)

    def quantize(self, latents: torch.Tensor, return_aux: bool = False):
        """latents NCHW -> (codes NCHW in latents' dtype, indices [B,h,w(,Q)][, aux])."""
        out = self.quantizer(latents.permute(0, 2, 3, 1), return_aux=return_aux)
        codes = out[0].permute(0, 3, 1, 2)
        return (codes, *out[1:])

    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        self.refuse_decode()
        return self.decoder(codes)

    def indices_to_codes(self, indices: torch.Tensor) -> torch.Tensor:
        """indices [B,h,w(,Q)] -> codes NCHW in the decoder's dtype."""
        codes = self.quantizer.indices_to_codes(indices)
        return cast_to(codes.permute(0, 3, 1, 2), self.compute_dtype)

    def forward(self, x: torch.Tensor, return_aux: bool = True):
        """Training path: float NCHW -> (reconstruction, indices, aux losses)."""
        codes, indices, aux = self.quantize(self.encode_latents(x), return_aux=True)
        recon = self.decode_codes(codes)
        return (recon, indices, aux) if return_aux else (recon, indices)

    def encode_float(self, x: torch.Tensor) -> torch.Tensor:
        """float NCHW [-1,1] (any float dtype) -> indices, with the same checks as ``encode``."""
        x = _as_tensor(x, "images")
        if not x.is_floating_point():
            raise ValueError(f"encode_float expects floating-point pixels, got {x.dtype}")
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"encode_float expects [B,3,H,W], got shape {tuple(x.shape)}")
        self._check_spatial(x.shape[2], x.shape[3])
        with torch.no_grad():
            return self.quantize(self.encode_latents(x))[1]

    # -- uint8 serving paths -------------------------------------------------------------
    def check_images(self, images) -> torch.Tensor:
        images = _as_tensor(images, "images")
        check_image_batch(tuple(images.shape), images.dtype == torch.uint8, str(images.dtype),
                          self.factor, hint=" (use encode_float for float pixels)")
        if not self.token_layout.is_grid:  # a pyramid / sequence takes its own sizes only
            self._check_spatial(images.shape[1], images.shape[2])
        return images

    def _check_spatial(self, h: int, w: int) -> None:
        layout = self.token_layout
        if layout.is_grid:
            check_spatial(h, w, self.factor)
        elif rule := layout.size_rule(h, w):
            raise ValueError(f"images: {rule}")

    def check_indices(self, indices) -> torch.Tensor:
        indices = _as_tensor(indices, "indices")
        layout = self.token_layout
        if layout.is_grid:
            check_index_shape(tuple(indices.shape), self.config.codes_per_position)
            self.quantizer.check_indices(indices)
            return indices
        # a pyramid / sequence: [B, L] with an L the layout accepts
        if indices.is_floating_point() or indices.dtype == torch.bool:
            raise ValueError(f"indices must be an integer tensor, got {indices.dtype}")
        if rule := layout.shape_rule(tuple(indices.shape)):
            raise ValueError(f"indices {rule}")
        if indices.shape[0] == 0:
            raise ValueError(f"indices is empty, got shape {tuple(indices.shape)}")
        if rule := index_range_text(int(indices.min()), int(indices.max()), self.codebook_size):
            raise ValueError(f"indices: {rule}")
        return indices

    @torch.no_grad()
    def encode(self, images) -> torch.Tensor:
        """uint8 ``[B,H,W,3]`` -> int64 indices ``[B,H/f,W/f]`` (``[...,Q]`` for residual)."""
        images = self.check_images(images).to(self.device)
        latents = self.encode_latents(pixels_to_float(images, self.pixel_range))
        return self.quantize(latents)[1]

    @torch.no_grad()
    def decode(self, indices) -> torch.Tensor:
        """integer indices ``[B,h,w]`` -> uint8 ``[B,h*f,w*f,3]``; out-of-range is a ValueError
        (``DecodeUnsupported`` for an encode-only model)."""
        self.refuse_decode()
        indices = self.check_indices(indices).to(self.device)
        return float_to_pixels(self.decode_codes(self.indices_to_codes(indices)), self.pixel_range)


class Tokenizer(TokenizerBase):
    """vqserve's own tokenizer: ``vqserve.model.networks`` around an FSQ/LFQ/VQ/RFSQ quantizer."""

    def __init__(self, config: TokenizerConfig):
        super().__init__()
        self.config = config
        dim = config.latent_dim
        self.encoder = Encoder(config.channels, config.num_res_blocks, dim,
                               config.attention, config.attention_heads, config.patch_size,
                               norm=config.norm)
        self.quantizer = build_quantizer(config)
        self.decoder = Decoder(config.channels, config.num_res_blocks, dim,
                               config.attention, config.attention_heads, config.patch_size,
                               norm=config.norm)
