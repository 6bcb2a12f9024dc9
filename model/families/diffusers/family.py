"""The ``diffusers`` VQModel family: aMUSEd's VQGAN, the LDM VQ-f4/f8 models, Kandinsky's MoVQ.

A VQModel directory is ``config.json`` (``"_class_name": "VQModel"``) and
``diffusion_pytorch_model.safetensors``. vqserve builds diffusers' own ``Encoder`` and
``Decoder`` from the config (so the networks are the original code, layer for layer) and
replaces diffusers' ``VectorQuantizer`` with ``CdistVQ``: the same ``argmin(cdist)`` index
convention, computed in fp32 whatever dtype the networks run in. The encoder side is
``encoder`` + ``quant_conv``; the decoder side ``post_quant_conv`` + ``decoder``, which for
MoVQ (``norm_type: "spatial"``) also reads the quantized latents, as ``VQModel.decode`` does.
Pixels are in [-1, 1], as diffusers' VQ pipelines use them.

``diffusers`` is an optional dependency: ``pip install 'vqserve[diffusers]'``. Weights are
read from safetensors only (a ``.bin`` is refused: loading it would unpickle).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vqserve.model.families.base import (
    CONFIG_NAME,
    Family,
    FamilyConfig,
    read_config_json,
    read_safetensors,
)
from vqserve.model.precision import cast_to
from vqserve.model.quantizers.cdist import CdistVQ
from vqserve.model.tokenizer import TokenizerBase

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
CLASS_NAME = "VQModel"
DOWN_BLOCKS = ("DownEncoderBlock2D", "AttnDownEncoderBlock2D")
UP_BLOCKS = ("UpDecoderBlock2D", "AttnUpDecoderBlock2D")
NORM_TYPES = ("group", "spatial")


def import_diffusers():
    """diffusers' VQModel, or an ImportError that says how to install it."""
    try:
        from diffusers import VQModel
    except ImportError as exc:
        raise ImportError(f"serving a diffusers VQModel needs the diffusers package "
                          f"(pip install 'vqserve[diffusers]'): {exc}") from None
    return VQModel


def check_vqmodel_config(config: dict, where: str) -> None:
    """Refuse, before any weights are read, what vqserve cannot serve with the same tokens."""
    def bad(rule: str) -> ValueError:
        return ValueError(f"{where}: {rule}")

    if config.get("in_channels", 3) != 3 or config.get("out_channels", 3) != 3:
        raise bad(f"only RGB VQModels are supported (in_channels/out_channels 3), got "
                  f"{config.get('in_channels')}/{config.get('out_channels')}")
    down, up = list(config.get("down_block_types", ())), list(config.get("up_block_types", ()))
    if not down or len(down) != len(up) or len(down) != len(config.get("block_out_channels", ())):
        raise bad("down_block_types, up_block_types and block_out_channels must be non-empty "
                  "and of equal length")
    unknown = sorted({b for b in down if b not in DOWN_BLOCKS} | {b for b in up if b not in UP_BLOCKS})
    if unknown:
        raise bad(f"block types {unknown} are not supported (encoder: {DOWN_BLOCKS}, decoder: {UP_BLOCKS})")
    if config.get("norm_type", "group") not in NORM_TYPES:
        raise bad(f"norm_type must be one of {NORM_TYPES}, got {config.get('norm_type')!r}")
    if int(config.get("num_vq_embeddings", 256)) < 2:
        raise bad("num_vq_embeddings must be at least 2")


class NearestUpsample(nn.Module):
    """diffusers' ``Upsample2D`` as VQ decoders use it (nearest x2, then ``conv``), without
    its ``if batch >= 64`` / ``if numel > 2**31`` ``.contiguous()`` branches: those are
    numerically no-ops, but branches on the batch size stop torch.export from keeping the
    batch dynamic. Same weights, same names, same arithmetic."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def exportable_decoder(decoder: nn.Module) -> nn.Module:
    """``decoder`` with every diffusers ``Upsample2D`` replaced by ``NearestUpsample``;
    an upsampler of any other kind is refused (it would not be the same arithmetic)."""
    from diffusers.models.upsampling import Upsample2D

    for name, module in list(decoder.named_modules()):
        if not isinstance(module, Upsample2D):
            continue
        plain = (module.use_conv and not module.use_conv_transpose and module.interpolate
                 and module.norm is None and module.name == "conv")
        if not plain:
            raise ValueError(f"decoder upsampler {name} is not a plain nearest x2 + conv Upsample2D")
        parent_name, _, child = name.rpartition(".")
        setattr(decoder.get_submodule(parent_name) if parent_name else decoder, child,
                NearestUpsample(module.conv))
    return decoder


class DiffusersVQEncoder(nn.Module):
    """diffusers ``Encoder`` + ``quant_conv``: pixels [-1,1] -> pre-quantizer latents."""

    def __init__(self, net: nn.Module, quant_conv: nn.Conv2d):
        super().__init__()
        self.net = net
        self.quant_conv = quant_conv
        from diffusers.models.resnet import ResnetBlock2D

        # whose conv1/conv2 are residual branches (vqserve.model.mixed_precision's fp32 stream)
        self.residual_block_types = (ResnetBlock2D,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the dtype door: diffusers' networks trust their input's dtype, vqserve never does
        return self.quant_conv(self.net(cast_to(x, self.net.conv_in.weight.dtype)))


class DiffusersVQDecoder(nn.Module):
    """``post_quant_conv`` + diffusers ``Decoder``: codes -> pixels ~[-1,1].

    MoVQ's spatially conditioned norms (``spatial``) also read the codes themselves."""

    def __init__(self, post_quant_conv: nn.Conv2d, net: nn.Module, spatial: bool):
        super().__init__()
        self.post_quant_conv = post_quant_conv
        self.net = net
        self.spatial = spatial

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        codes = cast_to(codes, self.post_quant_conv.weight.dtype)
        return self.net(self.post_quant_conv(codes), codes if self.spatial else None)


