"""The Cosmos DI family: NVIDIA's Cosmos-Tokenizer DI8x8 / DI16x16 (FSQ), imported once, served by vqserve.

NVIDIA publishes these image tokenizers as TorchScript archives (``encoder.jit``,
``decoder.jit``, ``autoencoder.jit`` in ``nvidia/Cosmos-0.1-Tokenizer-DI8x8`` and ``-DI16x16``
on Hugging Face). vqserve never runs them: ``vqserve import cosmos SOURCE --out DIR``
(``cosmos.importer``) reads only their tensors, without unpickling code, and writes a directory
this family owns:

* ``config.json``: ``{"format": "vqserve-cosmos", "version": 1, <architecture>, "meta": {...}}``
  (the architecture in Cosmos's own terms: ``channels``, ``channels_mult``, ``levels``, ...),
* ``model.safetensors``: the weights under vqserve's names (Cosmos's, with ``quant_conv``
  moved into the encoder and ``post_quant_conv`` into the decoder).

The networks (``cosmos.networks``) are Cosmos's architecture rebuilt op for op; the quantizer
(``CosmosFSQ``) is vqserve's FSQ island, which is Cosmos's FSQ arithmetic (both follow
vector-quantize-pytorch) run in fp32 whatever the networks run in. Indices equal the original
code's in fp32 (tests/integration/families/test_cosmos.py, against fixtures made by the original).
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from vqserve.model.families.base import FamilyConfig
from vqserve.model.families.cosmos.networks import PATCH_METHODS, CosmosDecoder, CosmosEncoder
from vqserve.model.families.imported import ImportedConfig, ImportedFamily, load_strict_weights
from vqserve.model.families.llamagen.networks import GROUPS
from vqserve.model.precision import fp32_island
from vqserve.model.quantizers.common import check_last_dim, to_fp32
from vqserve.model.quantizers.fsq import FSQ
from vqserve.model.tokenizer import TokenizerBase

FORMAT = "vqserve-cosmos"
VERSION = 1
WEIGHTS_NAME = "model.safetensors"
FAMILY_NAME = "cosmos"
# The NVIDIA/Cosmos-Tokenizer commit whose code this architecture follows (and the fixtures came from).
REFERENCE_COMMIT = "3584ae752ce8ebdbe06a420bf60d7513c0e878cc"


@dataclass
class CosmosConfig(ImportedConfig):
    """Cosmos's ``discrete_image`` network config (``cosmos_tokenizer/networks/configs.py``),
    the fields that shape the network. The defaults are DI16x16; ``PRESETS`` has DI8x8.

    ``resolution`` and ``attn_resolutions`` only decide where attention layers sit (Cosmos
    tracks a nominal resolution per level); for the published models, nowhere but the middle."""

    FORMAT: ClassVar[str] = FORMAT
    VERSION: ClassVar[int] = VERSION
    LABEL: ClassVar[str] = "Cosmos"

    channels: int = 128
    channels_mult: list[int] = field(default_factory=lambda: [2, 4, 4])
    num_res_blocks: int = 2
    attn_resolutions: list[int] = field(default_factory=lambda: [32])
    resolution: int = 1024
    patch_size: int = 4
    patch_method: str = "haar"
    spatial_compression: int = 16
    z_channels: int = 256
    embedding_dim: int = 6
    levels: list[int] = field(default_factory=lambda: [8, 8, 8, 5, 5, 5])

    def __post_init__(self) -> None:
        check_fields(self, "Cosmos config", ("channels", "num_res_blocks", "resolution", "patch_size",
                                             "spatial_compression", "z_channels", "embedding_dim"))
        if self.patch_method not in PATCH_METHODS:
            raise ValueError(f"Cosmos config: patch_method must be one of {list(PATCH_METHODS)}, got {self.patch_method!r}")
        if not self.channels_mult or min(self.channels_mult) < 1:
            raise ValueError(f"Cosmos config: channels_mult must be non-empty positive integers, got {self.channels_mult}")
        if any((self.channels * m) % GROUPS for m in self.channels_mult):
            raise ValueError(f"Cosmos config: channels x channels_mult must be multiples of {GROUPS} "
                             f"(GroupNorm groups), got {[self.channels * m for m in self.channels_mult]}")
        check_powers_of_two(self, "Cosmos config", ("patch_size", "spatial_compression"))
        if not 0 <= self.downsamples <= len(self.channels_mult):
            raise ValueError(f"Cosmos config: spatial_compression {self.spatial_compression} with patch_size "
                             f"{self.patch_size} needs {self.downsamples} downsamplings; "
                             f"{len(self.channels_mult)} levels allow 0 to {len(self.channels_mult)}")
        check_fsq(self, "Cosmos config")

    # -- derived structure (Cosmos's Encoder/Decoder constructors) ----------------------
    @property
    def factor(self) -> int:
        return self.spatial_compression

    @property
    def downsamples(self) -> int:
        """Stride-2 levels after the Haar patcher: log2(compression) - log2(patch)."""
        return self.spatial_compression.bit_length() - self.patch_size.bit_length()

    @property
    def codebook_size(self) -> int:
        return math.prod(self.levels)

    def encoder_resolutions(self) -> list[int]:
        """Cosmos's nominal resolution per encoder level: ``resolution // patch_size``,
        halved after each downsampling level."""
        res, out = self.resolution // self.patch_size, []
        for i in range(len(self.channels_mult)):
            out.append(res)
            if i < self.downsamples:
                res //= 2
        return out

    def decoder_resolutions(self) -> list[int]:
        """Per decoder level, as Cosmos's decoder computes it: the nominal resolution starts
        at ``resolution // patch_size // 2**(levels - 1)`` whatever the compression, and
        doubles after each upsampling level (run from the last level to the first)."""
        levels = len(self.channels_mult)
        res = (self.resolution // self.patch_size) // 2 ** (levels - 1)
        out = [0] * levels
        for i in reversed(range(levels)):
            out[i] = res
            if i >= levels - self.downsamples:
                res *= 2
        return out

    def encoder_attention(self) -> list[bool]:
        """Per level: attention after each block, where the nominal resolution is in ``attn_resolutions``."""
        return [r in self.attn_resolutions for r in self.encoder_resolutions()]

    def decoder_attention(self) -> list[bool]:
        return [r in self.attn_resolutions for r in self.decoder_resolutions()]

    def network_kwargs(self) -> dict:
        return dict(channels=self.channels, channels_mult=self.channels_mult,
                    num_res_blocks=self.num_res_blocks, patch_size=self.patch_size,
                    z_channels=self.z_channels, embedding_dim=self.embedding_dim)

    # -- config.json ----------------------------------------------------------------------
    def family_config(self) -> FamilyConfig:
        return FamilyConfig(family=FAMILY_NAME, factor=self.factor, codebook_size=self.codebook_size,
                            latent_dim=len(self.levels), quantizer="fsq", levels=list(self.levels),
                            source=self.to_dict())


def check_fields(config, label: str, positive: tuple[str, ...]) -> None:
    """The integer lists (``channels_mult``, ``attn_resolutions``, ``levels``) made lists of
    ints, and the ``positive`` fields positive integers; one line naming the first bad one."""
    for name in ("channels_mult", "attn_resolutions", "levels"):
        value = getattr(config, name)
        if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ValueError(f"{label}: {name} must be a list of integers, got {value!r}")
        setattr(config, name, [int(v) for v in value])
    for name in positive:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label}: {name} must be a positive integer, got {value!r}")


def check_powers_of_two(config, label: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value & (value - 1):
            raise ValueError(f"{label}: {name} must be a power of two, got {value}")


def check_fsq(config, label: str) -> None:
    """No FSQ projections (``embedding_dim`` = one channel per level), levels >= 3, < 2**31 codes."""
    if config.embedding_dim != len(config.levels):
        raise ValueError(f"{label}: embedding_dim ({config.embedding_dim}) must equal the number of FSQ "
                         f"levels ({len(config.levels)}); FSQ projections are not supported")
    if min(config.levels, default=0) < 3 or math.prod(config.levels) >= 2**31:
        raise ValueError(f"{label}: FSQ levels must each be >= 3, with fewer than 2**31 codes, got {config.levels}")


PRESETS: dict[str, CosmosConfig] = {
    "DI8x8": CosmosConfig(spatial_compression=8),
    "DI16x16": CosmosConfig(spatial_compression=16),
}


class CosmosFSQ(FSQ):
    """Cosmos's ``FSQuantizer`` (levels [8, 8, 8, 5, 5, 5], no projections) as a vqserve fp32 island.

    Cosmos's FSQ is vector-quantize-pytorch's (commit 9502a1f): bound with ``tanh`` (eps 1e-3),
    round, index as a mixed-radix number with the first level least significant; vqserve's
    ``FSQ`` is the same arithmetic in the same order. The one addition: the fp32 latents are
    made contiguous channel-last, the layout Cosmos flattens them to before it bounds them, so
    every element goes through the same vectorised ``tanh``. Cosmos returns int32 indices in
    [0, 64000); these are the same values as int64.
    """

    def forward(self, z: torch.Tensor, return_aux: bool = False):
        check_last_dim(z, self.dim, "Cosmos FSQ")
        with fp32_island(z.device.type):
            codes, indices = self.quantize_bounded(self.bound(to_fp32(z).contiguous()))
        codes = codes.to(z.dtype)
        return (codes, indices, {}) if return_aux else (codes, indices)


class CosmosTokenizer(TokenizerBase):
    """A Cosmos DI model as a vqserve tokenizer: same indices in fp32, the quantizer always fp32.

    ``pixel_range`` is (0, 255): the encoder receives float pixels unchanged and applies
    Cosmos's own normalisation; the decoder returns Cosmos's own uint8 values as floats.
    """

    pixel_range = (0.0, 255.0)

    def __init__(self, arch: CosmosConfig):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        self.encoder = CosmosEncoder(attention=arch.encoder_attention(), downsamples=arch.downsamples,
                                     **arch.network_kwargs())
        self.quantizer = CosmosFSQ(arch.levels)
        self.decoder = CosmosDecoder(attention=arch.decoder_attention(), upsamples=arch.downsamples,
                                     **arch.network_kwargs())


def load_weights(tokenizer: CosmosTokenizer, state: dict[str, torch.Tensor], where: str) -> None:
    """Strict load with one line naming the first missing / unexpected / mis-shaped tensor."""
    load_strict_weights(tokenizer, state, where, "Cosmos DI")


def deterministic_weights(arch: CosmosConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for ``arch`` that are the same on every machine and every torch version.

    No trained Cosmos weights can be shipped or downloaded here, and the tests compare with
    reference outputs made once, so the weights must be reproducible without a file: each
    tensor is a counter-based hash (splitmix64 of the seed, the tensor's name and the element
    index) mapped to uniform [-1, 1), scaled like PyTorch's default initialisation (convolutions
    +-1/sqrt(fan_in); GroupNorm weight 1 +- 0.1, bias +- 0.1, so the affine parameters matter).
    Keys are vqserve's names (``CosmosTokenizer.state_dict()``)."""
    return deterministic_tensors(CosmosTokenizer(arch).state_dict(), seed)


