"""The Cosmos DV family: NVIDIA's Cosmos-Tokenizer DV4x8x8 / DV8x8x8 / DV8x16x16, causal video FSQ tokenizers.

A clip ``uint8 [B, T, H, W, 3]`` becomes indices ``[B, t, h, w]`` (FSQ levels [8,8,8,5,5,5],
64,000 codes): ``1 + k*Tc`` frames give ``1 + k`` latent frames (``Tc`` = the temporal
compression, 4 or 8), each frame ``H/f x W/f`` (``f`` = 8 or 16). The tokens are a ``video``
token layout (``vqserve.core.token_layout``), and *how* a clip is fed - one causal pass or
independent windows, padded or not - is the layout's chunk and pad policy: ``encode`` plans
the clip with ``TokenLayout.plan`` and refuses in one line what the policy does not cover.

Exactness follows the DI family (``cosmos.family``): the pixels are normalised in float64 as
``numpy2tensor`` does, on the channels-last-3d layout it hands the network; the networks are
``cosmos.video_networks`` (Cosmos's ops in Cosmos's order); the quantizer is the DI family's
fp32 ``CosmosFSQ`` island; decoded pixels follow ``tensor2numpy``'s uint8 rule. Each clip is
run on its own (PyTorch's CPU convolutions round a batch of two differently from two batches
of one), so tokens do not depend on the batch.

State-dict names are Cosmos's own (``encoder.*``, ``quant_conv.*``, ``post_quant_conv.*``,
``decoder.*``): the TorchScript archives' tensors load as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from vqserve.core.token_layout import VIDEO, TokenLayout
from vqserve.core.video_frames import attention_rule, latent_windows
from vqserve.model.families.base import FamilyConfig
from vqserve.model.families.cosmos.family import (
    COSMOS,
    CosmosFSQ,
    check_fields,
    check_fsq,
    check_powers_of_two,
    deterministic_tensors,
)
from vqserve.model.families.cosmos.networks import to_cosmos_uint8
from vqserve.model.families.cosmos.video_networks import CausalConv3d, VideoDecoder, VideoEncoder
from vqserve.model.families.imported import ImportedConfig, ImportedFamily

VIDEO_FORMAT = "vqserve-cosmos-video"
VIDEO_VERSION = 1


@dataclass
class CosmosVideoConfig(ImportedConfig):
    """Cosmos's ``discrete_video`` config (``cosmos_tokenizer/networks/configs.py``), the fields
    that shape the network. Defaults: DV8x16x16. ``legacy_mode`` moves the decoder's temporal
    upsampling one level (Cosmos's flag; the tensors are the same shapes either way)."""

    FORMAT: ClassVar[str] = VIDEO_FORMAT
    VERSION: ClassVar[int] = VIDEO_VERSION
    LABEL: ClassVar[str] = "Cosmos DV"

    channels: int = 128
    channels_mult: list[int] = field(default_factory=lambda: [2, 4, 4])
    num_res_blocks: int = 2
    attn_resolutions: list[int] = field(default_factory=lambda: [32])
    resolution: int = 1024
    patch_size: int = 4
    spatial_compression: int = 16
    temporal_compression: int = 8
    z_channels: int = 16
    embedding_dim: int = 6
    levels: list[int] = field(default_factory=lambda: [8, 8, 8, 5, 5, 5])
    legacy_mode: bool = False
    # how this directory feeds clips (the video layout's policies, part of its identity):
    # 0 = the whole clip in one causal pass, N = independent N-frame windows; "none" or "cosmos"
    chunk_frames: int = 0
    pad: str = "none"

    def __post_init__(self) -> None:
        label = "Cosmos DV config"
        check_fields(self, label, ("channels", "num_res_blocks", "resolution", "patch_size", "spatial_compression",
                                   "temporal_compression", "z_channels", "embedding_dim"))
        check_powers_of_two(self, label, ("patch_size", "spatial_compression", "temporal_compression"))
        levels = len(self.channels_mult)
        if not (0 <= self.spatial_downs <= levels and 0 <= self.temporal_downs <= levels):
            raise ValueError(f"{label}: compression {self.temporal_compression}x{self.spatial_compression}"
                             f" with patch {self.patch_size} needs more than {levels} levels")
        check_fsq(self, label)
        try:
            self.layout()
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None

    @property
    def name(self) -> str:
        return f"DV{self.temporal_compression}x{self.spatial_compression}x{self.spatial_compression}"

    @property
    def spatial_downs(self) -> int:
        return int(math.log2(self.spatial_compression)) - int(math.log2(self.patch_size))

    @property
    def temporal_downs(self) -> int:
        return int(math.log2(self.temporal_compression)) - int(math.log2(self.patch_size))

    @property
    def codebook_size(self) -> int:
        return math.prod(self.levels)

    def encoder_plan(self) -> tuple[list[bool], list[tuple[bool, bool]]]:
        """Per level: attention (nominal resolution in ``attn_resolutions``; it halves after
        every level but the last, resampled or not, as Cosmos counts) and (spatial, temporal)
        downsampling."""
        res, attention, resamples = self.resolution // self.patch_size, [], []
        for i in range(len(self.channels_mult)):
            attention.append(res in self.attn_resolutions)
            resamples.append((i < self.spatial_downs, i < self.temporal_downs))
            res //= 2
        return attention, resamples

    def decoder_plan(self) -> tuple[list[bool], list[tuple[bool, bool]]]:
        levels = len(self.channels_mult)
        res = (self.resolution // self.patch_size) // 2 ** (levels - 1)
        attention, resamples = [False] * levels, [(False, False)] * levels
        for i in reversed(range(levels)):
            attention[i] = res in self.attn_resolutions
            if i:
                rev = levels - i - 1
                temporal = rev < self.temporal_downs if self.legacy_mode else 0 < rev < self.temporal_downs + 1
                spatial = temporal or (rev < self.spatial_downs and self.spatial_downs > self.temporal_downs)
                resamples[i] = (spatial, temporal)
                res *= 2
        return attention, resamples

    def layout(self) -> TokenLayout:
        return TokenLayout(factor=self.spatial_compression, kind=VIDEO, temporal_factor=self.temporal_compression,
                           chunk_frames=self.chunk_frames, pad=self.pad)

    def family_config(self) -> FamilyConfig:
        return FamilyConfig(family="cosmos-video", factor=self.spatial_compression, codebook_size=self.codebook_size,
                            latent_dim=len(self.levels), quantizer="fsq", levels=list(self.levels),
                            source=self.to_dict())


PRESETS: dict[str, CosmosVideoConfig] = {
    "DV4x8x8": CosmosVideoConfig(spatial_compression=8, temporal_compression=4),
    "DV8x8x8": CosmosVideoConfig(spatial_compression=8, temporal_compression=8),
    "DV8x16x16": CosmosVideoConfig(spatial_compression=16, temporal_compression=8),
}


def normalise_clip(clip: torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, T, H, W, 3]`` -> fp32 ``[B, 3, T, H, W]`` in [-1, 1] exactly as ``numpy2tensor``:
    float64 ``x / 255`` then ``2 x - 1``, one rounding to fp32, on the transposed (channels-last-3d) layout."""
    x = clip.permute(0, 4, 1, 2, 3).to(torch.float64) / 255.0
    return (2.0 * x - 1.0).to(torch.float32)


def pad_clip(clip: torch.Tensor, front: int, back: int, space: tuple[int, int, int, int]) -> torch.Tensor:
    """uint8 ``[B, T, H, W, 3]``: zeros around each frame, the first / last frame repeated in
    time (``pad_video_batch``: space first, then ``np.pad(mode="edge")`` in time)."""
    top, bottom, left, right = space
    if any(space):
        clip = torch.nn.functional.pad(clip, (0, 0, left, right, top, bottom), mode="constant", value=0)
    if front or back:
        clip = torch.cat([clip[:, :1].expand(-1, front, -1, -1, -1), clip, clip[:, -1:].expand(-1, back, -1, -1, -1)], 1)
    return clip.contiguous()


class CosmosVideoTokenizer(nn.Module):
    """A Cosmos DV model: ``encode`` uint8 clips -> ``[B, t, h, w]``, ``decode`` back to uint8 frames."""

    def __init__(self, arch: CosmosVideoConfig):
        super().__init__()
        self.arch = arch
        self.config = arch.family_config()
        shape = dict(channels=arch.channels, channels_mult=arch.channels_mult, num_res_blocks=arch.num_res_blocks,
                     patch_size=arch.patch_size)
        attention, resamples = arch.encoder_plan()
        self.encoder = VideoEncoder(attention_at=attention, resamples=resamples, z_channels=arch.z_channels, **shape)
        self.quant_conv = CausalConv3d(arch.z_channels, arch.embedding_dim, 1, padding=0)
        self.quantizer = CosmosFSQ(arch.levels)
        self.post_quant_conv = CausalConv3d(arch.embedding_dim, arch.z_channels, 1, padding=0)
        attention, resamples = arch.decoder_plan()
        self.decoder = VideoDecoder(attention_at=attention, resamples=resamples, z_channels=arch.z_channels, **shape)
        self.token_layout = arch.layout()

    @property
    def factor(self) -> int:
        return self.arch.spatial_compression

    @property
    def codebook_size(self) -> int:
        return self.arch.codebook_size

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    decodes = True  # what runtimes ask of every tokenizer

    def refuse_decode(self) -> None:
        return None

    # -- float paths ------------------------------------------------------------------------
    def encode_pixels(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``[B, 3, T, H, W]`` in [-1, 1] (an on-rule window) -> indices ``[B, t, h, w]``;
        the networks in their own dtype (a bf16 runtime casts the pixels, as Cosmos does)."""
        h = self.encoder(x.to(self.encoder.conv_in[0].conv3d.weight.dtype))
        z = self.quant_conv(h.to(self.quant_conv.conv3d.weight.dtype))
        return self.quantizer(z.permute(0, 2, 3, 4, 1))[1]

    def decode_window(self, indices: torch.Tensor) -> torch.Tensor:
        """indices ``[B, t, h, w]`` (one window) -> float pixels ``[B, 3, T, H, W]`` in about [-1, 1]."""
        dtype = self.post_quant_conv.conv3d.weight.dtype
        codes = self.quantizer.indices_to_codes(indices).permute(0, 4, 1, 2, 3).to(dtype)
        return self.decoder(self.post_quant_conv(codes))

    # -- uint8 paths --------------------------------------------------------------------------
    def check_precision(self) -> None:
        """bf16/fp16 on CPU is refused in one line: PyTorch's CPU ``avg_pool3d`` (the hybrid
        resamplers, Cosmos's own too) has no kernel for them (torch 2.13)."""
        dtype = self.encoder.conv_in[0].conv3d.weight.dtype
        if dtype != torch.float32 and self.device.type == "cpu":
            raise ValueError(f"Cosmos DV runs in {str(dtype).removeprefix('torch.')} on a GPU only: PyTorch's CPU "
                             "avg_pool3d has no bf16/fp16 kernel; use fp32 (the exact tokens) on CPU")

    def check_clips(self, clips, layout: TokenLayout | None = None):
        self.check_precision()
        clips = torch.as_tensor(clips)
        if clips.dtype != torch.uint8 or clips.ndim != 5 or clips.shape[-1] != 3:
            raise ValueError(f"clips must be uint8 [B,T,H,W,3], got {clips.dtype} {list(clips.shape)}")
        if clips.shape[0] == 0:
            raise ValueError("clips: the batch is empty")
        plan = (layout or self.token_layout).plan(*clips.shape[1:4])
        if rule := attention_rule(max(plan.window_latent), *plan.latent[1:]):
            raise ValueError(rule)
        return clips, plan

    @torch.no_grad()
    def encode(self, clips, layout: TokenLayout | None = None) -> torch.Tensor:
        """uint8 ``[B, T, H, W, 3]`` -> int64 ``[B, t, h, w]`` under ``layout``'s chunk and pad
        policies (default: the whole clip, no padding); one line when the clip is off the rule."""
        clips, plan = self.check_clips(clips, layout)
        out = []
        for clip in clips.split(1):
            parts = [self.encode_pixels(normalise_clip(pad_clip(clip[:, start:end], front, back, plan.space)
                                                       .to(self.device)))
                     for start, end, front, back in plan.windows]
            out.append(torch.cat(parts, dim=1))
        return torch.cat(out)

    @torch.no_grad()
    def decode(self, indices, layout: TokenLayout | None = None) -> torch.Tensor:
        """int ``[B, t, h, w]`` -> uint8 ``[B, T, H, W, 3]``, each chunk decoded on its own (padding kept)."""
        layout = layout or self.token_layout
        indices = torch.as_tensor(indices)
        if indices.is_floating_point() or indices.dtype == torch.bool:
            raise ValueError(f"indices must be an integer tensor, got {indices.dtype}")
        if rule := layout.shape_rule(tuple(indices.shape)):
            raise ValueError(f"indices {rule}")
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.codebook_size):
            raise ValueError(f"indices must be in [0, {self.codebook_size}), got [{int(indices.min())}, "
                             f"{int(indices.max())}]")
        out = []
        for one in indices.to(self.device, torch.int64).split(1):
            windows = latent_windows(one.shape[1], temporal_factor=layout.temporal_factor,
                                     chunk_frames=layout.chunk_frames)
            frames = [to_cosmos_uint8(self.decode_window(one[:, s:e])) for s, e in windows]
            out.append(torch.cat(frames, dim=2))
        return torch.cat(out).permute(0, 2, 3, 4, 1).to(torch.uint8)


# ``deterministic_tensors``' fan-in scaling leaves a DV latent near 0 (std ~0.17), where FSQ
# gives a handful of codes; quant_conv scaled by this spreads the fixtures' over more codes
QUANT_CONV_GAIN = 8.0


def deterministic_video_weights(arch: CosmosVideoConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random DV weights, the same on every machine (the fixtures' and the full-size checks')."""
    weights = deterministic_tensors(CosmosVideoTokenizer(arch).state_dict(), seed)
    for name in ("quant_conv.conv3d.weight", "quant_conv.conv3d.bias"):
        weights[name] = weights[name] * QUANT_CONV_GAIN
    return weights


class CosmosVideoFamily(ImportedFamily):
    name = "cosmos-video"
    description = "NVIDIA Cosmos-Tokenizer DV4x8x8 / DV8x8x8 / DV8x16x16 (video FSQ), converted by `vqserve import cosmos`"
    config_class = CosmosVideoConfig
    tokenizer_class = CosmosVideoTokenizer
    label = "Cosmos DV"


COSMOS_VIDEO = CosmosVideoFamily()
FAMILIES = (COSMOS, COSMOS_VIDEO)  # the cosmos folder's families (declare.py)
