"""The IBQ family: TencentARC's Index Backpropagation Quantization tokenizers, imported once, served by vqserve.

IBQ (github.com/TencentARC/SEED-Voken, ``src/IBQ``; rFID 1.00 on ImageNet 256 with 262,144
codes) publishes Lightning ``.ckpt`` pickles (``imagenet256_{1024,8192,16384,262144}.ckpt``,
``IBQ_pretrain_{16384,262144}.ckpt``). ``vqserve import ibq CHECKPOINT --out DIR``
(``ibq.importer``) reads one with ``torch.load(weights_only=True)`` and writes a directory
this family owns: ``config.json`` (``"format": "vqserve-ibq"``) and ``model.safetensors``.

The networks are the taming-transformers VQGAN encoder and decoder, which LlamaGen's
tokenizer also uses, op for op: vqserve reuses its rebuild (``llamagen.networks``) with
IBQ's tensors renamed onto it (taming's names, ``vqserve.model.families.taming.layout``), attention on the lowest resolution
only (``attn_resolutions: [16]`` at 256 px, every published config). Only the two ends
differ, because IBQ's scripts differ from LlamaGen's: pixels are normalised as
``(image / 127.5 - 1.0)`` in float64 (numpy) then float32, which ``(2x - 255) / 255`` in
fp32 reproduces for all 256 values, and decoded pixels follow ``custom_to_pil``:
``trunc(255 * (clamp(y, -1, 1) + 1) / 2)``. The quantizer is ``SoftmaxMaxVQ``: IBQ's
``max(softmax(z . codebook))`` in fp32 (``quantizers.softmax_max``).

Emu3.5's VisionTokenizer (baaivision/Emu3.5, ``src/vision_tokenizer``) is this model: the same
taming encoder/decoder, ``quant_conv``/``post_quant_conv`` and ``IndexPropagationQuantize``
(131,072 x 256 codes), so it is a preset of this family (``vqserve import emu35``,
``model/families/ibq/emu35.py``), not a copy. Two things differ, both fields here:
``attention_levels`` (taming's ``attn_resolutions`` read from its ``config.yaml``; None is
the lowest resolution, every SEED-Voken config) and ``pixel_rule``: Emu3.5 turns decoder
output into pixels as ``trunc(clamp((y + 1) * 127.5, 0, 255))`` (``decode_image``), not
``custom_to_pil``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vqserve.model.families.base import FamilyConfig
from vqserve.model.families.imported import ImportedConfig, ImportedFamily, load_strict_weights
from vqserve.model.families.llamagen.networks import GROUPS, LlamaGenDecoder, LlamaGenEncoder
from vqserve.model.quantizers.softmax_max import SoftmaxMaxVQ
from vqserve.model.tokenizer import TokenizerBase

FORMAT = "vqserve-ibq"
VERSION = 1
WEIGHTS_NAME = "model.safetensors"
FAMILY_NAME = "ibq"
# The SEED-Voken commit whose IBQ code this family follows (and the fixtures came from).
REFERENCE_COMMIT = "b9a17eac8e2c0779c12a5429b0bfd6c502788484"


class IbqEncoder(LlamaGenEncoder):
    """The taming encoder (``LlamaGenEncoder``) with IBQ's input normalisation."""

    @staticmethod
    def normalise(pixels: torch.Tensor) -> torch.Tensor:
        # IBQ's data pipeline: (x / 127.5 - 1.0) in float64, then float32; contiguous NCHW
        return (pixels.to(torch.float32).contiguous() * 2.0 - 255.0) / 255.0


class IbqDecoder(LlamaGenDecoder):
    """The taming decoder (``LlamaGenDecoder``) with IBQ's uint8 rule (``custom_to_pil``)."""

    @staticmethod
    def to_pixels(y: torch.Tensor) -> torch.Tensor:
        # IBQ's custom_to_pil, floored; the network itself is LlamaGen's, contiguous NCHW codes in
        return torch.floor(((torch.clamp(y, -1.0, 1.0) + 1.0) / 2.0) * 255.0)


class Emu35Decoder(IbqDecoder):
    """The same decoder with Emu3.5's uint8 rule (``src/utils/generation_utils.decode_image``)."""

    @staticmethod
    def to_pixels(y: torch.Tensor) -> torch.Tensor:
        # ((image + 1.0) * 127.5).clamp(0, 255) in fp32, then numpy astype(uint8): truncation
        return torch.floor(torch.clamp((y + 1.0) * 127.5, 0.0, 255.0))


