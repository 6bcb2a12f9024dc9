"""Pixel metrics of a reconstruction: PSNR, SSIM, the colour error and tint of flat areas.

Apart from the tokenizer evaluation (``model/evaluation.py``) because they judge pixels, not
tokens, and need no tokenizer: export parity, ``vqserve eval``, the training plots and the
research scripts compare images with them. torch and numpy only (no scikit-image).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def _to_float255(x) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dtype == torch.uint8:
        return t.to(torch.float64)
    return ((t.to(torch.float64) + 1.0) * 127.5).clamp(0, 255)


def mse(a, b) -> float:
    return float(((_to_float255(a) - _to_float255(b)) ** 2).mean())


def psnr(a, b) -> float:
    """PSNR in dB over all pixels of two image batches (uint8, or float in [-1,1])."""
    m = mse(a, b)
    return float("inf") if m == 0 else 10.0 * math.log10(255.0**2 / m)


def psnr_per_image(a, b) -> list[float]:
    a, b = _to_float255(a), _to_float255(b)
    out = []
    for x, y in zip(a, b, strict=True):
        m = float(((x - y) ** 2).mean())
        out.append(float("inf") if m == 0 else 10.0 * math.log10(255.0**2 / m))
    return out


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)


def ssim(a, b, data_range: float = 255.0) -> float:
    """Mean SSIM (Wang et al. 2004; 11x11 Gaussian window, sigma 1.5), channels averaged.

    Inputs are uint8 NHWC (or HWC) images or [-1,1] float NCHW; computed in fp64.
    """
    x, y = _to_float255(a), _to_float255(b)
    if x.ndim == 3:
        x, y = x[None], y[None]
    if x.shape[-1] == 3 and x.shape[1] != 3:  # NHWC -> NCHW
        x, y = x.permute(0, 3, 1, 2), y.permute(0, 3, 1, 2)
    c = x.shape[1]
    win = _gaussian_window().to(x.dtype)[None, None].repeat(c, 1, 1, 1)
    if min(x.shape[-2:]) < win.shape[-1]:
        raise ValueError(f"SSIM needs images of at least 11x11, got {tuple(x.shape[-2:])}")
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2

    def filt(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, win, groups=c)

    mu_x, mu_y = filt(x), filt(y)
    sxx = filt(x * x) - mu_x**2
    syy = filt(y * y) - mu_y**2
    sxy = filt(x * y) - mu_x * mu_y
    s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (sxx + syy + c2))
    return float(s.mean())


def mean_colour_error(original, reconstruction) -> list[float]:
    """Per channel (R, G, B): mean of ``reconstruction`` minus mean of ``original``, in levels.

    uint8 ``[H,W,3]`` or ``[B,H,W,3]`` inputs. +10 on R is a red cast of 10 levels over the
    whole image, invisible in a PSNR figure that a textured region dominates.
    """
    a, b = _to_float255(original), _to_float255(reconstruction)
    dims = tuple(range(a.ndim - 1))
    return [float(v) for v in (b.mean(dim=dims) - a.mean(dim=dims))]


def flat_area_tint(original, reconstruction, block: int = 32, max_std: float = 4.0,
                   quantile: float = 0.9) -> tuple[float, float]:
    """(tint in levels, share of the image that is flat) of one uint8 ``[H,W,3]`` image pair.

    A flat area (a ``block``-pixel square whose every channel varies by at most ``max_std``
    levels: a sky, a wall) is encoded as one code repeated, so it takes whatever flat colour
    the code grid offers. Brightness off by a few levels goes unnoticed there; a change of
    hue does not: 180,180,180 returned as 176,181,181 reads as a cyan sky although no
    channel's mean over the photograph moves by 3 levels. Per flat square, the tint is the
    largest channel's departure from the square's mean error (a pure brightness error has
    none); the figure is its ``quantile`` over the flat squares (0 when there are none).
    """
    a = _to_float255(original).numpy()
    b = _to_float255(reconstruction).numpy()
    h, w = (a.shape[0] // block) * block, (a.shape[1] // block) * block
    if h == 0 or w == 0:
        return 0.0, 0.0
    shape = (h // block, block, w // block, block, 3)
    sa, sb = a[:h, :w].reshape(shape), b[:h, :w].reshape(shape)
    flat = sa.std(axis=(1, 3)).max(axis=-1) <= max_std
    if not flat.any():
        return 0.0, 0.0
    tint = hue_departure(sb.mean(axis=(1, 3))[flat] - sa.mean(axis=(1, 3))[flat])
    return float(np.quantile(tint, quantile)), float(flat.mean())


def hue_departure(err: np.ndarray) -> np.ndarray:
    """Per RGB colour error ``[..., 3]``: the largest channel's departure from the error's own
    mean, in levels. A pure brightness error (the same on all channels) scores 0; a grey of 180
    returned as 176,181,181 scores 3.3: the part of a colour error the eye reads as a tint."""
    return np.abs(err - err.mean(axis=-1, keepdims=True)).max(axis=-1)


def side_by_side(*images: np.ndarray, gap: int = 4) -> np.ndarray:
    """uint8 ``[H,W,3]`` images of one size laid out left to right with white gaps."""
    h = images[0].shape[0]
    spacer = np.full((h, gap, 3), 255, np.uint8)
    parts: list[np.ndarray] = []
    for i, img in enumerate(images):
        parts += ([spacer] if i else []) + [np.asarray(img, dtype=np.uint8)]
    return np.ascontiguousarray(np.concatenate(parts, axis=1))
