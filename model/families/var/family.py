"""The VAR family: FoundationVision/VAR's multi-scale residual VQ-VAE, imported once, served by vqserve.

VAR publishes its tokenizer as a plain PyTorch state dict (``vae_ch160v4096z32.pth``:
4,096 codes x 32 dimensions, factor 16). ``vqserve import var FILE --out DIR``
(``var.importer``) reads it with ``torch.load(weights_only=True)`` and writes a directory
this family owns: ``config.json`` (``{"format": "vqserve-var", ...}``, the scale schedules
included) and ``model.safetensors`` (VAR's names, ``quant_conv`` moved into the encoder,
``post_quant_conv`` into the decoder, the codebook and Phi convolutions into the quantizer).

Its tokens are not a grid but a pyramid: one flat sequence per image, coarse to fine and
row-major within a scale, exactly VAR's ``torch.cat(img_to_idxBl(x), 1)`` (680 tokens for a
256x256 image with scales 1,2,3,4,5,6,8,10,13,16). The scale schedule depends on the image
size; VAR's rule (``utils/arg_util.py``: ``--pn 256 | 512 | 1024``) gives the schedules for
256, 512 and 1024 pixels, and any other size is refused in one line
(``vqserve.core.token_layout``). Indices equal VAR's own ``img_to_idxBl`` in fp32 and decoded
images its ``idxBl_to_img(same_shape=True, last_one=True)``
(tests/integration/families/test_var.py, against fixtures made by the original code).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vqserve.core.token_layout import PYRAMID, TokenLayout, as_schedule, scales_text
from vqserve.model.families.base import FamilyConfig
from vqserve.model.families.imported import ImportedConfig, ImportedFamily
from vqserve.model.families.var.networks import GROUPS, VARDecoder, VAREncoder
from vqserve.model.quantizers.multiscale import MultiScaleResidualVQ
from vqserve.model.tokenizer import TokenizerBase

FORMAT = "vqserve-var"
VERSION = 1
FAMILY_NAME = "var"
# The VAR commit whose models/{vqvae,quant,basic_vae}.py this follows (and the fixtures came from).
REFERENCE_COMMIT = "78b95394fc5896192e3a003e4b295f8ea743c48f"

# VAR's rule (utils/arg_util.py, ``--pn``): the scales of each image size, for a patch size of 16
VAR_SCALES = {
    256: [1, 2, 3, 4, 5, 6, 8, 10, 13, 16],
    512: [1, 2, 3, 4, 6, 9, 13, 18, 24, 32],
    1024: [1, 2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64],
}


def var_schedules(factor: int) -> list[list[int]]:
    """VAR's published schedules for a VAE of this ``factor`` (its rule is for factor 16)."""
    return [list(s) for s in VAR_SCALES.values()] if factor == 16 else []


@dataclass
class VARConfig(ImportedConfig):
    """VAR's ``VQVAE(...)`` arguments that shape the weights, plus the scale schedules served
    (``schedules``: each a list of square scales, coarse to fine, ending at a latent size).
    Defaults are ``vae_ch160v4096z32``'s."""

    FORMAT: ClassVar[str] = FORMAT
    VERSION: ClassVar[int] = VERSION
    LABEL: ClassVar[str] = "VAR"

    ch: int = 160
    ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    z_channels: int = 32
    vocab_size: int = 4096
    quant_conv_ks: int = 3
    quant_resi: float = 0.5
    phi_count: int = 4            # share_quant_resi: how many Phi convolutions the scales share
    using_znorm: bool = False
    schedules: list[list[int]] = field(default_factory=lambda: var_schedules(16))

    def __post_init__(self) -> None:
        self.ch_mult = [int(m) for m in self.ch_mult]
        for name in ("ch", "num_res_blocks", "z_channels", "vocab_size", "quant_conv_ks", "phi_count"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"VAR config: {name} must be a positive integer, got {getattr(self, name)}")
        if not self.ch_mult or min(self.ch_mult) < 1 or any((self.ch * m) % GROUPS for m in self.ch_mult):
            raise ValueError(f"VAR config: ch x ch_mult must be positive multiples of {GROUPS}, got "
                             f"{self.ch} x {self.ch_mult}")
        if self.vocab_size < 2:
            raise ValueError(f"VAR config: vocab_size must be at least 2, got {self.vocab_size}")
        self.schedules = [[int(s) for s in sch] for sch in self.schedules]
        if not self.schedules:
            raise ValueError("VAR config: schedules must name at least one scale schedule")
        ends = [sch[-1] if sch else 0 for sch in self.schedules]
        for sch in self.schedules:
            if len(sch) < 2 or min(sch) < 1 or sorted(sch) != sch or len(set(sch)) != len(sch):
                raise ValueError(f"VAR config: a scale schedule must be at least two increasing positive scales, "
                                 f"got {sch}")
        if len(set(ends)) != len(ends):
            raise ValueError(f"VAR config: two schedules end at the same latent size: {self.schedules}")

    @property
    def factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def layout(self) -> TokenLayout:
        return TokenLayout(factor=self.factor, kind=PYRAMID,
                           schedules=tuple(as_schedule(s) for s in self.schedules))

    def family_config(self) -> FamilyConfig:
        return FamilyConfig(family=FAMILY_NAME, factor=self.factor, codebook_size=self.vocab_size,
                            latent_dim=self.z_channels, quantizer="msvq", source=self.to_dict())


