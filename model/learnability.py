"""Learnability of a tokenizer's tokens: what a generative model trained on them has to cope with.

PSNR and colour say how well tokens describe a picture. A prior (autoregressive or masked)
trained on the tokens also needs the same content to be spelled the same way wherever it
stands, crops of the grid to stay meaningful, and neighbours that predict each other. Four
figures, per photograph and in total (``vqserve eval`` reports them beside PSNR):

* **shift equivariance** — the photograph is cut at an offset of ``s`` whole tokens
  (``s x factor`` pixels, both axes) and encoded again; the share of *interior* tokens (more
  than ``margin`` tokens from every edge of either grid, where padding reaches) that equal
  the unshifted encoding's token at the same content. 1.0 for a translation-equivariant
  tokenizer; a position-dependent code (an ordered dither) spells content differently at
  each position modulo its period.
* **token-grid crop cost** — the grid cropped by ``k`` tokens at the top and left is decoded
  on its own and compared with the same region of the whole grid's decoding, both against
  the original pixels: PSNR(crop decoded) − PSNR(whole decoded, cropped), in dB. About 0
  when a crop keeps every token's meaning; negative when tokens depend on where the grid
  starts (random crops in training then show the decoder grids it never saw).
* **perplexity** — ``2 ** entropy`` of the photograph's code histogram (the effective number
  of codes).
* **held-out bits per token** — how predictable a token is from its left and upper
  neighbours, under a simple, documented model fitted on the *other* photographs
  (leave-one-photo-out): ``P(t | left a, up b) = (P_left(t | a) + P_up(t | b)) / 2``, each
  conditional a Dirichlet-smoothed bigram ``(n(a, t) + BETA * P(t)) / (n(a) + BETA)`` that
  backs off to the add-``ALPHA`` unigram ``P(t)``; a token with no left (up) neighbour uses
  ``P(t)`` for that half. Reported with the unigram's bits (no context) and what the context
  saves. Lower is easier to learn; it is a yardstick between tokenizers on the same
  photographs, not an estimate of a real prior's loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

ALPHA = 0.5      # add-alpha pseudo-count of every code in the unigram
BETA = 16.0      # strength of the bigrams' back-off to the unigram (pseudo-counts)
SHIFTS = (1, 2, 3)
CROPS = (1, 3)
MARGIN = 2       # tokens next to an edge are left out of the shift comparison


def _grid(tokenizer, img_u8: np.ndarray) -> torch.Tensor:
    return tokenizer.encode(torch.tensor(np.asarray(img_u8))[None])[0].cpu()


def shift_equivariance(tokenizer, img_u8: np.ndarray, shifts: Sequence[int] = SHIFTS,
                       margin: int = MARGIN) -> dict[int, float]:
    """Share of interior tokens unchanged when the image moves by ``s`` tokens, per ``s``.

    ``img_u8``: ``[H, W, 3]`` with sides multiples of the factor and at least
    ``(max(shifts) + 2 * margin + 1) * factor`` pixels larger than the shift."""
    f, top = tokenizer.factor, max(shifts)
    h, w = img_u8.shape[0] - top * f, img_u8.shape[1] - top * f
    if min(h, w) // f <= 2 * margin + top:
        raise ValueError(f"a {img_u8.shape[1]}x{img_u8.shape[0]} image is too small to measure shifts of "
                         f"up to {top} tokens with a {margin}-token margin")
    base = _grid(tokenizer, img_u8[:h, :w])
    gh, gw = base.shape[0], base.shape[1]
    out = {}
    for s in shifts:
        moved = _grid(tokenizer, img_u8[s * f:s * f + h, s * f:s * f + w])
        # moved[i, j] shows the content of base[i + s, j + s]; interior of both grids
        a = base[s + margin:gh - margin, s + margin:gw - margin]
        b = moved[margin:gh - margin - s, margin:gw - margin - s]
        same = (a == b).reshape(a.shape[0], a.shape[1], -1).all(dim=-1)
        out[s] = float(same.float().mean())
    return out


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    err = float(((a.to(torch.float64) - b.to(torch.float64)) ** 2).mean())
    return float("inf") if err == 0 else 10 * math.log10(255.0**2 / err)


def crop_cost(tokenizer, img_u8: np.ndarray, grid: torch.Tensor, recon_u8: torch.Tensor,
              crops: Sequence[int] = CROPS) -> dict[int, float]:
    """dB lost by decoding the grid cropped by ``k`` tokens (top and left) instead of cropping
    the whole grid's decoding, per ``k``: 0 = crops keep every token's meaning."""
    f, img = tokenizer.factor, torch.tensor(np.asarray(img_u8))
    out = {}
    for k in crops:
        cropped = tokenizer.decode(grid[k:, k:][None].to(tokenizer.device))[0].cpu()
        region = img[k * f:, k * f:]
        out[k] = _psnr(region, cropped) - _psnr(region, recon_u8[k * f:, k * f:])
    return out


def perplexity(grid: torch.Tensor, codebook_size: int) -> float:
    counts = np.bincount(grid.reshape(-1).numpy().astype(np.int64), minlength=codebook_size)
    p = counts[counts > 0] / counts.sum()
    return float(2 ** -(p * np.log2(p)).sum())


# ---- held-out bits per token -------------------------------------------------------------------
def _planes(grid: np.ndarray) -> list[np.ndarray]:
    """A grid ``[h, w]`` or ``[h, w, Q]`` as Q planes (residual depths are modelled apart)."""
    return [grid] if grid.ndim == 2 else [grid[..., q] for q in range(grid.shape[-1])]


def _pairs(planes: Sequence[np.ndarray], axis: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (context * size + token) keys of every neighbour pair along ``axis``, with counts."""
    keys = [((p[:, :-1] if axis == 1 else p[:-1]).astype(np.int64) * size
             + (p[:, 1:] if axis == 1 else p[1:])).ravel() for p in planes]
    return np.unique(np.concatenate(keys) if keys else np.zeros(0, np.int64), return_counts=True)


