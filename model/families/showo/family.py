"""The Show-o family: Show-o / MMaDA's MAGVIT-v2 tokenizer (HF ``showlab/magvitv2``), imported once.

Show-o (github.com/showlab/Show-o) and MMaDA tokenize images with ``showlab/magvitv2``: a
diffusers-style folder, ``config.json`` (``{"_class_name": "MAGVITv2", ...}``: the class takes
no arguments, so the architecture is the code's defaults) and ``pytorch_model.safetensors``.
``vqserve import showo FOLDER --out DIR`` (``showo_import``) checks every tensor of it and
writes a directory this family owns: ``config.json`` (``"format": "vqserve-showo"``) and
``model.safetensors``.

The networks are taming's VQGAN laid out as Show-o does (``showo_networks``). The quantizer
is vqserve's LFQ in fp32 with Show-o's index convention: 13 bits = 8,192 codes, channel 0
the **most** significant bit (``LFQuantizer.power_vals = 2^[12..0]``; Open-MAGVIT2 is the
other way round), and Show-o's sign test (``ShowoLFQ``). Indices equal the original code's in
fp32 (tests/integration/families/test_showo.py, against fixtures made by the original).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vqserve.model.families.imported import ImportedConfig, ImportedFamily, LfqArchitecture
from vqserve.model.families.llamagen.networks import GROUPS
from vqserve.model.families.showo.networks import ShowoDecoder, ShowoEncoder
from vqserve.model.quantizers.lfq import LFQ
from vqserve.model.tokenizer import TokenizerBase

FORMAT = "vqserve-showo"
VERSION = 1
FAMILY_NAME = "showo"
LABEL = "Show-o MAGVIT-v2"
# The showlab/Show-o commit whose models/modeling_magvitv2.py this family follows (and the fixtures came from).
REFERENCE_COMMIT = "45a5a2de01d1ebd10cd5864d29310a76476cdf23"
MAX_BITS = 30  # vqserve's LFQ limit (int64 indices)


class ShowoLFQ(LFQ):
    """Show-o's ``LFQuantizer`` as an fp32 island: most significant bit first, and its bit test.

    The original computes the straight-through value even in eval, ``z_q = z + (q - z)`` with
    ``q = +-1``, and takes ``z_q > 0`` as the bit (``get_indices``). In fp32 that is ``z > 0``
    except where ``q - z`` rounds to ``-z``: a latent ``z >= ~2^25`` (and ``+inf``, where
    ``inf - inf`` is NaN) gives bit 0 there. Rare, but exact is exact: ``bits`` is that very
    expression. Codes are ``+-1`` (the original's ``embedding`` buffer, checked at import).
    Inference only, so no entropy codebook is built."""

    def __init__(self, dim: int):
        super().__init__(dim, entropy_loss_weight=0.0, commitment_loss_weight=0.0, max_entropy_codebook=0,
                         bit_order="msb_first")

    def bits(self, z32: torch.Tensor) -> torch.Tensor:
        quantized = torch.where(z32 > 0, 1.0, -1.0).to(torch.float32)
        return (z32 + (quantized - z32)) > 0


def _positive_ints(name: str, values: list, length: int | None = None) -> list[int]:
    if not isinstance(values, list) or not values or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{LABEL} config: {name} must be a non-empty list of positive integers, got {values!r}")
    if length is not None and len(values) != length:
        raise ValueError(f"{LABEL} config: {name} must have {length} entries (one per level), got {values!r}")
    return [int(v) for v in values]


@dataclass
class ShowoConfig(LfqArchitecture, ImportedConfig):
    """What shapes the weights. The defaults are ``MAGVITv2()``'s (its ``VQGANEncoder()`` and
    ``VQGANDecoder()`` defaults: ch 128, 13 latent channels), the only published configuration."""

    FAMILY: ClassVar[str] = FAMILY_NAME
    FORMAT: ClassVar[str] = FORMAT
    VERSION: ClassVar[int] = VERSION
    LABEL: ClassVar[str] = LABEL

    base_channels: int = 128
    encoder_ch_mult: list[int] = field(default_factory=lambda: [1, 2, 2, 4, 4])
    encoder_blocks: list[int] = field(default_factory=lambda: [4, 3, 4, 3, 4])
    decoder_ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    decoder_blocks: list[int] = field(default_factory=lambda: [4, 4, 3, 4, 3])
    z_channels: int = 13

    def __post_init__(self) -> None:
        for name in ("base_channels", "z_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{LABEL} config: {name} must be a positive integer, got {value!r}")
        if self.z_channels > MAX_BITS:
            raise ValueError(f"{LABEL} config: z_channels (LFQ bits) must be at most {MAX_BITS}, got {self.z_channels}")
        self.encoder_ch_mult = _positive_ints("encoder_ch_mult", self.encoder_ch_mult)
        levels = len(self.encoder_ch_mult)
        self.encoder_blocks = _positive_ints("encoder_blocks", self.encoder_blocks, levels)
        self.decoder_ch_mult = _positive_ints("decoder_ch_mult", self.decoder_ch_mult, levels)
        self.decoder_blocks = _positive_ints("decoder_blocks", self.decoder_blocks, levels)
        widths = [self.base_channels * m for m in (1, *self.encoder_ch_mult, *self.decoder_ch_mult)]
        if any(w % GROUPS for w in widths):
            raise ValueError(f"{LABEL} config: base_channels and base_channels x ch_mult must be multiples of "
                             f"{GROUPS} (GroupNorm groups), got {sorted(set(widths))}")

    @property
    def factor(self) -> int:
        return 2 ** (len(self.encoder_ch_mult) - 1)


# showlab/magvitv2: MAGVITv2() takes no arguments, so this is its one architecture (factor 16).
PRESETS: dict[str, ShowoConfig] = {"magvitv2": ShowoConfig()}


class ShowoTokenizer(TokenizerBase):
    """Show-o's MAGVIT-v2 as a vqserve tokenizer: the same indices in fp32, LFQ always fp32."""

    pixel_range = (0.0, 255.0)

    def __init__(self, arch: ShowoConfig):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        self.encoder = ShowoEncoder(arch.base_channels, arch.encoder_ch_mult, arch.encoder_blocks, arch.z_channels)
        self.quantizer = ShowoLFQ(arch.z_channels)
        self.decoder = ShowoDecoder(arch.base_channels, arch.decoder_ch_mult, arch.decoder_blocks, arch.z_channels)


class ShowoFamily(ImportedFamily):
    name = FAMILY_NAME
    description = "Show-o / MMaDA MAGVIT-v2 (showlab/magvitv2, LFQ 8,192 codes), converted once by `vqserve import showo`"
    config_class = ShowoConfig
    tokenizer_class = ShowoTokenizer
    label = LABEL


SHOWO = ShowoFamily()
