"""The causal 3-D encoder and decoder of NVIDIA's Cosmos-Tokenizer DV (discrete video) models, rebuilt.

Cosmos-Tokenizer's ``EncoderFactorized`` / ``DecoderFactorized`` (``cosmos_tokenizer/modules/
layers3d.py``, ``patching.py``) are the DI networks made causal in time: every 3x3 convolution
is factorised into a ``1x3x3`` spatial and a ``3x1x1`` temporal one, the temporal padding
repeats the *first* frame in front (so frame ``i`` never sees frame ``i+1``), the norms are
per-frame GroupNorms with one group, attention is a per-frame spatial block followed by a
causally masked temporal one, and the Haar patcher works on (t, h, w) with the first frame
repeated ``patch_size`` times so that ``1 + k*T`` frames become ``1 + k`` latent frames.

Why every operation is spelled the way it is (as in ``cosmos.networks`` for DI): vqserve must
give Cosmos's *indices*, and an index flips when a latent crosses an FSQ boundary by one ulp.
So each module does the same torch operations in the same order on the same memory layout as
the original (the channels-last-3d input ``numpy2tensor`` hands it; the empty ``repeat`` and
zero ``F.pad`` of a convolution with no padding, which decide the layout the convolution
sees; ``repeat_interleave`` for upsampling). Parameter names are Cosmos's state dict's
(``encoder.down.0.block.0.conv1.0.conv3d.weight``, ``encoder.mid.attn_1.1.q.conv3d.weight``,
``decoder.up.1.upsample.conv2.conv3d.weight``), so an imported archive loads as it is.
Checked against the original code in tests/integration/families/test_cosmos_video.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

HAAR = 0.7071067811865476


def _triple(k) -> tuple[int, int, int]:
    return tuple(k) if isinstance(k, (tuple, list)) else (k, k, k)


def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def per_frame(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[b, c, t, h, w] -> [(b t), c, h, w]`` (einops' ``rearrange`` as Cosmos writes it)."""
    b, c, t, h, w = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w), b