def check_schedule_ends(scales: list[int], image_size: int, factor: int, where: str) -> None:
    """A schedule must end at the latent size of the image size it is for (one line)."""
    latent, rest = divmod(image_size, factor)
    if rest or latent < 1:
        raise ValueError(f"{where}: image size {image_size} is not a positive multiple of the factor {factor}")
    if not scales or scales[-1] != latent:
        raise ValueError(f"{where}: the scales {scales_text((s, s) for s in scales)} end at "
                         f"{scales[-1] if scales else 0}, but a {image_size}x{image_size} image has a "
                         f"{latent}x{latent} latent (factor {factor}): VAR's last scale is the latent itself")


class VARTokenizer(TokenizerBase):
    """VAR's VQ-VAE as a vqserve tokenizer: tokens ``[B, L]`` (a pyramid), the whole residual
    loop an fp32 island. ``pixel_range`` is [-1, 1] (VAR's ``x * 2 - 1`` on ToTensor pixels,
    the same fp32 numbers as vqserve's ``x / 127.5 - 1``)."""

    def __init__(self, arch: VARConfig):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        self._layout = arch.layout()
        common = dict(ch=arch.ch, ch_mult=arch.ch_mult, num_res_blocks=arch.num_res_blocks,
                      z_channels=arch.z_channels, quant_conv_ks=arch.quant_conv_ks)
        self.encoder = VAREncoder(**common)
        self.quantizer = MultiScaleResidualVQ(arch.vocab_size, arch.z_channels, arch.phi_count,
                                              arch.quant_resi, arch.using_znorm)
        self.decoder = VARDecoder(**common)

    @property
    def token_layout(self) -> TokenLayout:
        return self._layout

    # -- the shapes: a pyramid, not a grid (TokenizerBase checks images and indices by the layout)
    def schedule_for(self, latents: torch.Tensor):
        h, w = latents.shape[-2:]
        schedule = self._layout.schedule_for_latent(int(h), int(w))
        if schedule is None:  # checked on the image size before: only a float caller gets here
            raise ValueError(self._layout.size_rule(int(h) * self.factor, int(w) * self.factor))
        return schedule

    # -- the paths ------------------------------------------------------------------------
    def quantize(self, latents: torch.Tensor, return_aux: bool = False):
        """latents NCHW -> (f_hat NCHW in latents' dtype, tokens ``[B, L]``[, {}])."""
        tokens, f_hat = self.quantizer.encode_with_fhat(latents, self.schedule_for(latents))
        f_hat = f_hat.to(latents.dtype)
        return (f_hat, tokens, {}) if return_aux else (f_hat, tokens)

    def indices_to_codes(self, indices: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, L]`` -> ``f_hat`` NCHW (fp32 island), cast to the decoder's dtype at its door."""
        schedule = self._layout.schedule_of(tuple(indices.shape[1:]))
        return self.quantizer.decode_fhat(indices, schedule)


class VARFamily(ImportedFamily):
    name = FAMILY_NAME
    description = "VAR multi-scale residual VQ-VAE (pyramid tokens), converted once by `vqserve import var`"
    config_class = VARConfig
    tokenizer_class = VARTokenizer
    label = "VAR"

    def export_refusal(self, fmt: str) -> str | None:
        """VAR's residual loop does not fit an artifact with dynamic height and width yet."""
        if fmt == "onnx":
            return ("VAR cannot export to ONNX: its area downsampling of a 16x16 latent to 3x3, 5x5, 6x6, 10x10 "
                    "and 13x13 is adaptive_avg_pool2d with output sizes that do not divide the input, which "
                    "torch.onnx refuses; serve it eager (exact, the default)")
        return (f"VAR cannot export to {fmt} yet: its scale schedule (how many scales, and their sizes) is chosen "
                "per image size in Python, so a traced graph would hold one size's loop, and exported artifacts "
                "take any height and width; serve it eager (exact, the default)")


VAR = VARFamily()
