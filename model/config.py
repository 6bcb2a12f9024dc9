"""TokenizerConfig: everything needed to rebuild a tokenizer, stored as config.json."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

FORMAT = "vqserve-tokenizer"
FORMAT_VERSION = 1
QUANTIZERS = ("fsq", "lfq", "vq", "rfsq")
DITHERS = ("none", "bayer4")  # FSQ rounding (vqserve.model.quantizers.fsq)


@dataclass
class TokenizerConfig:
    """Network and quantizer shape. ``factor`` = patch_size * 2 ** len(channels), the
    spatial downsampling (4, 8 or 16).

    quantizer: ``fsq`` (levels), ``lfq`` (lfq_dim bits), ``vq`` (vq_codebook_size x vq_dim),
    ``rfsq`` (levels x num_quantizers). ``attention`` adds a TransformerEncoderLayer in the
    middle of encoder and decoder. ``norm``: ``group`` (GroupNorm) or ``pixel`` (per-position).
    """

    quantizer: str = "fsq"
    levels: list[int] = field(default_factory=lambda: [8, 8, 8, 5, 5, 5])
    lfq_dim: int = 16
    vq_codebook_size: int = 4096
    vq_dim: int = 8
    num_quantizers: int = 2
    channels: list[int] = field(default_factory=lambda: [64, 128, 128])
    num_res_blocks: int = 1
    attention: bool = False
    attention_heads: int = 4
    patch_size: int = 1   # >1: pixel (un)shuffle stem, no full-resolution convolutions
    # "group": GroupNorm, statistics over the whole image (every checkpoint before issue 17;
    # a config.json without the key loads as this); "pixel": per-position channel norm,
    # the same output for a pixel whatever the image size (docs/TRAINING.md)
    norm: str = "group"
    # FSQ only: "bayer4" rounds through a subtractive 4x4 ordered dither, so slow gradients
    # alternate codes instead of banding (vqserve.model.quantizers.fsq); "none" for every
    # checkpoint before it, and left out of config.json then, so those files stay as they were
    dither: str = "none"

    def __post_init__(self) -> None:
        self.levels = [int(v) for v in self.levels]
        self.channels = [int(c) for c in self.channels]
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {self.quantizer!r}")
        if self.norm not in ("group", "pixel"):
            raise ValueError(f"norm must be 'group' or 'pixel', got {self.norm!r}")
        if self.dither not in DITHERS:
            raise ValueError(f"dither must be one of {DITHERS}, got {self.dither!r}")
        if self.dither != "none" and self.quantizer != "fsq":
            raise ValueError(f"dither={self.dither!r} needs quantizer 'fsq', got {self.quantizer!r}")
        if self.patch_size not in (1, 2, 4):
            raise ValueError(f"patch_size must be 1, 2 or 4, got {self.patch_size}")
        if not self.channels or min(self.channels) < 1 or self.factor not in (4, 8, 16):
            raise ValueError(
                "factor = patch_size * 2 ** len(channels) must be 4, 8 or 16 (positive widths), got "
                f"patch_size={self.patch_size}, channels={self.channels}"
            )
        if self.num_res_blocks < 1:
            raise ValueError(f"num_res_blocks must be >= 1, got {self.num_res_blocks}")
        if self.attention and self.channels[-1] % self.attention_heads:
            raise ValueError(
                f"attention_heads ({self.attention_heads}) must divide channels[-1] ({self.channels[-1]})"
            )

    @property
    def factor(self) -> int:
        return self.patch_size * 2 ** len(self.channels)

    @property
    def latent_dim(self) -> int:
        return {"fsq": len(self.levels), "rfsq": len(self.levels), "lfq": self.lfq_dim,
                "vq": self.vq_dim}[self.quantizer]

    @property
    def codebook_size(self) -> int:
        return {"fsq": math.prod(self.levels), "rfsq": math.prod(self.levels),
                "lfq": 2**self.lfq_dim, "vq": self.vq_codebook_size}[self.quantizer]

    @property
    def codes_per_position(self) -> int:
        """Indices per latent position: num_quantizers for residual FSQ, else 1."""
        return self.num_quantizers if self.quantizer == "rfsq" else 1

    def to_dict(self) -> dict:
        data = asdict(self)
        if data["dither"] == "none":
            del data["dither"]  # an undithered config.json reads the same to older vqserve
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **data}

    @classmethod
    def from_dict(cls, data: dict) -> TokenizerConfig:
        data = dict(data)
        fmt = data.pop("format", FORMAT)
        version = data.pop("format_version", FORMAT_VERSION)
        if fmt != FORMAT:
            raise ValueError(f"config.json is not a vqserve tokenizer config (format={fmt!r})")
        if version > FORMAT_VERSION:
            raise ValueError(
                f"config.json has format_version {version}; this vqserve reads up to {FORMAT_VERSION}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config.json has unknown keys {unknown}")
        return cls(**data)
