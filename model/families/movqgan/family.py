"""The MoVQGAN family: ai-forever's SBER-MoVQGAN 67M / 102M / 270M, imported once, served by vqserve.

SBER-MoVQGAN (github.com/ai-forever/MoVQGAN; Lumina-mGPT 2.0's image tokenizer) publishes
``movqgan_67M.ckpt``, ``movqgan_102M.ckpt`` and ``movqgan_270M.ckpt``: state dicts of its ``MOVQ`` model, a taming VQGAN (16,384 codes of 4
dimensions, factor 8) whose decoder normalises spatially by the codes
(``movqgan_networks``). ``vqserve import movqgan CKPT --out DIR [--config YAML]``
(``movqgan_import``) reads one with ``torch.load(weights_only=True)`` and writes
``config.json`` (``"format": "vqserve-movqgan"``) + ``model.safetensors``; the architecture
comes from the yaml (``configs/movqgan_*.yaml`` of the repository) or, without one, from the
one published configuration whose tensor shapes the checkpoint has.

The encoder is taming's (``llamagen.networks`` with attention at 32 px); the quantizer is
MoVQGAN's ``VectorQuantizer2`` (taming's: ``sum(z^2) + sum(e^2) - 2 einsum(z, e^T)``, first
argmin), run by ``SquaredDistanceVQ`` in fp32, not diffusers' ``cdist`` (whose square root
merges near ties differently). Pixels as the repository's inference notebook feeds them:
``x.astype(float32) / 127.5 - 1`` (float32 arithmetic), and decoded pixels by its
``show_images``: ``round((y + 1) * 127.5)`` clamped to [0, 255]. Any batch and grid size
encode and decode (the original's ``decode_code`` is fixed to one 32x32 grid).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vqserve.model.families.imported import ImportedFamily
from vqserve.model.families.llamagen.networks import LlamaGenEncoder
from vqserve.model.families.movqgan.networks import MovqDecoder
from vqserve.model.families.taming.family import TamingConfig
from vqserve.model.quantizers.squared_distance import SquaredDistanceVQ
from vqserve.model.tokenizer import TokenizerBase

FORMAT = "vqserve-movqgan"
VERSION = 1
FAMILY_NAME = "movqgan"
# The ai-forever/MoVQGAN commit whose movq_modules.py / vqvae_blocks.py this family follows.
REFERENCE_COMMIT = "f3976d8752826c6ba003cfee8790e91ea23c57e8"


class MovqEncoder(LlamaGenEncoder):
    """taming's encoder with MoVQGAN's pixels: ``x / 127.5 - 1`` in float32 (its notebook)."""

    @staticmethod
    def normalise(pixels: torch.Tensor) -> torch.Tensor:
        return pixels.to(torch.float32).contiguous() / 127.5 - 1.0


@dataclass
class MovqganConfig(TamingConfig):
    """MoVQGAN's ``ddconfig`` + ``n_embed`` / ``embed_dim``; the defaults are the 67M model."""

    FORMAT: ClassVar[str] = FORMAT
    VERSION: ClassVar[int] = VERSION
    LABEL: ClassVar[str] = "SBER-MoVQGAN"
    FAMILY: ClassVar[str] = FAMILY_NAME
    PIXEL_RULES: ClassVar[tuple[str, ...]] = ("movqgan",)

    base_channels: int = 128
    ch_mult: list[int] = field(default_factory=lambda: [1, 2, 2, 4])
    num_res_blocks: int = 2
    z_channels: int = 4
    resolution: int = 256
    attn_resolutions: list[int] = field(default_factory=lambda: [32])
    codebook_size: int = 16384
    codebook_dim: int = 4
    pixels: str = "movqgan"


# movqgan/__init__.py MODELS (and configs/movqgan_*.yaml) at REFERENCE_COMMIT
PRESETS: dict[str, MovqganConfig] = {
    "67M": MovqganConfig(),
    "102M": MovqganConfig(num_res_blocks=4),
    "270M": MovqganConfig(base_channels=256),
}


class MovqganTokenizer(TokenizerBase):
    """SBER-MoVQGAN as a vqserve tokenizer: the same indices in fp32, the search always fp32."""

    pixel_range = (0.0, 255.0)

    def __init__(self, arch: MovqganConfig):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        encoder_attention, decoder_attention = arch.attention
        self.encoder = MovqEncoder(attention_levels=encoder_attention, **arch.network_args())
        self.quantizer = SquaredDistanceVQ(arch.codebook_size, arch.codebook_dim, product="einsum")
        self.decoder = MovqDecoder(attention_levels=decoder_attention, **arch.network_args())


class MovqganFamily(ImportedFamily):
    name = FAMILY_NAME
    description = "SBER-MoVQGAN 67M / 102M / 270M (ai-forever), converted once by `vqserve import movqgan`"
    config_class = MovqganConfig
    tokenizer_class = MovqganTokenizer
    label = "SBER-MoVQGAN"


MOVQGAN = MovqganFamily()
