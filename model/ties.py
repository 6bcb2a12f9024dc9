"""Decision margins and fp32 ties: how far each token was from becoming another one.

Two correct fp32 machines (another CPU's kernels, a GPU, ONNX Runtime, another thread
count) compute an encoder's latents with rounding errors of their own, about 1e-6 of a
level (docs/TOKENIZE.md, "fp32 noise"). A latent that lies closer than that to a rounding
boundary can round either way: a *tie*, not a corruption. This module measures how close
each token came (its *margin*) and tells a tie from a corruption, for ``vqserve eval``,
the determinism certificate and ``vqserve verify``:

* FSQ (and Cosmos's): the distance of the bounded pre-rounding latent (``FSQ.bound``, the
  dither offset included) to the nearest rounding boundary between two levels, in levels,
  smallest over channels. Residual FSQ: smallest over its layers.
* LFQ (and Open-MAGVIT2's): the smallest ``|z_c|`` over channels relative to the token's
  RMS latent (the sign decides the bit; 0 is the boundary).
* codebook searches (VQ, diffusers/transformers/LlamaGen nearest code, IBQ's logits): the
  gap between the best and second-best score relative to the larger of the two
  (``(d2 - d1) / d2`` for squared distances, ``(l1 - l2) / max|l|`` for logits).

A recorded token that differs from a re-encoded one is a tie when both codes lie within
``delta`` of the boundary between them, judged on latents recomputed in float64
(:func:`fp64_latents`): for FSQ the codes differ by one level in one channel and that
channel's fp64 bounded latent is within ``delta`` of the boundary between the two levels;
for LFQ one bit differs and that channel's fp64 value is within ``delta`` of 0 relative
to the token's RMS; for codebook searches both codes score within ``delta`` of the fp64
best. Residual FSQ ties are not recognised (a flip in one layer moves every later one).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from vqserve.model.quantizers import FSQ, LFQ, VQ, ResidualFSQ
from vqserve.model.quantizers.cdist import CdistVQ
from vqserve.model.quantizers.l2_nearest import L2NearestCode
from vqserve.model.quantizers.softmax_max import SoftmaxMaxVQ
from vqserve.model.quantizers.squared_distance import SquaredDistanceVQ
from vqserve.model.tokenizer import pixels_to_float

DELTA = 1e-4        # default tie threshold (levels or relative): ~100x the measured fp32 noise
MIN_DELTA = 1e-5    # a differing token with a margin below this is always a tie: delta >= it
_CHUNK = 1 << 22    # scores held at once for a codebook search (rows x codes)


def check_delta(delta: float) -> float:
    """``delta`` as a float in [MIN_DELTA, 0.5); one-line ValueError otherwise."""
    delta = float(delta)
    if not MIN_DELTA <= delta < 0.5:
        raise ValueError(f"the tie threshold must lie in [{MIN_DELTA:g}, 0.5), got {delta:g}")
    return delta


def decision(quantizer) -> str | None:
    """How ``quantizer`` decides a token: fsq | rfsq | lfq | nearest | max_logit; None when
    this module does not know it (no margins, every differing token a mismatch)."""
    if isinstance(quantizer, FSQ):
        return "fsq"
    if isinstance(quantizer, ResidualFSQ):
        return "rfsq"
    if isinstance(quantizer, LFQ):
        return "lfq"
    if isinstance(quantizer, (VQ, CdistVQ, L2NearestCode, SquaredDistanceVQ)):
        return "nearest"
    if isinstance(quantizer, SoftmaxMaxVQ):
        return "max_logit"
    return None


# ---- margins ---------------------------------------------------------------------------------
def fsq_boundary_distance(bounded: torch.Tensor, levels) -> torch.Tensor:
    """Per element: the distance of ``bounded[..., d]`` to the nearest rounding boundary
    ``k + 1/2`` that separates two of the channel's levels (a boundary beyond the outermost
    level separates nothing: rounding clamps there)."""
    levels_t = torch.as_tensor(list(levels), dtype=torch.int64, device=bounded.device)
    low = -torch.div(levels_t, 2, rounding_mode="floor").to(bounded.dtype)
    top = (levels_t - 1).to(bounded.dtype) + low
    rounded = torch.maximum(torch.minimum(bounded.round(), top), low)
    inf = torch.full_like(bounded, float("inf"))
    below = torch.where(rounded > low, (bounded - (rounded - 0.5)).abs(), inf)
    above = torch.where(rounded < top, (bounded - (rounded + 0.5)).abs(), inf)
    return torch.minimum(below, above)


def _rfsq_bounded(quantizer: ResidualFSQ, z: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's bounded latent, the residual chain run in ``z``'s dtype."""
    residual, out = z, []
    for i, layer in enumerate(quantizer.layers):
        scale = quantizer._scale(i).to(z.dtype)
        bounded = layer.bound(residual / scale)
        codes, _ = layer.quantize_bounded(bounded)
        residual = residual - codes * scale
        out.append(bounded)
    return out


