"""The taming family: taming-transformers VQGANs and Meta's Chameleon VQGAN, imported once, served by vqserve.

taming-transformers (github.com/CompVis/taming-transformers) publishes its VQGANs as a
Lightning ``.ckpt`` beside a yaml config (``model.params``: ``embed_dim``, ``n_embed``,
``ddconfig``): the ImageNet f16-1024 and f16-16384 models, and Meta's Chameleon image
tokenizer (``vqgan.ckpt`` + ``vqgan.yaml``, 8,192 x 256 codes, factor 16) is the same
``VQModel``: Lumina-mGPT, Anole and Liquid tell users to fetch that pair because transformers'
``ChameleonVQVAE`` has no decoder. ``vqserve import taming CKPT --config YAML --out DIR``
(``taming_import``) reads them (``torch.load(weights_only=True)``, ``yaml.safe_load``) and
writes a directory this family owns: ``config.json`` (``"format": "vqserve-taming"``) and
``model.safetensors``.

The networks are taming's ``Encoder`` / ``Decoder`` (``taming/modules/diffusionmodules/model.py``),
which LlamaGen's tokenizer also uses op for op: vqserve's rebuild of those
(``llamagen.networks``) with attention on the levels the yaml's ``attn_resolutions`` name
(none for Chameleon, 16 px for ImageNet). The quantizer is ``SquaredDistanceVQ``:
``VectorQuantizer2``'s ``sum(z^2) + sum(e^2) - 2 einsum(z, e^T)`` and first argmin, in fp32
whatever the networks run in (``quantizers.squared_distance``; transformers' Chameleon class uses
the very same expression).

Pixels, as the model's users feed it (``pixels`` in config.json, so in the model hash and the
served identity):

* ``"taming"`` (default): taming's data pipeline ``(x / 127.5 - 1).astype(float32)`` and Meta's
  Chameleon ``ImageTokenizer`` (``x / 255 * 2 - 1`` in float64, then float32) give the same
  float32 for all 256 values, which ``(2x - 255) / 255`` in fp32 reproduces;
* ``"chameleon-transformers"``: transformers' ``ChameleonImageProcessor`` (``x * 0.0078`` in
  float64 rounded to float32, then ``- 1``), for tokens equal to the transformers Chameleon
  family (``vqserve.model.families.transformers``) on the same weights.

Decoded pixels follow taming's ``custom_to_pil`` and Meta's ``_pil_from_chw_tensor`` (the same
rule): ``trunc(255 * (clamp(y, -1, 1) + 1) / 2)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vqserve.model.families.base import FamilyConfig
from vqserve.model.families.ibq.family import IbqDecoder, IbqEncoder
from vqserve.model.families.imported import ImportedConfig, ImportedFamily
from vqserve.model.families.llamagen.networks import GROUPS
from vqserve.model.quantizers.squared_distance import SquaredDistanceVQ
from vqserve.model.tokenizer import TokenizerBase

FORMAT = "vqserve-taming"
VERSION = 1
FAMILY_NAME = "taming"
# The taming-transformers commit whose model.py / quantize.py this family follows (fixtures came from it).
REFERENCE_COMMIT = "3ba01b241669f5ade541ce990f7650a3b8f65318"
# transformers' ChameleonImageProcessor: rescale_factor 0.0078, image_mean = image_std = 1
CHAMELEON_RESCALE = 0.0078
PIXEL_RULES = ("taming", "chameleon-transformers")


class TamingEncoder(IbqEncoder):
    """taming's encoder (``LlamaGenEncoder`` with attention where the yaml puts it) and
    taming's pixels, ``(2x - 255) / 255`` in fp32 (``IbqEncoder.normalise``)."""


class ChameleonProcessorEncoder(TamingEncoder):
    """The same encoder fed as transformers' ``ChameleonImageProcessor`` scales pixels."""

    @staticmethod
    def normalise(pixels: torch.Tensor) -> torch.Tensor:
        # rescale: float64 product rounded to float32, then (v - 1) / 1 in float32 (numpy's order)
        v = (pixels.contiguous().to(torch.float64) * CHAMELEON_RESCALE).to(torch.float32)
        return v - 1.0


