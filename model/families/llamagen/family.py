"""The LlamaGen VQ family: LlamaGen's VQ-8 / VQ-16 image tokenizers, imported once, served by vqserve.

LlamaGen (github.com/FoundationVision/LlamaGen) publishes its tokenizers as PyTorch pickles
(``vq_ds16_c2i.pt``, ``vq_ds8_c2i.pt``, ``vq_ds16_t2i.pt``). vqserve never unpickles them at
serving time: ``vqserve import llamagen CHECKPOINT --out DIR`` (``llamagen.importer``) reads
one with ``torch.load(weights_only=True)`` and writes a directory this family owns:

* ``config.json``: ``{"format": "vqserve-llamagen", "version": 1, <architecture>, "meta": {...}}``,
* ``model.safetensors``: the weights under vqserve's names (LlamaGen's, with ``quant_conv``
  moved into the encoder, ``post_quant_conv`` into the decoder, the codebook renamed).

The networks (``llamagen.networks``) are LlamaGen's architecture rebuilt op for op; the
quantizer (``quantizers.l2_nearest.L2NearestCode``) is its nearest-code search over an
l2-normalised codebook, in fp32 whatever the networks run in. Indices equal the original
code's in fp32 (tests/integration/families/test_llamagen.py, against fixtures made by the original).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vqserve.model.families.base import FamilyConfig
from vqserve.model.families.imported import ImportedConfig, ImportedFamily, load_strict_weights
from vqserve.model.families.llamagen.networks import GROUPS, LlamaGenDecoder, LlamaGenEncoder
from vqserve.model.quantizers.l2_nearest import L2NearestCode
from vqserve.model.tokenizer import TokenizerBase

FORMAT = "vqserve-llamagen"
VERSION = 1
WEIGHTS_NAME = "model.safetensors"
FAMILY_NAME = "llamagen"
# The LlamaGen commit whose vq_model.py this architecture follows (and the fixtures came from).
REFERENCE_COMMIT = "ce98ec41803a74a90ce68c40ababa9eaeffeb4ec"


@dataclass
class LlamaGenConfig(ImportedConfig):
    """LlamaGen's ``ModelArgs`` plus the two widths its ``VQModel`` hard-codes (``ch`` 128,
    ``num_res_blocks`` 2). The defaults are VQ-16; ``PRESETS`` has VQ-8."""

    FORMAT: ClassVar[str] = FORMAT
    VERSION: ClassVar[int] = VERSION
    LABEL: ClassVar[str] = "LlamaGen"

    encoder_ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    decoder_ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    base_channels: int = 128
    num_res_blocks: int = 2
    z_channels: int = 256
    codebook_size: int = 16384
    codebook_dim: int = 8
    codebook_l2_norm: bool = True

    def __post_init__(self) -> None:
        self.encoder_ch_mult = [int(m) for m in self.encoder_ch_mult]
        self.decoder_ch_mult = [int(m) for m in self.decoder_ch_mult]
        for name in ("base_channels", "num_res_blocks", "z_channels", "codebook_size", "codebook_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaGen config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.codebook_l2_norm, bool):
            raise ValueError(f"LlamaGen config: codebook_l2_norm must be true or false, got {self.codebook_l2_norm!r}")
        if self.codebook_size < 2:
            raise ValueError(f"LlamaGen config: codebook_size must be at least 2, got {self.codebook_size}")
        for name in ("encoder_ch_mult", "decoder_ch_mult"):
            mult = getattr(self, name)
            if not mult or min(mult) < 1:
                raise ValueError(f"LlamaGen config: {name} must be a non-empty list of positive integers, got {mult}")
            if any((self.base_channels * m) % GROUPS for m in mult):
                raise ValueError(f"LlamaGen config: base_channels x {name} must be multiples of {GROUPS} "
                                 f"(GroupNorm groups), got {[self.base_channels * m for m in mult]}")
        if len(self.encoder_ch_mult) != len(self.decoder_ch_mult):
            raise ValueError("LlamaGen config: encoder_ch_mult and decoder_ch_mult must have the same "
                             f"length (same downsampling factor), got {self.encoder_ch_mult} and {self.decoder_ch_mult}")

    @property
    def factor(self) -> int:
        return 2 ** (len(self.encoder_ch_mult) - 1)

    def family_config(self) -> FamilyConfig:
        return FamilyConfig(family=FAMILY_NAME, factor=self.factor, codebook_size=self.codebook_size,
                            latent_dim=self.codebook_dim, quantizer="vq", source=self.to_dict())


PRESETS: dict[str, LlamaGenConfig] = {
    "vq-16": LlamaGenConfig(),
    "vq-8": LlamaGenConfig(encoder_ch_mult=[1, 2, 2, 4], decoder_ch_mult=[1, 2, 2, 4]),
}


class LlamaGenTokenizer(TokenizerBase):
    """LlamaGen's VQ model as a vqserve tokenizer: same indices in fp32, the quantizer always fp32.

    ``pixel_range`` is (0, 255): the encoder receives float pixels unchanged and applies
    LlamaGen's own normalisation; the decoder returns LlamaGen's own uint8 values as floats.
    """

    pixel_range = (0.0, 255.0)

    def __init__(self, arch: LlamaGenConfig):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        common = dict(base_channels=arch.base_channels, num_res_blocks=arch.num_res_blocks,
                      z_channels=arch.z_channels, codebook_dim=arch.codebook_dim)
        self.encoder = LlamaGenEncoder(ch_mult=arch.encoder_ch_mult, **common)
        self.quantizer = L2NearestCode(arch.codebook_size, arch.codebook_dim, arch.codebook_l2_norm)
        self.decoder = LlamaGenDecoder(ch_mult=arch.decoder_ch_mult, **common)


def load_weights(tokenizer: LlamaGenTokenizer, state: dict[str, torch.Tensor], where: str) -> None:
    """Strict load with one line naming the first missing / unexpected / mis-shaped tensor."""
    load_strict_weights(tokenizer, state, where, "LlamaGen")


class LlamaGenFamily(ImportedFamily):
    name = FAMILY_NAME
    description = "LlamaGen VQ-8 / VQ-16 tokenizers, converted once by `vqserve import llamagen`"
    config_class = LlamaGenConfig
    tokenizer_class = LlamaGenTokenizer
    label = "LlamaGen"


LLAMAGEN = LlamaGenFamily()
