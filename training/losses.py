"""The loss terms of a training step and the schedules that weigh them.

Losses: L1 + L2 reconstruction, optionally L1 on the factor x factor block means and their
chroma (:func:`block_losses`), and for FSQ the low-precision robustness **margin** term
(:func:`margin_loss`: the bounded pre-rounding latent of every channel pushed at least
``margin`` away from its rounding boundaries) and the rate proxy :func:`latent_tv` (L1
between neighbouring bounded latents, in levels). The schedules: the learning rate
(:func:`lr_at`) and the margin term's weight (:func:`margin_weight_at`), both pure
functions of the config and the step, so a resumed run continues exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vqserve.training.config import TrainConfig


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(cfg.steps - cfg.warmup_steps, 1)
    t = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    lo = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return lo + (cfg.lr - lo) * (1 - t)
    return lo + (cfg.lr - lo) * 0.5 * (1 + math.cos(math.pi * t))


def margin_weight_at(cfg: TrainConfig, step: int) -> float:
    """Weight of the margin term at ``step``: 0 before ``margin_start``, then a linear ramp.

    Switching it on after the codebook has organised itself matters: a margin from step 0
    is a barrier at every rounding boundary that slows latents moving between codes.
    """
    if cfg.margin_weight <= 0 or cfg.margin <= 0:
        return 0.0
    start, ramp = cfg.margin_start * cfg.steps, cfg.margin_ramp * cfg.steps
    if step < start:
        return 0.0
    if ramp <= 0:
        return cfg.margin_weight
    return cfg.margin_weight * min(1.0, (step - start + 1) / ramp)


def boundary_distance(bounded: torch.Tensor) -> torch.Tensor:
    """Distance of each bounded FSQ latent to its nearest rounding boundary (in [0, 0.5])."""
    return 0.5 - (bounded - bounded.round()).abs()


def latent_tv(bounded: torch.Tensor) -> torch.Tensor:
    """Mean L1 between horizontally and vertically neighbouring bounded latents
    ``[B, h, w, d]``, in levels: a differentiable stand-in for how often neighbouring tokens
    differ, which is what a left/up context model pays for."""
    dx = (bounded[:, :, 1:] - bounded[:, :, :-1]).abs().mean()
    dy = (bounded[:, 1:] - bounded[:, :-1]).abs().mean()
    return (dx + dy) / 2


def margin_loss(bounded: torch.Tensor, margin: float) -> torch.Tensor:
    """Hinge, normalised to [0, 1]: zero once every latent is ``margin`` from a boundary.

    Linear rather than squared so a latent just inside the margin still feels a push
    (a squared hinge fades to nothing exactly where the flips happen).
    """
    return (torch.relu(margin - boundary_distance(bounded)) / margin).mean()


def block_losses(recon: torch.Tensor, target: torch.Tensor, factor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block mean, block chroma): two L1 terms on one error, the ``factor x factor`` block
    means of reconstruction minus those of the target (NCHW), computed once per step.

    Block mean: the bicubic baseline keeps every block's mean colour exactly; the per-pixel
    L1 + L2 let the default drift by 5-27 levels per channel on whole photographs (issue 17).
    This weighs that low-frequency error on its own, so colour casts and smooth regions cost
    as much as they look.

    Block chroma: the same error's R-G and B-(R+G)/2, where brightness cancels. A flat region
    becomes one code repeated, so its colour can only be one of the flat colours the code
    grid offers, a staircase 5-10 levels apart (a grey of 180 came back as 176,181,181: a
    cyan tint on a neutral sky). The eye forgives a wrong brightness there much more than a
    tint; this term makes a tint cost extra, so training places the steps where colours stay
    neutral.
    """
    err = F.avg_pool2d(recon, factor) - F.avg_pool2d(target, factor)
    r, g, b = err.unbind(1)
    return err.abs().mean(), ((r - g).abs() + (b - (r + g) / 2).abs()).mean()
