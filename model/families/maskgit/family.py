"""The MaskGIT-VQGAN family: ``openMUSE/maskgit-vqgan-imagenet-f16-256``, imported once, served by vqserve.

Google's MaskGIT (github.com/google-research/maskgit) tokenizes ImageNet 256x256 images into
16x16 grids of 1,024 codes with a VQGAN of its own; open-muse (github.com/huggingface/open-muse,
``muse/modeling_maskgit_vqgan.py``: ``MaskGitVQGAN``) ported it to PyTorch and released the
converted weights as ``openMUSE/maskgit-vqgan-imagenet-f16-256`` (``config.json`` +
``pytorch_model.bin``). ``vqserve import maskgit FOLDER --out DIR`` (``maskgit_import``) checks
every key of that config and every tensor, and writes a directory this family owns:
``config.json`` (``"format": "vqserve-maskgit"``) and ``model.safetensors``.

The networks are rebuilt op for op (``maskgit_networks``: "same" padding, bias-free residual
convolutions, the shortcut applied to the block's output, average-pool downsampling). The
quantizer's search is the original's ``addmm(|z|^2 + |e|^2, z, e^T, alpha=-2)`` and first
argmin, which is exactly LlamaGen's fp32 island without its l2 normalisation
(``L2NearestCode(l2_norm=False)``), so that island serves it, in fp32 whatever the networks
run in.

Pixels (``pixels`` in config.json, so in the model hash and the served identity): ``"maskgit"``
is what the model's users feed it, torchvision's ``ToTensor`` (``x / 255`` in fp32, [0, 1]:
open-muse's README, ``training/data.py`` and ``PipelineMuse``; MaskGIT's own tokenizer takes
[0, 1] too), and decoded pixels as open-muse turns them into images (``to_pil_image``, the
README, ``train_muse.py``): ``trunc(255 * ((clamp(2y - 1, -1, 1) + 1) / 2))``.

Beyond the original: any batch and any grid ``[h, w]`` decode; the original's
``get_codebook_entry`` reshapes ``num_tokens`` to a square of side ``int(sqrt(n))`` (a
non-square grid fails or, worse, decodes a wrong square).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from vqserve.model.families.base import FamilyConfig
from vqserve.model.families.imported import ImportedConfig, ImportedFamily
from vqserve.model.families.maskgit.networks import GROUPS, MaskgitDecoder, MaskgitEncoder
from vqserve.model.quantizers.l2_nearest import L2NearestCode
from vqserve.model.tokenizer import TokenizerBase

FORMAT = "vqserve-maskgit"
VERSION = 1
FAMILY_NAME = "maskgit"
LABEL = "MaskGIT-VQGAN"
# The huggingface/open-muse commit whose muse/modeling_maskgit_vqgan.py this family follows (fixtures came from it).
REFERENCE_COMMIT = "64e1afe033717d795866ab8204484705cd4dc3f7"
PIXEL_RULES = ("maskgit",)


@dataclass
class MaskgitConfig(ImportedConfig):
    """``MaskGitVQGAN``'s arguments that shape the weights or the tokens, under its names, plus
    the pixel rule. The defaults are the class's, which are the released model's."""

    FORMAT: ClassVar[str] = FORMAT
    VERSION: ClassVar[int] = VERSION
    LABEL: ClassVar[str] = LABEL

    resolution: int = 256
    hidden_channels: int = 128
    channel_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    z_channels: int = 256
    num_embeddings: int = 1024
    quantized_embed_dim: int = 256
    pixels: str = "maskgit"

    def __post_init__(self) -> None:
        for name in ("resolution", "hidden_channels", "num_res_blocks", "z_channels", "num_embeddings",
                     "quantized_embed_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{LABEL} config: {name} must be a positive integer, got {value!r}")
        mult = self.channel_mult
        if not isinstance(mult, list) or not mult or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                                         for v in mult):
            raise ValueError(f"{LABEL} config: channel_mult must be a non-empty list of positive integers, "
                             f"got {mult!r}")
        widths = [self.hidden_channels * m for m in [1, *mult]]
        if any(w % GROUPS for w in widths):
            raise ValueError(f"{LABEL} config: hidden_channels x channel_mult must be multiples of {GROUPS} "
                             f"(GroupNorm groups), got {sorted(set(widths))}")
        if self.num_embeddings < 2:
            raise ValueError(f"{LABEL} config: num_embeddings must be at least 2, got {self.num_embeddings}")
        if self.z_channels != self.quantized_embed_dim:
            # no quant_conv: the encoder's output is searched as it is (the original would
            # silently reshape it into rows of the wrong length)
            raise ValueError(f"{LABEL} config: z_channels ({self.z_channels}) must equal quantized_embed_dim "
                             f"({self.quantized_embed_dim}); the model has no projection between them")
        if self.pixels not in PIXEL_RULES:
            raise ValueError(f"{LABEL} config: pixels must be one of {list(PIXEL_RULES)}, got {self.pixels!r}")

    @property
    def factor(self) -> int:
        return 2 ** (len(self.channel_mult) - 1)

    def network_args(self) -> dict:
        return dict(hidden_channels=self.hidden_channels, channel_mult=self.channel_mult,
                    num_res_blocks=self.num_res_blocks, z_channels=self.z_channels)

    def family_config(self) -> FamilyConfig:
        return FamilyConfig(family=FAMILY_NAME, factor=self.factor, codebook_size=self.num_embeddings,
                            latent_dim=self.quantized_embed_dim, quantizer="vq", source=self.to_dict())


# openMUSE/maskgit-vqgan-imagenet-f16-256: MaskGitVQGAN()'s defaults (its config.json says the same)
PRESETS: dict[str, MaskgitConfig] = {"imagenet-f16-256": MaskgitConfig()}


class MaskgitTokenizer(TokenizerBase):
    """MaskGIT-VQGAN as a vqserve tokenizer: the same indices in fp32, the search always fp32."""

    pixel_range = (0.0, 255.0)

    def __init__(self, arch: MaskgitConfig):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        self.encoder = MaskgitEncoder(**arch.network_args())
        self.quantizer = L2NearestCode(arch.num_embeddings, arch.quantized_embed_dim, l2_norm=False)
        self.decoder = MaskgitDecoder(**arch.network_args())


class MaskgitFamily(ImportedFamily):
    name = FAMILY_NAME
    description = ("MaskGIT-VQGAN (open-muse's MaskGitVQGAN, openMUSE/maskgit-vqgan-imagenet-f16-256), converted "
                   "once by `vqserve import maskgit`")
    config_class = MaskgitConfig
    tokenizer_class = MaskgitTokenizer
    label = LABEL


MASKGIT = MaskgitFamily()
