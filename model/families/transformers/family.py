"""The transformers VQ-VAE families: Janus, Emu3 and Chameleon image tokenizers as transformers ships them.

A directory that ``save_pretrained`` writes for one of transformers' VQ-VAE classes is a
model directory: ``config.json`` (``model_type`` ``janus_vqgan``, ``emu3_vqgan`` or
``chameleon_vqgan``) and ``model.safetensors``, optionally with the image processor's
``preprocessor_config.json`` beside them (``image_processor.save_pretrained(DIR)``).

What runs (the same approach as ``diffusers.family``): transformers' own classes are built from
the config and hold the weights, so every layer is the original code; vqserve calls their
submodules and replaces only the nearest-code search with ``SquaredDistanceVQ``
(``quantizers.squared_distance``), the class's exact expression in an fp32 island. Around them:

* pixels are scaled as the image processor's numpy backend does it (``ProcessorPixels``):
  ``x * rescale_factor`` in float64, rounded to float32, then ``(v - mean) / std`` in
  float32 - for Janus and Emu3 (rescale 1/255, mean = std = 0.5) exactly ``x / 127.5 - 1``,
  for Chameleon (``ChameleonImageProcessor``: rescale 0.0078, mean = std = 1) ``x * 0.0078
  - 1``. A ``preprocessor_config.json`` in the directory overrides these three values;
* decoded pixels follow the processor's ``postprocess``: ``(y - (-mean/std)) / (1/std)`` in
  float32, times ``1/rescale_factor`` in float64, clipped to [0, 255] and truncated to uint8;
* Emu3 is a video tokenizer: ``Emu3VQVAE.encode`` repeats an image
  ``temporal_downsample_factor`` times along time and its temporal layers reduce those
  frames to one; ``decode`` of one token grid returns ``temporal_downsample_factor`` frames
  and keeps the first (``video[:, 0]``). vqserve does exactly that, with the class's layers,
  its 2D layers included on every (identical) frame: computing one copy would be 4x cheaper
  but CPU convolutions round differently for another batch size, so it would not be the
  class's numbers;
* Chameleon's transformers class has no decoder: the tokenizer encodes only, and a decode
  is refused in one line (``TokenizerBase.decodes``).

``transformers`` is an optional dependency (``pip install 'vqserve[transformers]'``).
Weights are read from safetensors only; a pickle is refused before anything is unpickled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vqserve.model.families.base import (
    CONFIG_NAME,
    Family,
    FamilyConfig,
    read_config_json,
    read_safetensors,
)
from vqserve.model.families.imported import key_mismatch
from vqserve.model.precision import Fp32StateModule, cast_to
from vqserve.model.quantizers.squared_distance import SquaredDistanceVQ
from vqserve.model.tokenizer import TokenizerBase

WEIGHTS_NAME = "model.safetensors"
PROCESSOR_NAME = "preprocessor_config.json"


# -- what each kind is --------------------------------------------------------------------------
@dataclass(frozen=True)
class PixelScaling:
    """The image processor's ``rescale_factor``, ``image_mean`` and ``image_std``."""

    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    def to_dict(self) -> dict:
        return {"rescale_factor": self.rescale_factor, "image_mean": list(self.image_mean),
                "image_std": list(self.image_std)}


@dataclass(frozen=True)
class Kind:
    """One transformers VQ-VAE class and how its tokens are defined."""

    family: str            # vqserve's family name
    model_type: str        # config.json's model_type for the VQ-VAE alone
    whole_type: str        # the whole multimodal model's model_type (its directory is refused with the fix)
    model_class: str       # the transformers class that holds the weights
    whole_class: str       # the whole model's class, for the save instructions
    config_class: str
    codebook_key: str      # the config field holding the number of codes
    product: str           # how the class forms z . e (SquaredDistanceVQ.product)
    decode_l2_norm: bool   # the class normalises looked-up codes before decoding
    has_decoder: bool
    residual_block: str    # the encoder's residual block class (conv1/conv2 branches)
    pixels: PixelScaling   # the published image processor's scaling
    description: str


