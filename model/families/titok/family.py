"""The TiTok family: ByteDance's 1-D image tokenizer (bytedance/1d-tokenizer), served by vqserve.

TiTok ("An Image is Worth 32 Tokens", MaskGen and FlowTok build on it) turns a 256x256 image
into a flat sequence of ``num_latent_tokens`` codes, with no spatial grid: the token layout is
a ``sequence`` (``vqserve.core.token_layout``: ``[B, L]``, one image size). Its VQ releases are
Hugging Face ``PyTorchModelHubMixin`` folders (``yucornetto/tokenizer_titok_l32_imagenet``, ...):
``config.json`` (the OmegaConf tree ``{"model": {"vq_model": {...}}, "dataset":
{"preprocessing": {"crop_size": 256}}, ...}``) and ``model.safetensors`` (``TiTok``'s own
tensor names). vqserve serves such a folder as it is (``--model DIR``: this family claims a
config with ``model.vq_model``) or converted once by ``vqserve import titok DIR --out OUT``
(``titok.importer``: ``config.json`` ``"format": "vqserve-titok"`` with the architecture
spelled out, ``model.safetensors`` under vqserve's names). Both read the same way
(``architecture_from_released``), so both refuse the same things in one line.

Covered: the 4,096-code VQ models S-128, B-64, L-32 (``is_legacy``, ``finetune_decoder``: 12-dim
l2-normalised codes, decoded through MaskGIT-VQGAN's decoder, whose networks vqserve's
``maskgit`` family already has) and the 8,192-code VQ models BL-64, BL-128, SL-256 (not legacy:
64-dim raw codes, the ViT decoder gives pixels itself). The VAE models (``quantize_mode: vae``)
have no tokens and are refused.

Quantizer: TiTok's ``VectorQuantizer`` (``modeling/quantizer/quantizer.py``) runs in fp32 with
autocast off, normalises latent and codebook rows (``F.normalize``) when ``use_l2_norm``, and
takes the first ``argmin`` of ``sum(z**2) + sum(e**2) - 2 * einsum(z, e.T)``: LlamaGen's
expression, so ``L2NearestCode`` (its fused ``addmm``, bitwise the same distances) serves it,
as it serves MaskGIT-VQGAN. Decoded codes are the normalised rows, as ``get_codebook_entry``.

Pixels: TiTok's README feeds ``x / 255`` (fp32 [0, 1]) and turns a decode into an image with
``clamp(y, 0, 1) * 255`` then ``.to(uint8)``; ``pixel_range`` is [0, 255] so vqserve's uint8
conversion is exact on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from vqserve.core.token_layout import SEQUENCE, TokenLayout
from vqserve.model.families.base import CONFIG_NAME, FamilyConfig, read_config_json
from vqserve.model.families.imported import ImportedConfig, ImportedFamily, load_strict_weights
from vqserve.model.families.maskgit.family import PRESETS as MASKGIT_PRESETS
from vqserve.model.families.titok.networks import TitokDecoder, TitokEncoder
from vqserve.model.quantizers.l2_nearest import L2NearestCode
from vqserve.model.tokenizer import TokenizerBase

FORMAT = "vqserve-titok"
VERSION = 1
FAMILY_NAME = "titok"
LABEL = "TiTok"
# The bytedance/1d-tokenizer commit whose modeling/{titok,modules/blocks,quantizer/quantizer}.py this follows.
REFERENCE_COMMIT = "942a96fbdd873780179d1b78d5462911528bf8c8"
# TiTokEncoder / TiTokDecoder: vit_*_model_size -> (width, layers, heads), as the original's tables
MODEL_SIZES: dict[str, tuple[int, int, int]] = {"small": (512, 8, 8), "base": (768, 12, 12),
                                                "large": (1024, 24, 16)}
# TiTok's pixel decoder (finetune_decoder): MaskGIT-VQGAN's, its config fixed in modeling/titok.py
PIXEL_DECODER: dict = MASKGIT_PRESETS["imagenet-f16-256"].network_args()


@dataclass
class TitokConfig(ImportedConfig):
    """The architecture, spelled out (``encoder`` / ``decoder``: width, layers, heads). Defaults
    are TiTok-L-32's (``configs/infer/TiTok/titok_l32.yaml``)."""

    FORMAT: ClassVar[str] = FORMAT
    VERSION: ClassVar[int] = VERSION
    LABEL: ClassVar[str] = LABEL

    image_size: int = 256
    encoder: list[int] = field(default_factory=lambda: list(MODEL_SIZES["large"]))
    decoder: list[int] = field(default_factory=lambda: list(MODEL_SIZES["large"]))
    vit_enc_patch_size: int = 16
    vit_dec_patch_size: int = 16
    num_latent_tokens: int = 32
    codebook_size: int = 4096
    token_size: int = 12
    use_l2_norm: bool = True
    is_legacy: bool = True
    pixel_decoder: dict | None = field(default_factory=lambda: dict(PIXEL_DECODER))

    def __post_init__(self) -> None:
        for name in ("image_size", "vit_enc_patch_size", "vit_dec_patch_size", "num_latent_tokens", "token_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{LABEL} config: {name} must be a positive integer, got {value!r}")
        if isinstance(self.codebook_size, bool) or not isinstance(self.codebook_size, int) or self.codebook_size < 2:
            raise ValueError(f"{LABEL} config: codebook_size must be an integer >= 2, got {self.codebook_size!r}")
        for name in ("encoder", "decoder"):
            sizes = getattr(self, name)
            if (not isinstance(sizes, list) or len(sizes) != 3 or any(isinstance(v, bool) or not isinstance(v, int)
                                                                      or v < 1 for v in sizes) or sizes[0] % sizes[2]):
                raise ValueError(f"{LABEL} config: {name} must be [width, layers, heads] with heads dividing width, "
                                 f"got {sizes!r}")
        for name in ("vit_enc_patch_size", "vit_dec_patch_size"):
            if self.image_size % getattr(self, name):
                raise ValueError(f"{LABEL} config: image_size {self.image_size} is not a multiple of {name} "
                                 f"{getattr(self, name)}")
        if self.is_legacy != (self.pixel_decoder is not None):
            raise ValueError(f"{LABEL} config: the legacy decoder (is_legacy) goes with the MaskGIT-VQGAN pixel "
                             f"decoder (finetune_decoder) and only with it; got is_legacy {self.is_legacy}, "
                             f"pixel_decoder {self.pixel_decoder!r}")
        if self.pixel_decoder is not None:
            from vqserve.model.families.maskgit.family import MaskgitConfig

            MaskgitConfig(**self.pixel_decoder, quantized_embed_dim=self.pixel_decoder.get("z_channels", 0))
            grid, factor = self.image_size // self.vit_dec_patch_size, 2 ** (len(self.pixel_decoder["channel_mult"]) - 1)
            if grid * factor != self.image_size:
                raise ValueError(f"{LABEL} config: the decoder's {grid}x{grid} grid times the pixel decoder's factor "
                                 f"{factor} is not image_size {self.image_size}")

    @property
    def factor(self) -> int:
        return self.vit_enc_patch_size

    def layout(self) -> TokenLayout:
        return TokenLayout(factor=self.factor, kind=SEQUENCE, length=self.num_latent_tokens,
                           size=(self.image_size, self.image_size))

    def family_config(self) -> FamilyConfig:
        return FamilyConfig(family=FAMILY_NAME, factor=self.factor, codebook_size=self.codebook_size,
                            latent_dim=self.token_size, quantizer="vq", source=self.to_dict())


