"""The shape of one image's tokens, in one place: a grid, a pyramid of scales, or a sequence.

Why: until VAR every tokenizer gave a grid, ``[h, w]`` (``[h, w, Q]`` for residual
quantizers) with ``h = H/f``, and every reader of tokens (the server's checks, the clients,
shards, verify, detokenize) computed that shape from ``factor`` and ``codes_per_position``.
A multi-scale tokenizer (VAR) gives one flat sequence per image, its scales coarse to fine
and row-major within a scale (VAR's own ``torch.cat(img_to_idxBl(x), 1)``), and the
scales depend on the image size. So the shape rule lives here once, and every reader asks
the layout:

* :meth:`TokenLayout.token_shape` - the per-image token shape for an image size, or a
  one-line refusal (``ValueError``);
* :meth:`TokenLayout.image_size` - the image size a per-image token shape decodes to, or a
  one-line refusal naming the accepted shapes (lengths and their scales);
* :meth:`TokenLayout.split` - a flat pyramid cut into its scales, for a consumer;
* :meth:`TokenLayout.to_dict` - what identities, manifests and shard schemas record: ``{}``
  for a grid (files of grid models stay byte for byte what they were), ``{"kind":
  "pyramid", "schedules": [...]}`` or ``{"kind": "sequence", "length": L, "size": [H, W]}``
  otherwise.

A ``"sequence"`` (1-D tokenizers: TiTok) is a fixed number of tokens per image with no
spatial order at all, for one image size (``size``): flat ``[L]`` like a pyramid, and
read by the same non-grid paths (``is_grid`` False), with one "scale" of ``L`` tokens
where a consumer asks for scales.

A ``"video"`` (causal video tokenizers: Cosmos DV, VidTok) gives ``[t, h, w]`` per clip. Its
record holds what a token *means* beyond the weights, because each of these changes tokens:

* the **frame rule**: a causal pass over ``1 + k*T`` frames gives ``1 + k`` latent frames
  (``temporal_factor`` T, 4 or 8): the first frame alone, then T frames per latent frame;
* the **chunk policy** (``chunk_frames``): 0 = the whole clip in one causal pass; N = the clip
  cut into independent windows of N frames (each restarts causality, as Cosmos's
  ``CausalVideoTokenizer.forward`` and its AR stack do), their latent frames concatenated;
* the **pad policy** (``pad``): ``"none"`` refuses a clip (or last window) off the frame rule,
  or a frame size off the spatial factor, in one line; ``"cosmos"`` pads as NVIDIA's
  ``pad_video_batch`` does (zeros around the frame to a multiple of 16, centred; the first and
  last frames repeated to ``1 + k*8`` frames, centred, so partly *in front* of the clip).

Nothing is chunked or padded unless the layout in use says so (:meth:`TokenLayout.with_policy`);
the identity records the layout in use. The plan itself (windows, padding, latent shape) is
:mod:`vqserve.core.video_frames`.

Torch-free: serving front-ends, clients and offline readers import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from vqserve.core.video_frames import (
    PAD_COSMOS,
    PAD_NONE,
    PAD_POLICIES,
    ClipPlan,
    decoded_frames,
    plan_clip,
    rule_text,
)

GRID = "grid"
PYRAMID = "pyramid"
SEQUENCE = "sequence"
VIDEO = "video"
KINDS = (GRID, PYRAMID, SEQUENCE, VIDEO)

Scale = tuple[int, int]
Schedule = tuple[Scale, ...]


def scales_text(schedule: Iterable[Scale]) -> str:
    """``1,2,3,...,16`` for square scales, ``1x2,3x4`` otherwise."""
    return ",".join(str(h) if h == w else f"{h}x{w}" for h, w in schedule)


def schedule_length(schedule: Iterable[Scale]) -> int:
    return sum(h * w for h, w in schedule)


def as_schedule(scales: Iterable) -> Schedule:
    """``[1, 2, (3, 4), [5, 5]]`` -> ``((1,1), (2,2), (3,4), (5,5))``; one line when malformed."""
    out = []
    for s in scales:
        h, w = (s, s) if isinstance(s, (int, np.integer)) else tuple(s)
        if int(h) < 1 or int(w) < 1:
            raise ValueError(f"a scale must be positive, got {s!r}")
        out.append((int(h), int(w)))
    if not out:
        raise ValueError("a pyramid needs at least one scale")
    return tuple(out)


@dataclass(frozen=True)
class TokenLayout:
    """How one image's tokens are shaped. ``factor``: the spatial downsampling (an image of
    ``H x W`` has a latent of ``H/f x W/f``). A pyramid has one ``schedule`` per latent size
    it accepts, each ending at that latent size. A sequence has ``length`` tokens for an
    image of ``size`` (H, W), the only size it takes."""

    factor: int
    kind: str = GRID
    codes_per_position: int = 1
    schedules: tuple[Schedule, ...] = ()
    length: int = 0
    size: tuple[int, int] = (0, 0)
    temporal_factor: int = 0   # video: T in the frame rule 1 + k*T frames -> 1 + k latent frames
    chunk_frames: int = 0      # video: 0 = whole clip in one causal pass; N = independent N-frame windows
    pad: str = PAD_NONE        # video: "none" (refuse off-rule clips) or "cosmos" (pad_video_batch)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"token layout kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == VIDEO:
            self._check_video()
        if self.kind == PYRAMID:
            if not self.schedules:
                raise ValueError("a pyramid token layout needs at least one scale schedule")
            lengths = [schedule_length(s) for s in self.schedules]
            if len(set(lengths)) != len(lengths):
                raise ValueError(f"pyramid schedules must have distinct lengths, got {lengths}")
        if self.kind == SEQUENCE and (self.length < 1 or len(self.size) != 2 or min(self.size) < 1):
            raise ValueError(f"a sequence token layout needs a positive length and image size, got "
                             f"{self.length} tokens for {self.size}")

    def _check_video(self) -> None:
        t, n = self.temporal_factor, self.chunk_frames
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"a video token layout needs a positive temporal factor, got {t!r}")
        if self.pad not in PAD_POLICIES:
            raise ValueError(f"video pad policy must be one of {PAD_POLICIES}, got {self.pad!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or (n and (n - 1) % t):
            raise ValueError(f"a video chunk must be 0 (whole clip) or 1 + k*{t} frames, got {n!r}")

    def with_policy(self, chunk_frames: int | None = None, pad: str | None = None) -> TokenLayout:
        """This video layout with another chunk and/or pad policy (what a request asks for)."""
        if self.kind != VIDEO:
            raise ValueError(f"chunk and pad policies are for video tokens; this model gives {self.noun}")
        return TokenLayout(factor=self.factor, kind=VIDEO, temporal_factor=self.temporal_factor,
                           chunk_frames=self.chunk_frames if chunk_frames is None else int(chunk_frames),
                           pad=self.pad if pad is None else pad)

    def frame_rule_text(self) -> str:
        chunk = f"independent {self.chunk_frames}-frame chunks" if self.chunk_frames else "whole clip"
        return f"{rule_text(self.temporal_factor)}; {chunk}; pad {self.pad}"

    def plan(self, frames: int, height: int, width: int) -> ClipPlan:
        """How a clip is tokenized under this layout's policies (``video_frames.plan_clip``)."""
        return plan_clip(frames, height, width, factor=self.factor, temporal_factor=self.temporal_factor,
                         chunk_frames=self.chunk_frames, pad=self.pad)

    def clip_token_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` of one clip; ValueError (one line) when the policies do not cover it."""
        return self.plan(frames, height, width).latent

    def frames_of(self, t: int) -> int:
        """The frames ``t`` latent frames decode to (padding included)."""
        return decoded_frames(t, temporal_factor=self.temporal_factor, chunk_frames=self.chunk_frames)

    # ---- records --------------------------------------------------------------------
    @classmethod
    def from_info(cls, info) -> TokenLayout:
        """From a ``RuntimeInfo``, a GetModelInfo dict, or a manifest's ``model`` dict."""
        get = info.get if isinstance(info, Mapping) else (lambda k, d=None: getattr(info, k, d))
        return cls.from_dict(get("token_layout") or {}, int(get("factor") or 1),
                             int(get("codes_per_position") or 1))

    @classmethod
    def from_dict(cls, data: Mapping, factor: int, codes_per_position: int = 1) -> TokenLayout:
        if not data or data.get("kind", GRID) == GRID:
            return cls(factor=factor, codes_per_position=codes_per_position)
        if data.get("kind") == SEQUENCE:
            return cls(factor=factor, kind=SEQUENCE, length=int(data.get("length", 0)),
                       size=tuple(int(v) for v in data.get("size", ())))
        if data.get("kind") == VIDEO:
            return cls(factor=factor, kind=VIDEO, temporal_factor=int(data.get("temporal_factor", 0)),
                       chunk_frames=int(data.get("chunk_frames", 0)), pad=str(data.get("pad", PAD_NONE)))
        if data.get("kind") != PYRAMID:
            raise ValueError(f"unknown token layout {data.get('kind')!r}: this vqserve reads {KINDS}")
        return cls(factor=factor, kind=PYRAMID,
                   schedules=tuple(as_schedule(s) for s in data.get("schedules", ())))

    def to_dict(self) -> dict:
        """What files record: nothing for a grid (old files stay as they were)."""
        if self.kind == GRID:
            return {}
        if self.kind == SEQUENCE:
            return {"kind": SEQUENCE, "length": self.length, "size": list(self.size)}
        if self.kind == VIDEO:
            return {"kind": VIDEO, "temporal_factor": self.temporal_factor, "chunk_frames": self.chunk_frames,
                    "pad": self.pad, "frame_rule": self.frame_rule_text()}
        return {"kind": self.kind, "schedules": [[list(s) for s in sch] for sch in self.schedules]}

    @property
    def is_grid(self) -> bool:
        return self.kind == GRID

    @property
    def noun(self) -> str:
        """What the tokens are, in words (refusals)."""
        return {GRID: "a token grid", PYRAMID: "a multi-scale pyramid (flat [L] per image)",
                SEQUENCE: f"a 1-D sequence ({self.length} tokens per image, no spatial grid)",
                VIDEO: f"video tokens [t,h,w] per clip ({self.frame_rule_text()})"}[self.kind]

    def square_sides(self) -> list[int]:
        """The square image sides a fixed-size layout (pyramid, sequence) takes."""
        if self.kind == SEQUENCE:
            return [self.size[0]] if self.size[0] == self.size[1] else []
        return [s[-1][0] * self.factor for s in self.schedules if s[-1][0] == s[-1][1]]

    def shard_grid(self, h: int, w: int) -> tuple[int, int]:
        """What a shard row records as ``grid_height, grid_width`` for an ``h x w`` image of a
        non-grid layout: a pyramid's finest scale (the latent), a sequence's ``1 x L``."""
        return (1, self.length) if self.kind == SEQUENCE else (h // self.factor, w // self.factor)

    # ---- the rules ------------------------------------------------------------------
    def describe(self) -> str:
        """The per-batch token shape in words (errors, help, GetModelInfo's size rule)."""
        if self.kind == GRID:
            return "[B,h,w]" if self.codes_per_position == 1 else f"[B,h,w,{self.codes_per_position}]"
        if self.kind == SEQUENCE:
            return f"[B,L] with L={self.length} (a 1-D sequence, {self.size[0]}x{self.size[1]} images)"
        if self.kind == VIDEO:
            return f"[B,t,h,w] with {self.frame_rule_text()}"
        return "[B,L] with " + "; ".join(f"L={schedule_length(s)} (scales {scales_text(s)}, "
                                        f"{s[-1][0] * self.factor}x{s[-1][1] * self.factor} images)"
                                        for s in self.schedules)

    def schedule_for_latent(self, h: int, w: int) -> Schedule | None:
        return next((s for s in self.schedules if s[-1] == (h, w)), None)

    def size_rule(self, h: int, w: int) -> str | None:
        """Why an ``h x w`` image cannot be tokenized, or None (the factor rule first)."""
        f = self.factor
        if h == 0 or w == 0 or h % f or w % f:
            return f"H and W must be positive multiples of the downsampling factor {f}, got {h}x{w}"
        if self.kind == VIDEO and self.pad == PAD_COSMOS:
            return None if h > 0 and w > 0 else f"H and W must be positive, got {h}x{w}"
        if self.kind == SEQUENCE and (h, w) != tuple(self.size):
            return (f"this 1-D tokenizer takes {self.size[0]}x{self.size[1]} images only ({self.length} tokens "
                    f"each), got {h}x{w}")
        if self.kind == PYRAMID and self.schedule_for_latent(h // f, w // f) is None:
            sizes = ", ".join(f"{s[-1][0] * f}x{s[-1][1] * f}" for s in self.schedules)
            return (f"this multi-scale model has scale schedules for {sizes} images only (its scales must end "
                    f"at the latent size), got {h}x{w}")
        return None

    def token_shape(self, h: int, w: int) -> tuple[int, ...]:
        """The per-image token shape of an ``h x w`` image; ValueError (one line) otherwise."""
        if self.kind == VIDEO:
            raise ValueError(f"this model tokenizes clips ({self.describe()}): give [B,T,H,W,3] frames, not images")
        rule = self.size_rule(h, w)
        if rule:
            raise ValueError(f"images: {rule}")
        f = self.factor
        if self.kind == SEQUENCE:
            return (self.length,)
        if self.kind == PYRAMID:
            return (schedule_length(self.schedule_for_latent(h // f, w // f)),)
        return (h // f, w // f) if self.codes_per_position == 1 else (h // f, w // f, self.codes_per_position)

    def square_size_near(self, target: int) -> int:
        """An image side this layout accepts, near ``target`` (for check images): a grid's
        next multiple of the factor; a pyramid's accepted square size nearest ``target``."""
        f = self.factor
        if self.kind in (GRID, VIDEO):  # a video's frames: any multiple of the factor
            return f * max(1, -(-target // f))
        sides = self.square_sides()
        if not sides:
            raise ValueError(f"this {self.kind} has no square image size ({self.describe()})")
        return min(sides, key=lambda side: (abs(side - target), side))

    def item_rank(self) -> int:
        """The rank of one image's tokens."""
        if self.kind == VIDEO:
            return 3
        if self.kind != GRID:
            return 1
        return 2 if self.codes_per_position == 1 else 3

    def schedule_of(self, item_shape: tuple[int, ...]) -> Schedule:
        """The scales of a flat pyramid of this per-image shape (a sequence: one scale ``1 x L``);
        one line naming the accepted ones."""
        length = int(item_shape[0]) if len(item_shape) == 1 else -1
        if self.kind == SEQUENCE:
            if length != self.length:
                raise ValueError(f"must be [B,{self.length}] (a 1-D sequence of {self.length} tokens per image), "
                                 f"got per-image shape {list(item_shape)}")
            return ((1, self.length),)
        for s in self.schedules:
            if schedule_length(s) == length:
                return s
        accepted = ", ".join(f"{schedule_length(s)} (scales {scales_text(s)})" for s in self.schedules)
        raise ValueError(f"must be [B,L] with L one of {accepted}, got per-image shape {list(item_shape)}")

    def shape_rule(self, shape: tuple[int, ...]) -> str | None:
        """Why a batch of tokens of ``shape`` (batch first) cannot be decoded, or None."""
        if len(shape) != 1 + self.item_rank():
            return f"must be {self.describe()}, got {list(shape)}"
        if self.kind == VIDEO:
            try:
                self.frames_of(int(shape[1]))
            except ValueError as exc:
                return f"must be {self.describe()}: {exc}, got {list(shape)}"
            return None
        if self.kind != GRID:
            try:
                self.schedule_of(tuple(shape[1:]))
            except ValueError as exc:
                return str(exc)
            return None
        q = self.codes_per_position
        if q > 1 and shape[-1] != q:
            return f"must be {self.describe()}, got {list(shape)}"
        return None

    def image_size(self, item_shape: tuple[int, ...]) -> tuple[int, int]:
        """The ``(H, W)`` one image's tokens of ``item_shape`` decode to (shape checked first)."""
        if self.kind == SEQUENCE:
            self.schedule_of(tuple(item_shape))
            return tuple(self.size)
        if self.kind == PYRAMID:
            h, w = self.schedule_of(tuple(item_shape))[-1]
            return h * self.factor, w * self.factor
        if self.kind == VIDEO:
            return int(item_shape[1]) * self.factor, int(item_shape[2]) * self.factor
        return int(item_shape[0]) * self.factor, int(item_shape[1]) * self.factor

    def split(self, tokens: np.ndarray) -> list[np.ndarray]:
        """A flat pyramid ``[..., L]`` cut into its scales ``[..., h, w]``, coarse to fine."""
        if self.kind != PYRAMID:
            return [np.asarray(tokens)]
        tokens = np.asarray(tokens)
        out, at = [], 0
        for h, w in self.schedule_of((tokens.shape[-1],)):
            out.append(tokens[..., at:at + h * w].reshape(*tokens.shape[:-1], h, w))
            at += h * w
        return out

    def scale_bounds(self, length: int) -> list[tuple[int, int]]:
        """``[(start, end), ...]`` of each scale in a flat pyramid of ``length`` tokens."""
        bounds, at = [], 0
        for h, w in self.schedule_of((length,)):
            bounds.append((at, at + h * w))
            at += h * w
        return bounds