SIGNED_PIXELS = PixelScaling(1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # x / 127.5 - 1, exactly
KINDS: tuple[Kind, ...] = (
    Kind("transformers-janus", "janus_vqgan", "janus", "JanusVQVAE", "JanusForConditionalGeneration",
         "JanusVQVAEConfig", "num_embeddings", "einsum", True, True, "JanusVQVAEResnetBlock",
         SIGNED_PIXELS, "Janus / Janus-Pro image tokenizer (transformers' JanusVQVAE)"),
    Kind("transformers-emu3", "emu3_vqgan", "emu3", "Emu3VQVAE", "Emu3ForConditionalGeneration",
         "Emu3VQVAEConfig", "codebook_size", "matmul", False, True, "Emu3VQVAEResnetBlock",
         SIGNED_PIXELS, "Emu3 vision tokenizer, one image as one frame (transformers' Emu3VQVAE)"),
    Kind("transformers-chameleon", "chameleon_vqgan", "chameleon", "ChameleonVQVAE",
         "ChameleonForConditionalGeneration", "ChameleonVQVAEConfig", "num_embeddings", "einsum",
         False, False, "ChameleonVQVAEEncoderResnetBlock",
         PixelScaling(0.0078, (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)),  # ChameleonImageProcessor's own
         "Chameleon image tokenizer, encode only (transformers' ChameleonVQVAE has no decoder)"),
)


def import_transformers():
    """The ``transformers`` module, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"serving a transformers VQ-VAE needs the transformers package "
                          f"(pip install 'vqserve[transformers]'): {exc}") from None
    return transformers


# -- pixels in and out, as the image processor computes them ----------------------------------------
class ProcessorPixels(Fp32StateModule):
    """uint8-valued float pixels <-> the model's input / output, with the image processor's rounding.

    An ``Fp32StateModule``: its constants stay fp32 when a network around it is cast to
    bf16/fp16, so the pixels a low-precision model sees are the fp32 ones, rounded once."""

    def __init__(self, scaling: PixelScaling, inverse: bool = False):
        super().__init__()
        self.scaling = scaling
        self.inverse = inverse
        mean, std = list(scaling.image_mean), list(scaling.image_std)
        if inverse:  # postprocess: normalize with mean' = -mean/std, std' = 1/std (in Python floats, as there)
            mean, std = [-m / s for m, s in zip(mean, std, strict=True)], [1 / s for s in std]
        # float32 constants, as numpy's normalize makes them (np.array(mean, dtype=image.dtype))
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

    def extra_repr(self) -> str:
        return f"{'postprocess' if self.inverse else 'preprocess'}, {self.scaling}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inverse:
            # rescale: float64 product, rounded to float32; normalize: float32 (numpy's order)
            v = (x.to(torch.float64) * self.scaling.rescale_factor).to(torch.float32)
            # contiguous NCHW, as the processor hands it over: CPU convolutions round
            # differently on a channels-last tensor
            return ((v - self.mean) / self.std).contiguous()
        v = (x.to(torch.float32) - self.mean) / self.std
        v = (v.to(torch.float64) * (1.0 / self.scaling.rescale_factor)).to(torch.float32)
        return v.clamp(0, 255).floor()  # numpy's astype(uint8) truncates


# -- the networks: the class's own submodules -------------------------------------------------------
class ImageVQEncoder(nn.Module):
    """Janus / Chameleon: pixels [0, 255] -> ``encoder`` -> ``quant_conv`` -> latents NCHW."""

    def __init__(self, pixels: ProcessorPixels, net: nn.Module, quant_conv: nn.Module, residual_block: type):
        super().__init__()
        self.pixels = pixels
        self.net = net
        self.quant_conv = quant_conv
        self.residual_block_types = (residual_block,)  # vqserve.model.mixed_precision's fp32 stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pixels(x)  # the dtype door: transformers' networks trust their input's dtype
        return self.quant_conv(self.net(cast_to(x, self.net.conv_in.weight.dtype)))


class ImageVQDecoder(nn.Module):
    """Janus: codes NCHW -> ``post_quant_conv`` -> ``decoder`` -> pixels [0, 255] (floored)."""

    def __init__(self, post_quant_conv: nn.Module, net: nn.Module, pixels: ProcessorPixels):
        super().__init__()
        self.post_quant_conv = post_quant_conv
        self.net = net
        self.pixels = pixels

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        # get_codebook_entry hands over contiguous NCHW codes
        codes = cast_to(codes, self.post_quant_conv.weight.dtype).contiguous()
        return self.pixels(self.net(self.post_quant_conv(codes)))


class Emu3ImageEncoder(nn.Module):
    """``Emu3VQVAE.encode`` of a 4D image batch: pixels [0, 255] -> latents NCHW of its one frame.

    As the class does it: each image repeated ``frames`` times along time, the class's
    encoder (2D layers on every copy, then the temporal layers that reduce the copies to one
    frame) and ``quant_conv``. The 2D layers run on all the copies although they are
    identical: PyTorch's CPU convolutions round differently for a batch of B and of
    ``frames`` x B images (measured), so computing one copy would not give the class's latents."""

    def __init__(self, pixels: ProcessorPixels, net: nn.Module, quant_conv: nn.Module, frames: int,
                 residual_block: type):
        super().__init__()
        self.pixels = pixels
        self.net = net
        self.quant_conv = quant_conv
        self.frames = int(frames)
        self.residual_block_types = (residual_block,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = cast_to(self.pixels(x), self.net.conv_in.weight.dtype)
        video = x.unsqueeze(1).repeat(1, self.frames, 1, 1, 1)  # (B, T, C, H, W), as encode builds it
        h = self.net(video)  # (B, 1, C, h, w): the temporal layers leave one frame
        h = self.quant_conv(h.permute(0, 2, 1, 3, 4))  # (B, C, 1, h, w), as encode permutes it
        return h[:, :, 0]


class Emu3ImageDecoder(nn.Module):
    """``Emu3VQVAE.decode`` of a 3D token grid: codes NCHW -> the first frame's pixels [0, 255].

    ``Emu3VQVAEDecoder.forward`` step for step (its temporal layers turn the one frame into
    ``frames``, its 2D layers decode them all, as there: batch-dependent rounding again),
    then ``video[:, 0]`` as ``decode`` returns it. One change, not numerical: the class splits
    its (hidden, quant) pair with ``torch.chunk``, here two slices, because torch.export
    cannot prove chunk's split count for a symbolic batch and would fix the batch size."""

    def __init__(self, post_quant_conv: nn.Module, net: nn.Module, pixels: ProcessorPixels):
        super().__init__()
        self.post_quant_conv = post_quant_conv
        self.net = net
        self.pixels = pixels

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        net = self.net
        batch = codes.shape[0]
        # quant: (B, C, T=1, h, w), contiguous, as Emu3VQVAE.decode builds it
        quant = cast_to(codes, self.post_quant_conv.conv.weight.dtype).unsqueeze(2).contiguous()
        post_quant = self.post_quant_conv(quant)
        both = torch.cat((post_quant.permute(0, 2, 1, 3, 4), quant.permute(0, 2, 1, 3, 4)), dim=0)
        both = both.permute(0, 2, 1, 3, 4)
        for layer in net.time_res_stack:
            both = layer(both)
        for layer in net.time_conv:
            both = layer(both)
            both *= torch.sigmoid(both)
        both = both.permute(0, 2, 1, 3, 4)  # (2B, T, C, h, w)
        hidden, quant_states = both[:batch], both[batch:]
        frames = hidden.shape[1]
        hidden = hidden.reshape(-1, *hidden.shape[2:])
        quant_states = quant_states.reshape(-1, *quant_states.shape[2:])
        h = net.conv_in(hidden)
        h = net.middle_block(h, quant_states)
        h = net.up_block(h, quant_states)
        h = net.norm_out(h, quant_states)
        h *= torch.sigmoid(h)
        h = net.conv_out(h)
        return self.pixels(h.reshape(batch, frames, *h.shape[1:])[:, 0])


class TransformersVQTokenizer(TokenizerBase):
    """A transformers VQ-VAE as a vqserve tokenizer (quantizer replaced by ``SquaredDistanceVQ``).

    ``pixel_range`` is (0, 255): the encoder receives pixels unchanged and scales them as the
    image processor does; the decoder returns the processor's postprocessed values."""

    pixel_range = (0.0, 255.0)

    def __init__(self, kind: Kind, config: FamilyConfig, encoder: nn.Module, quantizer: SquaredDistanceVQ,
                 decoder: nn.Module | None):
        super().__init__()
        self.kind = kind
        self.config = config
        self.encoder = encoder
        self.quantizer = quantizer
        self.decoder = decoder
        if decoder is None:
            self.no_decoder_reason = f"transformers' {kind.model_class} has no decoder"

    @classmethod
    def from_model(cls, kind: Kind, model: nn.Module, config: FamilyConfig,
                   scaling: PixelScaling | None = None) -> TransformersVQTokenizer:
        """A transformers VQ-VAE's submodules (shared, not copied) and its codebook."""
        import importlib

        scaling = scaling or kind.pixels
        cfg = model.config
        module = importlib.import_module(type(model).__module__)
        block = getattr(module, kind.residual_block)
        codebook = model.quantize.embedding.weight.detach()
        quantizer = SquaredDistanceVQ(codebook.shape[0], codebook.shape[1], kind.product, kind.decode_l2_norm)
        quantizer.embedding.copy_(codebook)
        pixels_in = ProcessorPixels(scaling)
        if kind.model_type == "emu3_vqgan":
            encoder = Emu3ImageEncoder(pixels_in, model.encoder, model.quant_conv,
                                       cfg.temporal_downsample_factor, block)
            decoder = Emu3ImageDecoder(model.post_quant_conv, model.decoder, ProcessorPixels(scaling, True))
        else:
            encoder = ImageVQEncoder(pixels_in, model.encoder, model.quant_conv, block)
            decoder = (ImageVQDecoder(model.post_quant_conv, model.decoder, ProcessorPixels(scaling, True))
                       if kind.has_decoder else None)
        return cls(kind, config, encoder, quantizer, decoder)


# -- the family -------------------------------------------------------------------------------------
def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def read_processor(path: Path, default: PixelScaling) -> tuple[PixelScaling, str]:
    """The scaling of ``preprocessor_config.json`` when the directory holds one, else ``default``.

    Only what decides the pixel values is read (``do_rescale``, ``rescale_factor``,
    ``do_normalize``, ``image_mean``, ``image_std``); resizing, padding and cropping are the
    caller's business (vqserve tokenizes the pixels it is given)."""
    file = path / PROCESSOR_NAME
    if not file.is_file():
        return default, "default"
    where = str(file)
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{where} is not readable JSON: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} must hold a JSON object")
    if data.get("do_rescale", True) is not True or data.get("do_normalize", True) is not True:
        raise ValueError(f"{where}: vqserve serves processors that rescale and normalize "
                         "(do_rescale and do_normalize true)")

    def triple(key: str, fallback: tuple[float, ...]) -> tuple[float, float, float]:
        value = data.get(key, list(fallback))
        value = [value] * 3 if isinstance(value, int | float) and not isinstance(value, bool) else value
        if (not isinstance(value, list) or len(value) != 3
                or not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
            raise ValueError(f"{where}: {key} must be a number or a list of 3 numbers, got {value!r}")
        return tuple(float(v) for v in value)

    rescale = data.get("rescale_factor", default.rescale_factor)
    if isinstance(rescale, bool) or not isinstance(rescale, int | float) or not (math.isfinite(rescale) and rescale > 0):
        raise ValueError(f"{where}: rescale_factor must be a positive number, got {rescale!r}")
    mean, std = triple("image_mean", default.image_mean), triple("image_std", default.image_std)
    if any(s == 0 for s in std):
        raise ValueError(f"{where}: image_std must not contain 0, got {list(std)}")
    return PixelScaling(float(rescale), mean, std), PROCESSOR_NAME


class TransformersVQFamily(Family):
    """One of transformers' VQ-VAE classes (``KINDS``), saved with ``save_pretrained``."""

    weights_name = WEIGHTS_NAME

    def __init__(self, kind: Kind):
        self.kind = kind
        self.name = kind.family
        self.description = kind.description

    def claims(self, config: dict) -> bool:
        # the whole multimodal model's directory too, to tell the user how to get the VQ-VAE
        return config.get("model_type") in (self.kind.model_type, self.kind.whole_type)

    def model_files(self, path: Path) -> tuple[str, ...]:
        files = (CONFIG_NAME, WEIGHTS_NAME)
        return files + ((PROCESSOR_NAME,) if (Path(path) / PROCESSOR_NAME).is_file() else ())

    def check_files(self, path: Path) -> None:
        if not (path / WEIGHTS_NAME).is_file():
            if (path / f"{WEIGHTS_NAME}.index.json").is_file():
                raise ValueError(f"{path} holds a sharded checkpoint ({WEIGHTS_NAME}.index.json); vqserve "
                                 f"reads one {WEIGHTS_NAME}: save it again with "
                                 "save_pretrained(DIR, max_shard_size='100GB')")
            if (path / "pytorch_model.bin").is_file():
                raise ValueError(f"{path} holds pytorch_model.bin only: vqserve reads safetensors only "
                                 "(a .bin is a pickle); save it again with save_pretrained(DIR) "
                                 "(safetensors by default) where you trust the file")
        super().check_files(path)

    def config_dict(self, path: Path) -> dict:
        """``config.json``, checked: the VQ-VAE's own, not the whole model's."""
        data = read_config_json(path)
        where = str(path / CONFIG_NAME)
        if data is None:
            raise ValueError(f"{where} is missing or not a JSON object")
        kind = self.kind
        if data.get("model_type") == kind.whole_type:
            raise ValueError(f"{path} holds the whole {kind.whole_class} (model_type {kind.whole_type!r}), "
                             f"not its image tokenizer: save that once with {kind.whole_class}."
                             f"from_pretrained(DIR, dtype='auto').model.vqmodel.save_pretrained(OUT) "
                             "and pass OUT")
        return data

    def transformers_config(self, path: Path):
        """The transformers config object (defaults filled in), with a one-line error."""
        transformers = import_transformers()
        data = self.config_dict(path)
        where = str(path / CONFIG_NAME)
        try:
            config = getattr(transformers, self.kind.config_class).from_dict(data)
        except Exception as exc:  # noqa: BLE001 - strict dataclass validation, bad values: one line
            raise ValueError(f"{where}: {_one_line(exc)}") from None
        check_config(self.kind, config, where)
        return config

    def family_config(self, config, path: Path, scaling: PixelScaling, scaling_source: str) -> FamilyConfig:
        return FamilyConfig(family=self.name, factor=2 ** (len(config.channel_multiplier) - 1),
                            codebook_size=int(getattr(config, self.kind.codebook_key)),
                            latent_dim=int(config.embed_dim), quantizer="vq",
                            source={**self.config_dict(path),
                                    "vqserve_pixels": {**scaling.to_dict(), "from": scaling_source}})

    def read_config(self, path: Path) -> FamilyConfig:
        config = self.transformers_config(path)
        return self.family_config(config, path, *read_processor(path, self.kind.pixels))

    def load(self, path: Path, device: str | torch.device = "cpu") -> TransformersVQTokenizer:
        config = self.transformers_config(path)
        scaling, scaling_source = read_processor(path, self.kind.pixels)
        self.check_files(path)
        transformers = import_transformers()
        where = str(path / WEIGHTS_NAME)
        with torch.device("meta"):  # no random init of weights about to be replaced
            model = getattr(transformers, self.kind.model_class)(config)
        load_weights(model, read_safetensors(path / WEIGHTS_NAME, "save it with save_pretrained(DIR)"), where)
        model = model.float().eval()  # bf16/fp16 weight files are served from fp32 copies
        tokenizer = TransformersVQTokenizer.from_model(
            self.kind, model, self.family_config(config, path, scaling, scaling_source), scaling)
        return tokenizer.to(device).eval()


def check_config(kind: Kind, config, where: str) -> None:
    """Refuse, before any weights are read, what the class cannot run or vqserve cannot serve."""
    def bad(rule: str) -> ValueError:
        return ValueError(f"{where}: {rule}")

    if config.in_channels != 3 or getattr(config, "out_channels", 3) != 3:
        raise bad(f"only RGB models are supported (in_channels/out_channels 3), got "
                  f"{config.in_channels}/{getattr(config, 'out_channels', 3)}")
    if config.double_latent:
        raise bad("double_latent true is not supported (the encoder's output would not fit quant_conv)")
    mult = list(config.channel_multiplier)
    if not mult or min(mult) < 1:
        raise bad(f"channel_multiplier must be a non-empty list of positive integers, got {mult}")
    widths = [config.base_channels * m for m in [1, *mult]]
    if any(w % 32 for w in widths) or config.base_channels < 1:
        raise bad(f"base_channels x channel_multiplier must be multiples of 32 (GroupNorm groups), got {widths}")
    if int(getattr(config, kind.codebook_key)) < 2 or config.embed_dim < 1:
        raise bad(f"{kind.codebook_key} must be at least 2 and embed_dim at least 1")
    if kind.model_type == "emu3_vqgan":
        frames = config.temporal_downsample_factor
        if frames < 1 or frames & (frames - 1):
            raise bad(f"temporal_downsample_factor must be a power of 2, got {frames}")
        if config.embed_dim != config.latent_channels:
            raise bad(f"embed_dim ({config.embed_dim}) must equal latent_channels ({config.latent_channels}): "
                      "Emu3's decoder concatenates them")
        attention = {config.base_channels * mult[-1]} | {config.base_channels * mult[i]
                                                        for i in config.attn_resolutions if 0 <= i < len(mult)}
        if attention != {config.hidden_size} or config.hidden_size % config.num_attention_heads:
            raise bad(f"hidden_size ({config.hidden_size}) must equal the channels where attention runs "
                      f"({sorted(attention)}) and divide by num_attention_heads")


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Strict load with one line naming the first missing / unexpected / mis-shaped tensor."""
    expected = model.state_dict()
    mismatch = key_mismatch(expected, state)
    if mismatch:
        raise ValueError(f"weights in {where} do not match config.json: {mismatch}")
    for key, tensor in expected.items():
        got = state[key]
        if tuple(got.shape) != tuple(tensor.shape):
            raise ValueError(f"weights in {where} do not match config.json: {key} has shape "
                             f"{tuple(got.shape)}, the config needs {tuple(tensor.shape)}")
        if tensor.is_floating_point() and not got.is_floating_point():
            raise ValueError(f"weights in {where}: {key} must be a floating-point tensor, got {got.dtype}")
    model.load_state_dict(state, strict=True, assign=True)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"weights in {where} do not set {left[:5]}")


TRANSFORMERS_FAMILIES: tuple[TransformersVQFamily, ...] = tuple(TransformersVQFamily(k) for k in KINDS)