def _codebook(quantizer) -> tuple[torch.Tensor, bool]:
    """(codebook as the search sees it, whether latents are l2-normalised first)."""
    if isinstance(quantizer, (VQ, CdistVQ)):
        return quantizer.embed, False
    if isinstance(quantizer, L2NearestCode):
        return quantizer.embedding, quantizer.l2_norm
    return quantizer.embedding, False


def _scores(quantizer, flat: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` scores in ``flat``'s dtype: squared distances (nearest) or logits (max_logit)."""
    embed, normalise = _codebook(quantizer)
    embed = embed.to(flat.dtype)
    if normalise:
        embed, flat = F.normalize(embed, p=2, dim=-1), F.normalize(flat, p=2, dim=-1)
    if decision(quantizer) == "max_logit":
        return flat @ embed.t()
    return ((flat.pow(2).sum(-1, keepdim=True) + embed.pow(2).sum(-1)) - 2 * flat @ embed.t()).clamp_min(0)


def _relative_gap(best: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    scale = torch.maximum(best.abs(), other.abs()).clamp_min(torch.finfo(best.dtype).tiny)
    return (best - other).abs() / scale


def _codebook_margins(quantizer, flat: torch.Tensor) -> torch.Tensor:
    rows = max(1, _CHUNK // quantizer.codebook_size)
    out = []
    for chunk in flat.split(rows):
        scores = _scores(quantizer, chunk)
        top = scores.topk(2, dim=-1, largest=decision(quantizer) == "max_logit").values
        out.append(_relative_gap(top[:, 0], top[:, 1]))
    return torch.cat(out)


@torch.no_grad()
def margins(quantizer, z: torch.Tensor) -> torch.Tensor:
    """Per-position decision margin of channel-last latents ``z[..., d]`` (``[B, h, w, d]``
    for a dithered FSQ), computed in ``z``'s dtype: ``z.shape[:-1]``."""
    kind = decision(quantizer)
    if kind is None:
        raise ValueError(f"no decision margin is defined for {type(quantizer).__name__}")
    if kind == "fsq":
        return fsq_boundary_distance(quantizer.bound(z), quantizer.levels).amin(dim=-1)
    if kind == "rfsq":
        per_layer = [fsq_boundary_distance(b, quantizer.levels).amin(dim=-1) for b in _rfsq_bounded(quantizer, z)]
        return torch.stack(per_layer, dim=-1).amin(dim=-1)
    if kind == "lfq":
        rms = z.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp_min(torch.finfo(z.dtype).tiny)
        return (z.abs() / rms).amin(dim=-1)
    return _codebook_margins(quantizer, z.reshape(-1, z.shape[-1])).view(z.shape[:-1])


def low_margin_counts(margin: torch.Tensor, thresholds=(DELTA, MIN_DELTA)) -> dict:
    """Token count, the count below each threshold, and the smallest margin."""
    return {"tokens": int(margin.numel()), "min": float(margin.min()) if margin.numel() else float("nan"),
            "below": {f"{t:g}": int((margin < t).sum()) for t in thresholds}}


def merge_counts(total: dict | None, part: dict) -> dict:
    """Add ``part`` (:func:`low_margin_counts`) into ``total``."""
    if total is None:
        return copy.deepcopy(part)
    total["tokens"] += part["tokens"]
    total["min"] = min(total["min"], part["min"])
    for k, v in part["below"].items():
        total["below"][k] = total["below"].get(k, 0) + v
    return total


def shares(counts: dict) -> dict:
    """``counts`` with the share of tokens below each threshold (``share_below``)."""
    n = max(counts["tokens"], 1)
    return {**counts, "share_below": {k: v / n for k, v in counts["below"].items()}}


@torch.no_grad()
def fp32_latents(tokenizer, images) -> torch.Tensor:
    """Channel-last fp32 latents of uint8 ``[B,H,W,3]`` images, as ``tokenizer.encode``
    computes them before its quantizer (for the margins of the tokens it gives)."""

    if isinstance(images, np.ndarray):
        images = np.array(images)
    pixels = tokenizer.check_images(images).to(tokenizer.device)
    z = tokenizer.encode_latents(pixels_to_float(pixels, tokenizer.pixel_range))
    return z.permute(0, 2, 3, 1).to(torch.float32)


# ---- the fp64 reference and ties ----------------------------------------------------------------
@torch.no_grad()
def fp64_latents(tokenizer, images) -> torch.Tensor:
    """Channel-last pre-quantizer latents of uint8 ``[B,H,W,3]`` images, the encoder run in
    float64 on the CPU (a deep copy): the reference a tie is judged on. The pixels are made
    in fp32 first, exactly as every fp32 path makes them, then widened."""

    encoder = copy.deepcopy(tokenizer.encoder).to("cpu").double().eval()
    if isinstance(images, np.ndarray):
        images = np.array(images)  # a writable copy: torch refuses to wrap read-only arrays
    pixels = tokenizer.check_images(images).cpu()
    x = pixels_to_float(pixels, tokenizer.pixel_range).double()
    return encoder(x).to(torch.float64).permute(0, 2, 3, 1)


@torch.no_grad()
def tie_margin(quantizer, z64: torch.Tensor, position: tuple[int, ...], recorded: int, fresh: int) -> float | None:
    """The fp64 margin that separates ``recorded`` from ``fresh`` at ``position`` (``(b, y,
    x)`` into ``z64[B, h, w, d]``), or None when the two codes are not adjacent (no single
    boundary between them: never a tie). A tie is ``tie_margin(...) < delta``."""
    kind = decision(quantizer)
    both = torch.tensor([recorded, fresh], dtype=torch.int64)
    if kind == "fsq":
        digits = quantizer.indices_to_level_indices(both)
        moved = torch.nonzero(digits[0] != digits[1]).flatten().tolist()
        if len(moved) != 1 or abs(int(digits[0, moved[0]] - digits[1, moved[0]])) != 1:
            return None
        c = moved[0]
        boundary = int(digits[:, c].min()) - quantizer.levels[c] // 2 + 0.5
        bounded = quantizer.bound(z64)[position + (c,)]
        return abs(float(bounded) - boundary)
    if kind == "lfq":
        codes = quantizer.indices_to_codes(both)
        moved = torch.nonzero(codes[0] != codes[1]).flatten().tolist()
        if len(moved) != 1:
            return None
        z = z64[position]
        return float(z[moved[0]].abs() / z.pow(2).mean().sqrt().clamp_min(torch.finfo(z.dtype).tiny))
    if kind in ("nearest", "max_logit"):
        scores = _scores(quantizer, z64[position][None])[0]
        best = scores.max() if kind == "max_logit" else scores.min()
        return float(torch.maximum(_relative_gap(best, scores[recorded]), _relative_gap(best, scores[fresh])))
    return None


def classify(quantizer, z64: torch.Tensor, recorded: np.ndarray, fresh: np.ndarray,
             delta: float = DELTA) -> tuple[list[dict], list[dict]]:
    """Every position where ``recorded`` and ``fresh`` (int ``[B, h, w]``) differ, split into
    (ties, others); each ``{"at": (b, y, x), "recorded", "fresh", "margin"}`` (margin None:
    the codes are not adjacent)."""
    delta = check_delta(delta)
    ties, others = [], []
    for at in zip(*np.nonzero(np.asarray(recorded) != np.asarray(fresh)), strict=True):
        at = tuple(int(a) for a in at)
        rec, new = int(recorded[at]), int(fresh[at])
        margin = tie_margin(quantizer, z64, at, rec, new) if len(at) == 3 else None
        entry = {"at": at, "recorded": rec, "fresh": new, "margin": margin}
        (ties if margin is not None and margin < delta else others).append(entry)
    return ties, others
