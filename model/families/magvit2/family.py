"""The Open-MAGVIT2 family: TencentARC's LFQ image tokenizers (2^18 codes), imported once, served by vqserve.

Open-MAGVIT2 (github.com/TencentARC/SEED-Voken, formerly TencentARC/Open-MAGVIT2) publishes
its tokenizers as Lightning ``.ckpt`` pickles (``imagenet_256_L.ckpt``, ``imagenet_128_L.ckpt``,
``pretrain256_262144.ckpt``, ``pretrain256_16384.ckpt``). vqserve never unpickles them at
serving time: ``vqserve import magvit2 CHECKPOINT --out DIR`` (``magvit2.importer``) reads one
with ``torch.load(weights_only=True)`` and writes a directory this family owns:

* ``config.json``: ``{"format": "vqserve-magvit2", "version": 1, <architecture>, "meta": {...}}``,
* ``model.safetensors``: the encoder and decoder weights under the original's names (the
  LFQ quantizer has no weights: its codebook is the corners of the hypercube).

The networks (``magvit2.networks``) are the original's, rebuilt op for op; the quantizer is
vqserve's LFQ in fp32 with Open-MAGVIT2's bit order (``bit_order="lsb_first"``). Indices equal the
original code's in fp32 (tests/integration/families/test_magvit2.py, against fixtures made by the original).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vqserve.model.families.imported import (
    ImportedConfig,
    ImportedFamily,
    LfqArchitecture,
    load_strict_weights,
)
from vqserve.model.families.magvit2.networks import GROUPS, Magvit2Decoder, Magvit2Encoder
from vqserve.model.quantizers.lfq import LFQ
from vqserve.model.tokenizer import TokenizerBase

FORMAT = "vqserve-magvit2"
VERSION = 1
WEIGHTS_NAME = "model.safetensors"
FAMILY_NAME = "magvit2"
# The SEED-Voken commit whose Open-MAGVIT2 code this architecture follows (and the fixtures came from).
REFERENCE_COMMIT = "b9a17eac8e2c0779c12a5429b0bfd6c502788484"
MAX_BITS = 30  # vqserve's LFQ limit (int64 indices, 2^30 codes)


def open_magvit2_lfq(dim: int) -> LFQ:
    """vqserve's LFQ with Open-MAGVIT2's index convention: channel k is bit k, least
    significant first (``index = sum_k [z_k > 0] * 2^k``, ``bit_order="lsb_first"``);
    vqserve's own LFQ (and vector-quantize-pytorch's) put channel 0 in the most significant bit.

    Everything else is the same sign rule: a channel is bit 1 when ``z > 0`` (0, -0 and NaN
    give 0), the code is +-1. Open-MAGVIT2's ``LFQ.forward`` gives these indices and
    ``get_codebook_entry`` these codes (tests/integration/families/test_magvit2.py). Its autoregressive
    stage splits an 18-bit index into two 9-bit sub-tokens (token factorization): ``pre =
    index & 511`` (channels 0-8) and ``post = index >> 9`` (channels 9-17). Inference only
    (served models are not trained here), so no entropy codebook is built."""
    return LFQ(dim, entropy_loss_weight=0.0, commitment_loss_weight=0.0, max_entropy_codebook=0,
               bit_order="lsb_first")


@dataclass
class Magvit2Config(LfqArchitecture, ImportedConfig):
    """The ``ddconfig`` of Open-MAGVIT2's ``VQModel`` that shapes the weights: ``ch``,
    ``ch_mult``, ``num_res_blocks``, ``z_channels`` (= ``embed_dim`` = log2 ``n_embed``: one
    latent channel per LFQ bit). The defaults are the ImageNet 256 model; ``PRESETS`` has the rest."""

    FAMILY: ClassVar[str] = FAMILY_NAME
    FORMAT: ClassVar[str] = FORMAT
    VERSION: ClassVar[int] = VERSION
    LABEL: ClassVar[str] = "Open-MAGVIT2"

    base_channels: int = 128
    ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 4
    z_channels: int = 18

    def __post_init__(self) -> None:
        self.ch_mult = [int(m) for m in self.ch_mult] if isinstance(self.ch_mult, list) else self.ch_mult
        for name in ("base_channels", "num_res_blocks", "z_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Open-MAGVIT2 config: {name} must be a positive integer, got {value!r}")
        if self.z_channels > MAX_BITS:
            raise ValueError(f"Open-MAGVIT2 config: z_channels (LFQ bits) must be at most {MAX_BITS}, "
                             f"got {self.z_channels}")
        if not isinstance(self.ch_mult, list) or not self.ch_mult or min(self.ch_mult) < 1:
            raise ValueError(f"Open-MAGVIT2 config: ch_mult must be a non-empty list of positive integers, "
                             f"got {self.ch_mult!r}")
        widths = [self.base_channels * m for m in self.ch_mult]
        if any(w % GROUPS for w in [self.base_channels, *widths]):
            raise ValueError(f"Open-MAGVIT2 config: base_channels and base_channels x ch_mult must be "
                             f"multiples of {GROUPS} (GroupNorm groups), got {[self.base_channels, *widths]}")

    @property
    def factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


# The published checkpoints' configurations (configs/Open-MAGVIT2/gpu/*.yaml at REFERENCE_COMMIT).
PRESETS: dict[str, Magvit2Config] = {
    "imagenet-256": Magvit2Config(),                                   # imagenet_256_L.ckpt, factor 16
    "imagenet-128": Magvit2Config(ch_mult=[1, 2, 2, 4]),               # imagenet_128_L.ckpt, factor 8
    "pretrain-262144": Magvit2Config(),                                # pretrain256_262144.ckpt
    "pretrain-16384": Magvit2Config(z_channels=14),                    # pretrain256_16384.ckpt
}


class Magvit2Tokenizer(TokenizerBase):
    """Open-MAGVIT2's tokenizer as a vqserve tokenizer: the same indices in fp32, LFQ always fp32.

    ``pixel_range`` is (0, 255): the encoder receives float pixels unchanged and applies the
    original's normalisation; the decoder returns the original's own uint8 values as floats.
    """

    pixel_range = (0.0, 255.0)

    def __init__(self, arch: Magvit2Config):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        common = dict(base_channels=arch.base_channels, ch_mult=arch.ch_mult,
                      num_res_blocks=arch.num_res_blocks, z_channels=arch.z_channels)
        self.encoder = Magvit2Encoder(**common)
        self.quantizer = open_magvit2_lfq(arch.z_channels)
        self.decoder = Magvit2Decoder(**common)


def load_weights(tokenizer: Magvit2Tokenizer, state: dict[str, torch.Tensor], where: str) -> None:
    """Strict load with one line naming the first missing / unexpected / mis-shaped tensor."""
    load_strict_weights(tokenizer, state, where, "Open-MAGVIT2")


class Magvit2Family(ImportedFamily):
    name = FAMILY_NAME
    description = "Open-MAGVIT2 LFQ tokenizers (TencentARC SEED-Voken), converted once by `vqserve import magvit2`"
    config_class = Magvit2Config
    tokenizer_class = Magvit2Tokenizer
    label = "Open-MAGVIT2"


MAGVIT2 = Magvit2Family()