def _vq(tokens: int, codes: int, dim: int, l2: bool, enc: str, dec: str, legacy: bool) -> TitokConfig:
    return TitokConfig(encoder=list(MODEL_SIZES[enc]), decoder=list(MODEL_SIZES[dec]), num_latent_tokens=tokens,
                       codebook_size=codes, token_size=dim, use_l2_norm=l2, is_legacy=legacy,
                       pixel_decoder=dict(PIXEL_DECODER) if legacy else None)


# configs/infer/TiTok/titok_*.yaml (the released VQ tokenizers)
PRESETS: dict[str, TitokConfig] = {
    "l32": _vq(32, 4096, 12, True, "large", "large", True),
    "b64": _vq(64, 4096, 12, True, "base", "base", True),
    "s128": _vq(128, 4096, 12, True, "small", "small", True),
    "bl64_vq8k": _vq(64, 8192, 64, False, "base", "large", False),
    "bl128_vq8k": _vq(128, 8192, 64, False, "base", "large", False),
    "sl256_vq8k": _vq(256, 8192, 64, False, "small", "large", False),
}


class TitokTokenizer(TokenizerBase):
    """TiTok as a vqserve tokenizer: tokens ``[B, L]`` (a sequence), the search an fp32 island."""

    pixel_range = (0.0, 255.0)

    def __init__(self, arch: TitokConfig):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        self._layout = arch.layout()
        common = dict(image_size=arch.image_size, num_latent_tokens=arch.num_latent_tokens,
                      token_size=arch.token_size, is_legacy=arch.is_legacy)
        self.encoder = TitokEncoder(*arch.encoder, patch_size=arch.vit_enc_patch_size, **common)
        self.quantizer = L2NearestCode(arch.codebook_size, arch.token_size, l2_norm=arch.use_l2_norm)
        self.decoder = TitokDecoder(*arch.decoder, patch_size=arch.vit_dec_patch_size,
                                    pixel_decoder=arch.pixel_decoder, **common)

    @property
    def token_layout(self) -> TokenLayout:
        return self._layout

    def quantize(self, latents: torch.Tensor, return_aux: bool = False):
        """latents ``[B, C, 1, L]`` -> (codes ``[B, C, 1, L]``, tokens ``[B, L]``[, aux])."""
        codes, indices, *aux = super().quantize(latents, return_aux=return_aux)
        return (codes, indices.reshape(indices.shape[0], -1), *aux)

    def indices_to_codes(self, indices: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, L]`` -> codes ``[B, C, 1, L]``, contiguous as ``decode_tokens`` makes them."""
        return super().indices_to_codes(indices.reshape(indices.shape[0], 1, -1)).contiguous()


# ---- the released folder ---------------------------------------------------------------------
RELEASED_WEIGHTS = "model.safetensors"
REMEDY = "download the TiTok tokenizer folder again (config.json + model.safetensors, e.g. " \
         "yucornetto/tokenizer_titok_l32_imagenet)"
# TiTok's own names -> vqserve's (the rest keep their names)
RENAMES = (("latent_tokens", "encoder.latent_tokens"), ("quantize.embedding.weight", "quantizer.embedding"),
           ("pixel_quantize.", "decoder.pixel_quantize."), ("pixel_decoder.", "decoder.pixel_decoder."))


def is_released_config(data: dict) -> bool:
    """A TiTok ``config.json`` as ``TiTok.save_pretrained`` writes it: ``model.vq_model`` with its ViT sizes."""
    vq = (data.get("model") or {}).get("vq_model") if isinstance(data.get("model"), dict) else None
    return isinstance(vq, dict) and "vit_enc_model_size" in vq


def architecture_from_released(data: dict, where: str) -> TitokConfig:
    """The architecture from TiTok's own ``config.json`` (``save_pretrained``'s OmegaConf tree);
    one line naming what vqserve does not serve."""
    vq = data["model"]["vq_model"]
    mode = vq.get("quantize_mode", "vq")
    if mode != "vq":
        raise ValueError(f"{where}: quantize_mode {mode!r}: a TiTok VAE has continuous latents, no tokens; "
                         "vqserve serves the VQ tokenizers (S-128, B-64, L-32, BL-64/BL-128/SL-256 VQ-8k)")
    legacy, finetune = bool(vq.get("is_legacy", True)), bool(vq.get("finetune_decoder", True))
    if legacy != finetune:
        raise ValueError(f"{where}: is_legacy {legacy} with finetune_decoder {finetune}: no released TiTok "
                         "tokenizer has this decoder; vqserve serves legacy + finetune_decoder (S/B/L) or "
                         "neither (BL/SL VQ-8k)")
    try:
        crop = (data.get("dataset") or {}).get("preprocessing", {}).get("crop_size")
        sizes = [MODEL_SIZES[vq[k]] if vq[k] in MODEL_SIZES else None
                 for k in ("vit_enc_model_size", "vit_dec_model_size")]
        unknown = [vq[k] for k, s in zip(("vit_enc_model_size", "vit_dec_model_size"), sizes, strict=True) if s is None]
        if unknown:
            raise ValueError(f"unknown vit model size {unknown[0]!r} (TiTok has {sorted(MODEL_SIZES)})")
        return TitokConfig(image_size=crop, encoder=list(sizes[0]), decoder=list(sizes[1]),
                           vit_enc_patch_size=vq["vit_enc_patch_size"], vit_dec_patch_size=vq["vit_dec_patch_size"],
                           num_latent_tokens=vq["num_latent_tokens"], codebook_size=vq["codebook_size"],
                           token_size=vq["token_size"], use_l2_norm=bool(vq.get("use_l2_norm", False)),
                           is_legacy=legacy, pixel_decoder=dict(PIXEL_DECODER) if finetune else None)
    except KeyError as exc:
        raise ValueError(f"{where}: model.vq_model has no {exc.args[0]}; this is not a TiTok config.json") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def to_vqserve_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for old, new in RENAMES:
            if key == old or (old.endswith(".") and key.startswith(old)):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


class TitokFamily(ImportedFamily):
    name = FAMILY_NAME
    description = ("TiTok 1-D tokenizer (bytedance/1d-tokenizer VQ: S-128, B-64, L-32, BL/SL VQ-8k; sequence "
                   "tokens), its released folder as it is or converted by `vqserve import titok`")
    config_class = TitokConfig
    tokenizer_class = TitokTokenizer
    label = LABEL

    def claims(self, config: dict) -> bool:
        return super().claims(config) or is_released_config(config)

    def architecture(self, path: Path) -> Any:
        data = read_config_json(path)
        if data is not None and is_released_config(data):
            return architecture_from_released(data, str(path / CONFIG_NAME))
        return super().architecture(path)

    def load(self, path: Path, device: str | torch.device = "cpu") -> Any:
        if not is_released_config(read_config_json(path) or {}):
            return super().load(path, device)
        arch = self.architecture(path)
        self.check_files(path)
        tokenizer = TitokTokenizer(arch)
        weights = path / self.weights_name
        load_strict_weights(tokenizer, to_vqserve_names(self.read_weights(weights)), str(weights), LABEL)
        return tokenizer.to(device).eval()

    def export_refusal(self, fmt: str) -> str | None:
        """Not exported yet: served eager (exact, the default)."""
        return (f"TiTok cannot export to {fmt} yet: its exports are not checked against the original (fixed "
                "256x256 inputs, nn.MultiheadAttention); serve it eager (exact, the default)")


TITOK = TitokFamily()