def from_frames(x: torch.Tensor, b: int) -> torch.Tensor:
    bt, c, h, w = x.shape
    return x.reshape(b, bt // b, c, h, w).permute(0, 2, 1, 3, 4)


def repeat_first(x: torch.Tensor, times: int = 1) -> torch.Tensor:
    """Frame 0 repeated ``times`` times in front: the causal padding."""
    return torch.cat([x[:, :, :1, ...].repeat(1, 1, times, 1, 1), x], dim=2)


class CausalConv3d(nn.Module):
    """A 3-D convolution padded causally in time (first frame repeated) and with zeros in space."""

    def __init__(self, c_in: int, c_out: int, kernel=3, stride: int = 1, time_stride: int = 1, padding: int = 1):
        super().__init__()
        kernel = _triple(kernel)
        self.time_pad = (kernel[0] - 1) + (1 - time_stride)
        self.spatial_pad = (padding, padding, padding, padding, 0, 0)
        self.conv3d = nn.Conv3d(c_in, c_out, kernel, stride=(time_stride, stride, stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # its own dtype (a no-op in fp32): a bf16 branch conv of a mixed encoder takes the fp32 stream
        x = repeat_first(x.to(self.conv3d.weight.dtype), self.time_pad)
        return self.conv3d(F.pad(x, self.spatial_pad, mode="constant", value=0.0))


def factorised(c_in: int, c_out: int) -> nn.Sequential:
    """A causal 3x3x3 as ``1x3x3`` then ``3x1x1`` (Cosmos's ``nn.Sequential`` of two)."""
    return nn.Sequential(CausalConv3d(c_in, c_out, (1, 3, 3), padding=1), CausalConv3d(c_out, c_out, (3, 1, 1), padding=0))


def pointwise(c_in: int, c_out: int) -> CausalConv3d:
    return CausalConv3d(c_in, c_out, 1, padding=0)


class FrameNorm(nn.Module):
    """GroupNorm with one group over each frame on its own (Cosmos's ``CausalNormalize``)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.GroupNorm(1, channels, eps=1e-6, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, b = per_frame(x)
        return from_frames(self.norm(x), b)


class ResBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1 = FrameNorm(c_in)
        self.conv1 = factorised(c_in, c_out)
        self.norm2 = FrameNorm(c_out)
        self.conv2 = factorised(c_out, c_out)
        self.nin_shortcut = pointwise(c_in, c_out) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(swish(self.norm2(self.conv1(swish(self.norm1(x))))))
        return self.nin_shortcut(x) + h


class _QKV(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = FrameNorm(channels)
        self.q, self.k, self.v = pointwise(channels, channels), pointwise(channels, channels), pointwise(channels, channels)
        self.proj_out = pointwise(channels, channels)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.norm(x)
        return self.q(h), self.k(h), self.v(h)


class SpatialAttention(_QKV):
    """Single-head attention over the positions of each frame."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)
        (q, b), (k, _), (v, _) = per_frame(q), per_frame(k), per_frame(v)
        n, c, h, w = q.shape
        weights = torch.bmm(q.reshape(n, c, h * w).permute(0, 2, 1), k.reshape(n, c, h * w))
        weights = F.softmax(weights * (int(c) ** (-0.5)), dim=2)
        out = torch.bmm(v.reshape(n, c, h * w), weights.permute(0, 2, 1)).reshape(n, c, h, w)
        return x + self.proj_out(from_frames(out, b))


class TemporalAttention(_QKV):
    """Single-head attention over the frames at each position, causally masked."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)
        b, c, t, h, w = q.shape

        def per_position(y: torch.Tensor) -> torch.Tensor:  # (b h w), t, c
            return y.permute(0, 3, 4, 1, 2).reshape(b * h * w, c, t).permute(0, 2, 1)

        q, k, v = per_position(q), per_position(k), per_position(v)
        weights = torch.bmm(q, k.permute(0, 2, 1)) * (int(c) ** (-0.5))
        weights = weights.masked_fill(torch.tril(torch.ones_like(weights)) == 0, float("-inf"))
        out = torch.bmm(F.softmax(weights, dim=2), v).permute(0, 2, 1).reshape(b * h * w, c, t)
        out = out.reshape(b, h, w, c, t).permute(0, 3, 4, 1, 2)
        return x + self.proj_out(out)


def attention(channels: int) -> nn.Sequential:
    return nn.Sequential(SpatialAttention(channels), TemporalAttention(channels))


class HybridDown(nn.Module):
    """Cosmos's ``CausalHybridDownsample3d``: stride-2 conv plus average pool, in space then time."""

    def __init__(self, channels: int, spatial: bool, temporal: bool):
        super().__init__()
        self.conv1 = CausalConv3d(channels, channels, (1, 3, 3), stride=2, padding=0)
        self.conv2 = CausalConv3d(channels, channels, (3, 1, 1), time_stride=2, padding=0)
        self.conv3 = pointwise(channels, channels)
        self.spatial, self.temporal = spatial, temporal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.spatial or self.temporal):
            return x
        if self.spatial:
            x = F.pad(x, (0, 1, 0, 1, 0, 0), mode="constant", value=0)
            x = self.conv1(x) + F.avg_pool3d(x, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        if self.temporal:
            x = torch.cat([x[:, :, :1, ...], x], dim=2)  # no repeat: the copy would change cat's layout
            x = self.conv2(x) + F.avg_pool3d(x, kernel_size=(2, 1, 1), stride=(2, 1, 1))
        return self.conv3(x)


class HybridUp(nn.Module):
    """Cosmos's ``CausalHybridUpsample3d``: repeat then a residual conv, in time then space."""

    def __init__(self, channels: int, spatial: bool, temporal: bool):
        super().__init__()
        self.conv1 = CausalConv3d(channels, channels, (3, 1, 1), padding=0)
        self.conv2 = CausalConv3d(channels, channels, (1, 3, 3), padding=1)
        self.conv3 = pointwise(channels, channels)
        self.spatial, self.temporal = spatial, temporal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.spatial or self.temporal):
            return x
        if self.temporal:
            factor = 2 if x.shape[2] > 1 else 1
            x = x.repeat_interleave(factor, dim=2)[..., factor - 1:, :, :]
            x = self.conv1(x) + x
        if self.spatial:
            x = x.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4)
            x = self.conv2(x) + x
        return self.conv3(x)


def _filters(channels: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Haar (low, high) ``[channels, 1, 2]`` from the fp32 taps, as Cosmos's buffer is cast."""
    h = torch.tensor([HAAR, HAAR], dtype=torch.float32, device=device)
    low = h.flip(0).reshape(1, 1, -1).repeat(channels, 1, 1).to(dtype)
    high = (h * torch.tensor([1.0, -1.0], device=device)).reshape(1, 1, -1).repeat(channels, 1, 1).to(dtype)
    return low, high


def _rescale() -> torch.Tensor:
    """``2 * sqrt(2)`` as Cosmos computes it: an fp32 0-d tensor (so it never promotes bf16)."""
    return 2 * torch.sqrt(torch.tensor(2.0))


def haar3d(x: torch.Tensor) -> torch.Tensor:
    """One 3-D Haar level: ``[B, C, T, H, W] -> [B, 8C, T/2, H/2, W/2]`` (time, then H, then W)."""
    g = x.shape[1]
    low, high = _filters(g, x.dtype, x.device)
    x = F.pad(x, pad=(0, 1, 0, 1, 0, 1), mode="reflect").to(x.dtype)

    def split(y: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = [1, 1, 1]
        shape[dim] = 2
        stride = [1, 1, 1]
        stride[dim] = 2
        return tuple(F.conv3d(y, f.reshape(g, 1, *shape), groups=g, stride=tuple(stride)) for f in (low, high))

    bands = [x]
    for dim in range(3):
        bands = [part for band in bands for part in split(band, dim)]
    return torch.cat(bands, dim=1) / _rescale()


def ihaar3d(x: torch.Tensor) -> torch.Tensor:
    """The inverse of ``haar3d`` (W, then H, then time; each pair of transposed convs added)."""
    g = x.shape[1] // 8
    low, high = _filters(g, x.dtype, x.device)
    bands = list(torch.chunk(x, 8, dim=1))
    for dim in (2, 1, 0):
        shape = [1, 1, 1]
        shape[dim] = 2
        stride = [1, 1, 1]
        stride[dim] = 2
        merged = []
        for lo, hi in zip(bands[0::2], bands[1::2], strict=True):
            y = F.conv_transpose3d(lo, low.reshape(g, 1, *shape), groups=g, stride=tuple(stride))
            y += F.conv_transpose3d(hi, high.reshape(g, 1, *shape), groups=g, stride=tuple(stride))
            merged.append(y)
        bands = merged
    return bands[0] * _rescale()


class Patcher3d(nn.Module):
    def __init__(self, patch_size: int):
        super().__init__()
        self.patch_size, self.levels = patch_size, int(math.log2(patch_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, rest = torch.split(x, [1, x.shape[2] - 1], dim=2)
        x = torch.cat([first.repeat_interleave(self.patch_size, dim=2), rest], dim=2)
        for _ in range(self.levels):
            x = haar3d(x)
        return x


class Unpatcher3d(Patcher3d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.levels):
            x = ihaar3d(x)
        return x[:, :, self.patch_size - 1:, ...]


class Level(nn.Module):
    """Cosmos's ``down[i]`` / ``up[i]``: ``block``, ``attn`` (empty, or one per block) and a resampler."""

    def __init__(self, widths, with_attention: bool, resample_name: str | None = None, resample=None):
        super().__init__()
        self.block = nn.ModuleList(ResBlock(c_in, c_out) for c_in, c_out in widths)
        self.attn = nn.ModuleList(attention(c_out) for _, c_out in widths) if with_attention else nn.ModuleList()
        self.resample_name = resample_name
        if resample_name:
            self.add_module(resample_name, resample)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.block):
            x = block(x)
            if len(self.attn):
                x = self.attn[i](x)
        return getattr(self, self.resample_name)(x) if self.resample_name else x


class Middle(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1, self.attn_1, self.block_2 = ResBlock(channels, channels), attention(channels), ResBlock(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class VideoEncoder(nn.Module):
    """float pixels ``[B, 3, T, H, W]`` in [-1, 1] -> ``z_channels`` latents (Cosmos's ``EncoderFactorized``).

    ``resamples[i]``: (spatial, temporal) downsampling after level ``i`` (all but the last)."""

    residual_block_types = (ResBlock,)  # vqserve.model.mixed_precision: bf16/fp16 in the branches only

    def __init__(self, channels: int, channels_mult: list[int], num_res_blocks: int, attention_at: list[bool],
                 resamples: list[tuple[bool, bool]], patch_size: int, z_channels: int):
        super().__init__()
        self.patcher3d = Patcher3d(patch_size)
        self.conv_in = factorised(3 * patch_size ** 3, channels)
        mults = [1, *channels_mult]
        levels = []
        for i, mult in enumerate(channels_mult):
            c_in, c_out = channels * mults[i], channels * mult
            widths = [(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks)]
            last = i == len(channels_mult) - 1
            levels.append(Level(widths, attention_at[i], None if last else "downsample",
                                None if last else HybridDown(c_out, *resamples[i])))
        self.down = nn.ModuleList(levels)
        width = channels * channels_mult[-1]
        self.mid = Middle(width)
        self.norm_out = FrameNorm(width)
        self.conv_out = factorised(width, z_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(self.patcher3d(x))
        for level in self.down:
            h = level(h)
        return self.conv_out(swish(self.norm_out(self.mid(h))))


class VideoDecoder(nn.Module):
    """``z_channels`` latents -> float pixels in about [-1, 1] (Cosmos's ``DecoderFactorized``).

    ``resamples[i]``: (spatial, temporal) upsampling after level ``i`` (all but level 0); levels
    run from the last to the first, as Cosmos indexes them."""

    def __init__(self, channels: int, channels_mult: list[int], num_res_blocks: int, attention_at: list[bool],
                 resamples: list[tuple[bool, bool]], patch_size: int, z_channels: int):
        super().__init__()
        c_in = channels * channels_mult[-1]
        self.conv_in = factorised(z_channels, c_in)
        self.mid = Middle(c_in)
        levels: list[Level] = []
        for i in reversed(range(len(channels_mult))):
            c_out = channels * channels_mult[i]
            widths = [(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks + 1)]
            levels.insert(0, Level(widths, attention_at[i], "upsample" if i else None,
                                   HybridUp(c_out, *resamples[i]) if i else None))
            c_in = c_out
        self.up = nn.ModuleList(levels)
        self.norm_out = FrameNorm(c_in)
        self.conv_out = factorised(c_in, 3 * patch_size ** 3)
        self.unpatcher3d = Unpatcher3d(patch_size)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level(h)
        return self.unpatcher3d(self.conv_out(swish(self.norm_out(h))))