def attention_levels(resolution: int, levels: int, attn_resolutions: list[int]) -> tuple[frozenset, frozenset]:
    """(encoder levels, decoder levels) with attention, as taming's constructors find them:
    the encoder halves ``curr_res`` from ``resolution``, the decoder doubles it from
    ``resolution // 2**(levels-1)``."""
    wanted = set(attn_resolutions)
    encoder = frozenset(i for i in range(levels) if resolution // 2 ** i in wanted)
    lowest = resolution // 2 ** (levels - 1)
    decoder = frozenset(i for i in range(levels) if lowest * 2 ** (levels - 1 - i) in wanted)
    return encoder, decoder


@dataclass
class TamingConfig(ImportedConfig):
    """taming's ``ddconfig`` (``ch``, ``ch_mult``, ``num_res_blocks``, ``z_channels``,
    ``resolution``, ``attn_resolutions``) plus ``n_embed`` / ``embed_dim`` and the pixel rule.
    The defaults are the ImageNet f16-16384 model."""

    FORMAT: ClassVar[str] = FORMAT
    VERSION: ClassVar[int] = VERSION
    LABEL: ClassVar[str] = "taming VQGAN"
    FAMILY: ClassVar[str] = FAMILY_NAME
    PIXEL_RULES: ClassVar[tuple[str, ...]] = PIXEL_RULES

    base_channels: int = 128
    ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    z_channels: int = 256
    resolution: int = 256
    attn_resolutions: list[int] = field(default_factory=lambda: [16])
    codebook_size: int = 16384
    codebook_dim: int = 256
    pixels: str = "taming"

    def __post_init__(self) -> None:
        label = self.LABEL
        for name in ("ch_mult", "attn_resolutions"):
            value = getattr(self, name)
            if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
                raise ValueError(f"{label} config: {name} must be a list of integers, got {value!r}")
        for name in ("base_channels", "num_res_blocks", "z_channels", "resolution", "codebook_size", "codebook_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} config: {name} must be a positive integer, got {value!r}")
        if self.codebook_size < 2:
            raise ValueError(f"{label} config: codebook_size must be at least 2, got {self.codebook_size}")
        if not self.ch_mult or min(self.ch_mult) < 1:
            raise ValueError(f"{label} config: ch_mult must be a non-empty list of positive integers, "
                             f"got {self.ch_mult!r}")
        widths = [self.base_channels * m for m in self.ch_mult]
        if any(w % GROUPS for w in [self.base_channels, *widths]):
            raise ValueError(f"{label} config: ch and ch x ch_mult must be multiples of {GROUPS} (GroupNorm "
                             f"groups), got {[self.base_channels, *widths]}")
        if self.pixels not in self.PIXEL_RULES:
            raise ValueError(f"{label} config: pixels must be one of {list(self.PIXEL_RULES)}, got {self.pixels!r}")

    @property
    def factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def attention(self) -> tuple[frozenset, frozenset]:
        return attention_levels(self.resolution, len(self.ch_mult), self.attn_resolutions)

    def network_args(self) -> dict:
        return dict(base_channels=self.base_channels, ch_mult=self.ch_mult, num_res_blocks=self.num_res_blocks,
                    z_channels=self.z_channels, codebook_dim=self.codebook_dim)

    def family_config(self) -> FamilyConfig:
        return FamilyConfig(family=self.FAMILY, factor=self.factor, codebook_size=self.codebook_size,
                            latent_dim=self.codebook_dim, quantizer="vq", source=self.to_dict())


# The published configurations: taming's configs/imagenet_vqgan.yaml (and the f16-1024 model's
# config beside its checkpoint), and Meta's Chameleon vqgan.yaml (transformers'
# ChameleonVQVAEConfig documents the same architecture: ch 128, ch_mult [1,1,2,2,4], 2 blocks,
# z 256, resolution 512, no attention outside the middle).
PRESETS: dict[str, TamingConfig] = {
    "imagenet-f16-16384": TamingConfig(),
    "imagenet-f16-1024": TamingConfig(codebook_size=1024),
    "chameleon": TamingConfig(resolution=512, attn_resolutions=[], codebook_size=8192),
}


class TamingTokenizer(TokenizerBase):
    """A taming VQGAN as a vqserve tokenizer: the same indices in fp32, the search always fp32."""

    pixel_range = (0.0, 255.0)

    def __init__(self, arch: TamingConfig):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        encoder_attention, decoder_attention = arch.attention
        encoder_class = ChameleonProcessorEncoder if arch.pixels == "chameleon-transformers" else TamingEncoder
        self.encoder = encoder_class(attention_levels=encoder_attention, **arch.network_args())
        self.quantizer = SquaredDistanceVQ(arch.codebook_size, arch.codebook_dim, product="einsum")
        self.decoder = IbqDecoder(attention_levels=decoder_attention, **arch.network_args())


class TamingFamily(ImportedFamily):
    name = FAMILY_NAME
    description = ("taming-transformers VQGANs and Meta's Chameleon VQGAN (.ckpt + yaml), converted once by "
                   "`vqserve import taming`")
    config_class = TamingConfig
    tokenizer_class = TamingTokenizer
    label = "taming VQGAN"


TAMING = TamingFamily()