DECODERS = {"custom_to_pil": IbqDecoder, "emu3.5": Emu35Decoder}  # pixel_rule -> decoder


@dataclass
class IbqConfig(ImportedConfig):
    """IBQ's ``ddconfig`` (``ch``, ``ch_mult``, ``num_res_blocks``, ``z_channels``) plus
    ``n_embed`` and ``embed_dim``. The defaults are the ImageNet 262,144-code model."""

    FORMAT: ClassVar[str] = FORMAT
    VERSION: ClassVar[int] = VERSION
    LABEL: ClassVar[str] = "IBQ"

    base_channels: int = 128
    ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 4
    z_channels: int = 256
    codebook_size: int = 262144
    codebook_dim: int = 256
    attention_levels: list[int] | None = None  # levels with attention; None: the lowest only
    pixel_rule: str = "custom_to_pil"  # how decoder output becomes pixels: DECODERS

    def __post_init__(self) -> None:
        self.ch_mult = [int(m) for m in self.ch_mult] if isinstance(self.ch_mult, list) else self.ch_mult
        for name in ("base_channels", "num_res_blocks", "z_channels", "codebook_size", "codebook_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"IBQ config: {name} must be a positive integer, got {value!r}")
        if self.codebook_size < 2:
            raise ValueError(f"IBQ config: codebook_size must be at least 2, got {self.codebook_size}")
        if not isinstance(self.ch_mult, list) or not self.ch_mult or min(self.ch_mult) < 1:
            raise ValueError(f"IBQ config: ch_mult must be a non-empty list of positive integers, got {self.ch_mult!r}")
        widths = [self.base_channels * m for m in self.ch_mult]
        if any(w % GROUPS for w in [self.base_channels, *widths]):
            raise ValueError(f"IBQ config: base_channels and base_channels x ch_mult must be multiples of "
                             f"{GROUPS} (GroupNorm groups), got {[self.base_channels, *widths]}")
        if self.attention_levels is not None and (
                not isinstance(self.attention_levels, list)
                or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < len(self.ch_mult)
                       for v in self.attention_levels)):
            raise ValueError(f"IBQ config: attention_levels must be null or a list of levels 0..{len(self.ch_mult) - 1}, "
                             f"got {self.attention_levels!r}")
        if self.pixel_rule not in DECODERS:
            raise ValueError(f"IBQ config: pixel_rule must be one of {sorted(DECODERS)}, got {self.pixel_rule!r}")

    @property
    def factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def family_config(self) -> FamilyConfig:
        return FamilyConfig(family=FAMILY_NAME, factor=self.factor, codebook_size=self.codebook_size,
                            latent_dim=self.codebook_dim, quantizer="vq", source=self.to_dict())


# The published checkpoints' configurations (configs/IBQ/gpu/*.yaml at REFERENCE_COMMIT): all
# ch 128, ch_mult [1,1,2,2,4], 4 blocks, z 256, embed_dim 256, attention at 16 px.
PRESETS: dict[str, IbqConfig] = {
    f"{kind}-{n}": IbqConfig(codebook_size=n)
    for kind, sizes in (("imagenet", (1024, 8192, 16384, 262144)), ("pretrain", (16384, 262144)))
    for n in sizes
}


class IbqTokenizer(TokenizerBase):
    """IBQ's tokenizer as a vqserve tokenizer: the same indices in fp32, the search always fp32."""

    pixel_range = (0.0, 255.0)

    def __init__(self, arch: IbqConfig):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        common = dict(base_channels=arch.base_channels, ch_mult=arch.ch_mult, num_res_blocks=arch.num_res_blocks,
                      z_channels=arch.z_channels, codebook_dim=arch.codebook_dim,
                      attention_levels=arch.attention_levels)
        self.encoder = IbqEncoder(**common)
        self.quantizer = SoftmaxMaxVQ(arch.codebook_size, arch.codebook_dim)
        self.decoder = DECODERS[arch.pixel_rule](**common)


def load_weights(tokenizer: IbqTokenizer, state: dict[str, torch.Tensor], where: str) -> None:
    """Strict load with one line naming the first missing / unexpected / mis-shaped tensor."""
    load_strict_weights(tokenizer, state, where, "IBQ")


class IbqFamily(ImportedFamily):
    name = FAMILY_NAME
    description = "IBQ tokenizers (TencentARC SEED-Voken), converted once by `vqserve import ibq`"
    config_class = IbqConfig
    tokenizer_class = IbqTokenizer
    label = "IBQ"


IBQ = IbqFamily()