def deterministic_tensors(like_state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``deterministic_weights``' rule for any state dict's names and shapes (the DV models' too)."""
    mask = np.uint64(0xFFFFFFFFFFFFFFFF)
    out = {}
    for name, like in like_state.items():
        n = like.numel()
        key = np.uint64((seed * 0x9E3779B1 + zlib.crc32(name.encode())) & 0xFFFFFFFFFFFFFFFF)
        with np.errstate(over="ignore"):
            z = (np.arange(n, dtype=np.uint64) + key * np.uint64(0x9E3779B97F4A7C15)) & mask
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
        u = (z >> np.uint64(11)).astype(np.float64) / float(2**52) - 1.0  # [-1, 1)
        if ".norm" in name:  # norm1, norm2, norm (attention), norm_out: GroupNorm affine
            values = (1.0 + 0.1 * u) if name.endswith("weight") else 0.1 * u
        else:
            conv = _owner_weight_shape(name, out, like)
            fan_in = int(np.prod(conv[1:]))
            values = u / math.sqrt(fan_in)
        out[name] = torch.from_numpy(values.astype(np.float32)).reshape(like.shape)
    return out


def _owner_weight_shape(name: str, done: dict[str, torch.Tensor], like: torch.Tensor) -> tuple[int, ...]:
    """The shape of the convolution weight a bias belongs to (weights come first in state dicts)."""
    if name.endswith(".bias"):
        return tuple(done[name[: -len("bias")] + "weight"].shape)
    return tuple(like.shape)


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors in key order: fixtures record it, so a drifted generator is caught."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


class CosmosFamily(ImportedFamily):
    name = FAMILY_NAME
    description = "NVIDIA Cosmos-Tokenizer DI8x8 / DI16x16 (FSQ), converted once by `vqserve import cosmos`"
    config_class = CosmosConfig
    tokenizer_class = CosmosTokenizer
    label = "Cosmos DI"


COSMOS = CosmosFamily()
