"""The frame rule of causal video tokenizers, and how a clip is cut and padded: one plan, in one place.

Why: a causal video tokenizer (Cosmos DV, VidTok) turns ``1 + k*T`` frames into ``1 + k``
latent frames, and *how* a clip reaches it changes every token: independent windows restart
causality, and padding (zeros around the frame, repeated frames in front of and behind the
clip) reaches every token through per-frame norms and whole-frame attention. So the plan of a
clip - its windows, each window's padding, the latent shape - is computed here once, from the
layout's policies (:class:`vqserve.core.token_layout.TokenLayout`, kind ``video``), by the
model, the server's checks, the clients and the shard writers alike; and a clip that the
policies do not cover is refused in one line before any work, never padded or cut silently.

``ClipPlan.windows``: ``(start, end, front, back)`` per window of input frames, with ``front``
copies of frame ``start`` and ``back`` copies of frame ``end - 1`` added (Cosmos's
``np.pad(mode="edge")``); ``ClipPlan.space``: ``(top, bottom, left, right)`` zero rows and
columns added around every frame. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

PAD_NONE = "none"
PAD_COSMOS = "cosmos"
PAD_POLICIES = (PAD_NONE, PAD_COSMOS)
COSMOS_SPATIAL_ALIGN = 16  # cosmos_tokenizer/utils.py _SPATIAL_ALIGN, for every model
COSMOS_TEMPORAL_ALIGN = 8  # _TEMPORAL_ALIGN, for every model (DV4x8x8 too)
# the most one window's mid-block spatial attention may hold: its fp32 weights are
# [t, h*w, h*w] per clip, (h*w)^2 per latent frame; a larger clip is refused, never tiled
DEFAULT_ATTENTION_BYTES = 8 << 30


def on_rule(frames: int, temporal_factor: int) -> bool:
    return frames >= 1 and (frames - 1) % temporal_factor == 0


def latent_frames(frames: int, temporal_factor: int) -> int:
    """``1 + k*T`` frames -> ``1 + k`` latent frames (the caller checked the rule)."""
    return 1 + (frames - 1) // temporal_factor


def rule_text(temporal_factor: int) -> str:
    return f"1+k*{temporal_factor} frames -> 1+k latent frames"


def _centred(missing: int) -> tuple[int, int]:
    return missing >> 1, missing - (missing >> 1)


@dataclass(frozen=True)
class ClipPlan:
    """How one clip of ``frames`` x ``height`` x ``width`` is tokenized under a layout's policies."""

    windows: tuple[tuple[int, int, int, int], ...]
    space: tuple[int, int, int, int]
    latent: tuple[int, int, int]  # (t, h, w) of the whole clip's tokens
    window_latent: tuple[int, ...]  # latent frames of each window, in order

    @property
    def padded(self) -> bool:
        return any(self.space) or any(front or back for *_, front, back in self.windows)


def plan_clip(frames: int, height: int, width: int, *, factor: int, temporal_factor: int,
              chunk_frames: int = 0, pad: str = PAD_NONE) -> ClipPlan:
    """The windows, padding and latent shape of a clip, or ValueError in one line."""
    if frames < 1 or height < 1 or width < 1:
        raise ValueError(f"clips: frames, H and W must be positive, got {frames}x{height}x{width}")
    if pad == PAD_COSMOS:
        space = (*_centred(-height % COSMOS_SPATIAL_ALIGN), *_centred(-width % COSMOS_SPATIAL_ALIGN))
    elif height % factor or width % factor:
        raise ValueError(f"clips: H and W must be multiples of the spatial factor {factor}, got {height}x{width} "
                         f"(ask for --pad cosmos to pad them)")
    else:
        space = (0, 0, 0, 0)
    step = chunk_frames or frames
    windows, lat = [], []
    for start in range(0, frames, step):
        end = min(start + step, frames)
        n = end - start
        if pad == PAD_COSMOS:
            front, back = _centred(-(n - 1) % COSMOS_TEMPORAL_ALIGN)
        elif on_rule(n, temporal_factor):
            front = back = 0
        else:
            what = "the clip" if not chunk_frames else f"the last {chunk_frames}-frame chunk"
            raise ValueError(f"clips: {what} has {n} frames, off the frame rule {rule_text(temporal_factor)} "
                             f"(use 1+k*{temporal_factor} frames, or ask for a chunk or pad policy)")
        windows.append((start, end, front, back))
        lat.append(latent_frames(n + front + back, temporal_factor))
    h, w = height + space[0] + space[1], width + space[2] + space[3]
    if h % factor or w % factor:
        raise ValueError(f"clips: padded frames of {h}x{w} are not multiples of the spatial factor {factor}")
    return ClipPlan(tuple(windows), space, (sum(lat), h // factor, w // factor), tuple(lat))


def attention_rule(latent_frames_per_window: int, h: int, w: int, limit: int = DEFAULT_ATTENTION_BYTES) -> str | None:
    """Why a window of ``t x h x w`` latents will not fit, or None: the middle blocks'
    spatial attention holds ``t * (h*w)^2`` fp32 weights at once (encoder and decoder)."""
    need = latent_frames_per_window * (h * w) ** 2 * 4
    if need <= limit:
        return None
    return (f"clips: the middle attention of a {latent_frames_per_window}x{h}x{w} latent window needs "
            f"{need / 2**30:.1f} GiB ((h*w)^2 per latent frame), more than the {limit / 2**30:g} GiB allowed; "
            "send smaller frames or ask for shorter chunks (nothing is tiled)")


def latent_windows(t: int, *, temporal_factor: int, chunk_frames: int = 0) -> list[tuple[int, int]]:
    """``(start, end)`` latent frames of each independently decoded window of ``t`` latent frames."""
    if t < 1:
        raise ValueError(f"video tokens need at least one latent frame, got t={t}")
    step = latent_frames(chunk_frames, temporal_factor) if chunk_frames else t
    return [(s, min(s + step, t)) for s in range(0, t, step)]


def decoded_frames(t: int, *, temporal_factor: int, chunk_frames: int = 0) -> int:
    """How many frames ``t`` latent frames decode to under the chunk policy (padding kept)."""
    return sum(1 + (e - s - 1) * temporal_factor
               for s, e in latent_windows(t, temporal_factor=temporal_factor, chunk_frames=chunk_frames))