def _count(keys: np.ndarray, table: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    uniq, counts = table
    if uniq.size == 0:
        return np.zeros(keys.shape, np.float64)
    at = np.clip(np.searchsorted(uniq, keys), 0, uniq.size - 1)
    return np.where(uniq[at] == keys, counts[at], 0).astype(np.float64)


class BigramModel:
    """The left/up smoothed bigram of the module docstring, fitted on some token grids."""

    def __init__(self, grids: Sequence[np.ndarray], codebook_size: int):
        planes = [p for g in grids for p in _planes(np.asarray(g))]
        v = codebook_size
        unigram = np.bincount(np.concatenate([p.ravel() for p in planes]).astype(np.int64), minlength=v)
        self.size = v
        self.p_unigram = (unigram + ALPHA) / (unigram.sum() + ALPHA * v)
        self.left = _pairs(planes, 1, v)
        self.up = _pairs(planes, 0, v)
        self.left_context = np.bincount(np.concatenate([p[:, :-1].ravel() for p in planes]).astype(np.int64),
                                        minlength=v).astype(np.float64)
        self.up_context = np.bincount(np.concatenate([p[:-1].ravel() for p in planes]).astype(np.int64),
                                      minlength=v).astype(np.float64)

    def _conditional(self, ctx: np.ndarray, tok: np.ndarray, pairs, ctx_counts) -> np.ndarray:
        prior = self.p_unigram[tok]
        n_pair = _count(ctx.astype(np.int64) * self.size + tok, pairs)
        return (n_pair + BETA * prior) / (ctx_counts[ctx] + BETA)

    def bits(self, grid: np.ndarray) -> tuple[float, float, int]:
        """(bits with context, bits of the unigram alone, tokens) over one grid."""
        total, plain, n = 0.0, 0.0, 0
        for plane in _planes(np.asarray(grid)):
            tok = plane.astype(np.int64)
            p_left = np.broadcast_to(self.p_unigram[tok], tok.shape).copy()
            p_left[:, 1:] = self._conditional(tok[:, :-1], tok[:, 1:], self.left, self.left_context)
            p_up = np.broadcast_to(self.p_unigram[tok], tok.shape).copy()
            p_up[1:] = self._conditional(tok[:-1], tok[1:], self.up, self.up_context)
            total -= float(np.log2((p_left + p_up) / 2).sum())
            plain -= float(np.log2(self.p_unigram[tok]).sum())
            n += tok.size
        return total, plain, n


def held_out_bits(grids: Sequence[np.ndarray], codebook_size: int) -> list[dict] | None:
    """Per grid, bits per token under the bigram fitted on every *other* grid, and the
    unigram's; ``None`` with fewer than two grids (nothing to hold out against)."""
    if len(grids) < 2:
        return None
    rows = []
    for i, grid in enumerate(grids):
        model = BigramModel([g for j, g in enumerate(grids) if j != i], codebook_size)
        total, plain, n = model.bits(grid)
        rows.append({"bits_per_token": total / n, "unigram_bits_per_token": plain / n, "tokens": n})
    return rows


def summarise(per_image: Sequence[dict]) -> dict:
    """Totals of the per-photograph figures: token-weighted bits, worst and mean of the rest."""
    out: dict = {}
    if per_image and "shift_equivariance" in per_image[0]:
        for s in per_image[0]["shift_equivariance"]:
            values = [r["shift_equivariance"][s] for r in per_image]
            out.setdefault("shift_equivariance", {})[s] = {"mean": float(np.mean(values)),
                                                          "min": float(min(values))}
    if per_image and "crop_cost_db" in per_image[0]:
        for k in per_image[0]["crop_cost_db"]:
            values = [r["crop_cost_db"][k] for r in per_image]
            out.setdefault("crop_cost_db", {})[k] = {"mean": float(np.mean(values)), "worst": float(min(values))}
    held = [r for r in per_image if "bits_per_token" in r]
    if held:
        n = sum(r["tokens"] for r in held)
        out["bits_per_token"] = sum(r["bits_per_token"] * r["tokens"] for r in held) / n
        out["unigram_bits_per_token"] = sum(r["unigram_bits_per_token"] * r["tokens"] for r in held) / n
        out["context_saves_bits"] = out["unigram_bits_per_token"] - out["bits_per_token"]
    return out