class DiffusersVQTokenizer(TokenizerBase):
    """A diffusers VQModel as a vqserve tokenizer (quantizer replaced by ``CdistVQ``)."""

    def __init__(self, config: FamilyConfig, encoder: DiffusersVQEncoder, quantizer: CdistVQ,
                 decoder: DiffusersVQDecoder):
        super().__init__()
        self.config = config
        self.encoder = encoder
        self.quantizer = quantizer
        self.decoder = decoder

    @classmethod
    def from_vqmodel(cls, model: nn.Module, source: dict | None = None,
                     copy_model: bool = True) -> DiffusersVQTokenizer:
        """A diffusers ``VQModel``'s networks and codebook. Its decoder's upsamplers are
        swapped for ``NearestUpsample``, so the model is copied first unless
        ``copy_model=False`` hands it over."""
        cfg = model.config
        if copy_model:
            model = copy.deepcopy(model)
        codebook = model.quantize.embedding.weight.detach()
        config = FamilyConfig(family=DiffusersVQFamily.name,
                              factor=2 ** (len(cfg.block_out_channels) - 1),
                              codebook_size=int(codebook.shape[0]), latent_dim=int(codebook.shape[1]),
                              source=dict(source if source is not None else cfg))
        return cls(config,
                   DiffusersVQEncoder(model.encoder, model.quant_conv),
                   CdistVQ(codebook),
                   DiffusersVQDecoder(model.post_quant_conv, exportable_decoder(model.decoder),
                                      cfg.norm_type == "spatial"))


class DiffusersVQFamily(Family):
    name = "diffusers-vqmodel"
    description = "diffusers VQModel directories (aMUSEd VQGAN, LDM VQ-f4/f8, Kandinsky MoVQ)"
    weights_name = WEIGHTS_NAME

    def claims(self, config: dict) -> bool:
        return config.get("_class_name") == CLASS_NAME

    def check_files(self, path: Path) -> None:
        if not (path / WEIGHTS_NAME).is_file() and (path / "diffusion_pytorch_model.bin").is_file():
            raise ValueError(f"{path} holds diffusion_pytorch_model.bin only: vqserve reads "
                             f"safetensors only (a .bin is a pickle); download the "
                             f"{WEIGHTS_NAME} variant of this model")
        super().check_files(path)

    def _config(self, path: Path) -> dict:
        data = read_config_json(path)
        if data is None:
            raise ValueError(f"{path / CONFIG_NAME} is not a JSON object")
        check_vqmodel_config(data, str(path / CONFIG_NAME))
        return data

    def read_config(self, path: Path) -> FamilyConfig:
        data = self._config(path)
        latent = data.get("latent_channels", 3)
        return FamilyConfig(family=self.name, factor=2 ** (len(data["block_out_channels"]) - 1),
                            codebook_size=int(data.get("num_vq_embeddings", 256)),
                            latent_dim=int(data.get("vq_embed_dim") or latent), source=data)

    def load(self, path: Path, device: str | torch.device = "cpu") -> DiffusersVQTokenizer:
        data = self._config(path)
        self.check_files(path)
        VQModel = import_diffusers()
        with torch.device("meta"):  # no random init of weights about to be replaced
            model = VQModel.from_config(data)
        state = read_safetensors(path / WEIGHTS_NAME, "save the model again with VQModel.save_pretrained(DIR)")
        fix_keys = getattr(model, "_fix_state_dict_keys_on_load", None)
        if fix_keys is not None:  # diffusers' own renaming of pre-0.14 attention weights
            state = fix_keys(dict(state))
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            first = next((ln.strip() for ln in str(exc).splitlines()[1:] if ln.strip()), str(exc))
            raise ValueError(f"weights in {path / WEIGHTS_NAME} do not match {CONFIG_NAME}: {first}") from None
        left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"weights in {path / WEIGHTS_NAME} do not set {left[:5]}")
        # fp16/bf16 weight files are served from fp32 copies (the networks' dtype is chosen later)
        tokenizer = DiffusersVQTokenizer.from_vqmodel(model.float(), data, copy_model=False)
        return tokenizer.to(device).eval()


DIFFUSERS_VQMODEL = DiffusersVQFamily()
