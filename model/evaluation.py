"""Tokenizer quality and low-precision agreement metrics.

Serving code may import the codebook metrics from here, so this module imports only
torch and numpy at the top (no scikit-image, no matplotlib).

* ``psnr`` / ``ssim`` on uint8 or [-1,1] float images, and the colour figures (their home
  is ``model/pixel_metrics.py``: they judge pixels, with no tokenizer; named here too);
* ``codebook_stats`` - utilization (fraction of codes used), entropy (bits) and
  perplexity (``2**entropy``, the effective number of codes) of a set of indices;
* ``index_agreement`` - the fraction of token indices a bf16/fp16 encode shares with the
  fp32 eager encode of the same pixels;
* ``mean_colour_error`` - mean of reconstruction minus mean of original per R/G/B channel
  (a colour cast a PSNR figure hides);
* ``tiled_round_trip`` - the same pixels encoded as independent tiles (a tokenizer whose
  output depends on the image size scores differently whole and tiled);
* ``batch_invariance`` - the same images encoded one at a time and as one batch: identical
  tokens or how many differ (tokens must not depend on the batch they land in);
* ``evaluate_tokenizer`` - all of the above over a list of images, as one dict, with
  ``TARGETS`` (issue 17) checked, and the encode speed on this machine (images per second
  per precision, ``machine`` says which).

A token layout with scales (a multi-scale pyramid) also gets agreement per scale, coarse to
fine (``agreement_per_scale``): an early-scale flip changes every later scale.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vqserve.core.codebook import codebook_stats as core_codebook_stats
from vqserve.core.machine import cpu_info
from vqserve.core.token_layout import PYRAMID
from vqserve.model import learnability as learn
from vqserve.model import ties
from vqserve.model.mixed_precision import low_precision_encoder

# the pixel metrics live in model/pixel_metrics.py; their names stay importable from here
from vqserve.model.pixel_metrics import flat_area_tint, mean_colour_error, psnr, ssim
from vqserve.model.pixel_metrics import hue_departure as hue_departure
from vqserve.model.pixel_metrics import mse as mse
from vqserve.model.pixel_metrics import psnr_per_image as psnr_per_image
from vqserve.model.pixel_metrics import side_by_side as side_by_side
from vqserve.model.precision import policy
from vqserve.model.ties import DELTA, shares
from vqserve.model.tokenizer import pixels_to_float

# -- codebook metrics -------------------------------------------------------------------


def code_counts(indices: torch.Tensor | Iterable[torch.Tensor], codebook_size: int) -> torch.Tensor:
    """Histogram of code usage (int64 ``[codebook_size]``)."""
    if torch.is_tensor(indices):
        indices = [indices]
    counts = torch.zeros(codebook_size, dtype=torch.int64)
    for idx in indices:
        counts += torch.bincount(idx.reshape(-1).to(torch.int64).cpu(), minlength=codebook_size)
    return counts


def codebook_stats(counts: torch.Tensor) -> dict:
    """utilization, used codes, entropy (bits), perplexity from a usage histogram
    (:func:`vqserve.core.codebook.codebook_stats`, the one definition)."""
    return core_codebook_stats(counts.detach().cpu().to(torch.float64).numpy())


def index_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of positions where two index tensors hold the same token."""
    if a.shape != b.shape:
        raise ValueError(f"index shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a.reshape(-1) == b.reshape(-1)).to(torch.float64).mean())



def batch_invariance(tokenizer, images: Sequence[np.ndarray], batch: int = 4, side: int = 256) -> dict:
    """Encode the same images one at a time and as one batch of ``batch`` (fp32, exactly
    ``tokenizer.encode``): the tokens must be identical, whatever batch an image lands in.

    The images are centre-cropped to one size (the smallest height and width among them,
    at most ``side``, a multiple of the factor; a pyramid's first made its size, ``model_sized``) and repeated in turn to fill the batch, so one
    image is enough. Returns the batch, the size, ``identical`` and ``differing_tokens`` of
    ``tokens``."""
    f = tokenizer.factor
    picked = [np.asarray(images[i % len(images)]) for i in range(batch)]
    layout = getattr(tokenizer, "token_layout", None)
    if layout is not None and not layout.is_grid:  # a pyramid takes its own sizes only: VAR's transform
        picked = [model_sized(tokenizer, img) for img in picked]
    h = min(min(img.shape[0] for img in picked), side) // f * f
    w = min(min(img.shape[1] for img in picked), side) // f * f
    if h == 0 or w == 0:
        raise ValueError(f"batch invariance needs images of at least {f}x{f} pixels")
    crops = torch.from_numpy(np.stack([_centre_crop_to(img, h, w) for img in picked]))
    alone = torch.cat([tokenizer.encode(crops[i:i + 1]).cpu() for i in range(batch)])
    together = tokenizer.encode(crops).cpu()
    differ = int((alone != together).sum())
    return {"batch": batch, "height": h, "width": w, "identical": differ == 0, "differing_tokens": differ,
            "tokens": int(alone.numel())}


def _centre_crop_to(img: np.ndarray, h: int, w: int) -> np.ndarray:
    y0, x0 = (img.shape[0] - h) // 2, (img.shape[1] - w) // 2
    return np.ascontiguousarray(img[y0 : y0 + h, x0 : x0 + w])


def machine() -> dict:
    """Where the speed figures were measured: the CPU and torch's intra-op threads."""
    return {"cpu": cpu_info()[0] or "unknown", "threads": torch.get_num_threads(), "torch": torch.__version__}


# -- whole-tokenizer evaluation ---------------------------------------------------------


def encode_in_precision(tokenizer, images_u8: torch.Tensor, precision: str,
                        channels_last: bool = True, encoder: torch.nn.Module | None = None) -> torch.Tensor:
    """Indices of uint8 NHWC ``images_u8`` with a low-precision encoder; quantizer in fp32.

    ``encoder``: a copy built by ``low_precision_encoder`` (what serving and exports run);
    None runs ``tokenizer``'s own encoder under autocast in ``precision`` (what training
    runs). fp32 with no encoder means plain eager. ``channels_last`` picks the oneDNN
    kernels that are fast for bf16 on CPUs.
    """

    x = pixels_to_float(tokenizer.check_images(images_u8), tokenizer.pixel_range).to(tokenizer.device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        if encoder is not None:
            return tokenizer.quantize(encoder(x))[1]
        with policy(precision).autocast(tokenizer.device.type):
            return tokenizer.quantize(tokenizer.encode_latents(x))[1]


@contextlib.contextmanager
def _memory_format(module: torch.nn.Module, channels_last: bool):
    if not channels_last:
        yield
        return
    _set_layout(module, torch.channels_last)
    try:
        yield
    finally:
        _set_layout(module, torch.contiguous_format)


def _set_layout(module: torch.nn.Module, layout: torch.memory_format) -> torch.nn.Module:
    """``module.to(memory_format=layout)`` for its 4-D parameters only: 5-D ones (a Conv3d's,
    as in Emu3's temporal layers) cannot take channels_last, and ``.to`` would raise."""
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=layout)
    return module


def tiled_round_trip(tokenizer, batch_u8: torch.Tensor, tile: int) -> torch.Tensor:
    """Encode and decode ``tile x tile`` pieces of uint8 ``[1,H,W,3]`` independently, stitched
    back (edge pieces are smaller; H and W are multiples of the factor, so every piece is)."""
    out = torch.empty_like(batch_u8)
    _, h, w, _ = batch_u8.shape
    for y in range(0, h, tile):
        for x in range(0, w, tile):
            piece = batch_u8[:, y : y + tile, x : x + tile].contiguous()
            out[:, y : y + tile, x : x + tile] = tokenizer.decode(tokenizer.encode(piece)).cpu()
    return out


# issue 17: what a default tokenizer must reach on whole held-out photographs
TARGETS = {
    "psnr_over_baseline_db": 0.5,       # PSNR at least this far above area x factor + bicubic
    "max_abs_mean_error": 3.0,          # every photo, every channel: |mean colour error| below
    "whole_minus_tiled_db": -0.2,       # whole-photo PSNR at most 0.2 dB below 128-px tiles
    "bf16_agreement": 0.995,            # served bf16 tokens identical to fp32
}


def check_targets(result: dict) -> dict:
    """Which of ``TARGETS`` ``result`` (from ``evaluate_tokenizer``) meets: name -> (value, ok)."""
    out: dict = {}
    if "baseline_psnr" in result:
        v = result["psnr"] - result["baseline_psnr"]
        out["psnr_over_baseline_db"] = {"value": v, "ok": v >= TARGETS["psnr_over_baseline_db"]}
    if "max_abs_mean_error" in result:  # none for an encode-only model
        v = result["max_abs_mean_error"]
        out["max_abs_mean_error"] = {"value": v, "ok": v < TARGETS["max_abs_mean_error"]}
    if "tiled_psnr" in result:
        v = result["psnr"] - result["tiled_psnr"]
        out["whole_minus_tiled_db"] = {"value": v, "ok": v >= TARGETS["whole_minus_tiled_db"]}
    if "bf16" in result["agreement"]:
        v = result["agreement"]["bf16"]
        out["bf16_agreement"] = {"value": v, "ok": v >= TARGETS["bf16_agreement"]}
    return out


ImageCallback = Callable[[str, np.ndarray, np.ndarray, "np.ndarray | None"], None]


class _TokenFigures:
    """What every evaluation measures on the tokens, whether or not the model decodes: the
    fp32 encode (timed), the code histogram, agreement per low precision (as served and under
    autocast) and the learnability figures. One copy for ``evaluate_tokenizer`` and
    ``evaluate_encoder``."""

    def __init__(self, tokenizer, precisions: Sequence[str], channels_last: bool, learnability: bool):

        tokenizer.eval()
        layout = torch.channels_last if channels_last else torch.contiguous_format
        served = {p: _set_layout(low_precision_encoder(tokenizer.encoder, p)[0].to(tokenizer.device), layout)
                  for p in precisions}
        self.tokenizer, self.precisions = tokenizer, list(precisions)
        self.channels_last, self.learnability = channels_last, learnability
        # (result key, precision, encoder copy or None for autocast)
        self.runs = [(p, p, served[p]) for p in precisions] + [(f"{p}_autocast", p, None) for p in precisions]
        self.agree = {key: [0, 0] for key, _, _ in self.runs}
        self.pixels = 0  # for megapixels per second
        self.timings = {"fp32": 0.0, **{key: 0.0 for key, _, _ in self.runs}}
        self.counts = torch.zeros(tokenizer.codebook_size, dtype=torch.int64)
        self.grids: list[np.ndarray] = []
        self.margins: dict | None = None  # vqserve.model.ties.low_margin_counts, summed
        # a pyramid (VAR): agreement per scale too, since an early-scale flip changes every later
        # scale; the grid learnability figures (shifts, crops) do not apply to it
        self.layout = tokenizer.token_layout
        if not self.layout.is_grid:  # a pyramid or a sequence: no grid to shift or crop
            self.learnability = False
        self.scale_agree: dict[str, list[list[int]]] = {}

    def encode(self, batch: torch.Tensor) -> torch.Tensor:
        """The reference: plain fp32 eager, default memory format - exactly ``tok.encode``.
        The quantizer's input is caught on the way (a pre-hook) for the decision margins:
        how many tokens lie so near a rounding boundary that another correct fp32 machine
        may round them otherwise (``vqserve.model.ties``)."""

        caught = []
        hook = None
        if ties.decision(self.tokenizer.quantizer) is not None:
            hook = self.tokenizer.quantizer.register_forward_pre_hook(lambda _m, args: caught.append(args[0]))
        try:
            t0 = time.perf_counter()
            idx = self.tokenizer.encode(batch).cpu()
            self.timings["fp32"] += time.perf_counter() - t0
            self.pixels += batch.shape[0] * batch.shape[1] * batch.shape[2]
        finally:
            if hook is not None:
                hook.remove()
        self.counts += code_counts(idx, self.tokenizer.codebook_size)
        if caught:
            margin = ties.margins(self.tokenizer.quantizer, caught[0].float())
            self.margins = ties.merge_counts(self.margins, ties.low_margin_counts(margin))
        return idx

    def learn(self, row: dict, img: np.ndarray, idx: torch.Tensor, recon: torch.Tensor | None) -> None:
        """Perplexity, shift equivariance and (with a reconstruction) the crop cost into ``row``."""
        if not self.learnability:
            return

        tok = self.tokenizer
        self.grids.append(idx[0].numpy())
        row["perplexity"] = learn.perplexity(idx[0], tok.codebook_size)
        if recon is not None:
            row["crop_cost_db"] = {str(k): v for k, v in learn.crop_cost(tok, img, idx[0], recon[0]).items()}
        try:
            row["shift_equivariance"] = {str(k): v for k, v in learn.shift_equivariance(tok, img).items()}
        except ValueError:
            pass  # too small to shift by 3 tokens and keep an interior: no figure, not a wrong one

    def agreement(self, row: dict, batch: torch.Tensor, idx: torch.Tensor) -> None:
        with _memory_format(self.tokenizer, self.channels_last):
            for key, precision, encoder in self.runs:
                t0 = time.perf_counter()
                low = encode_in_precision(self.tokenizer, batch, precision, self.channels_last, encoder).cpu()
                self.timings[key] += time.perf_counter() - t0
                same = int((low == idx).sum())
                self.agree[key][0] += same
                self.agree[key][1] += idx.numel()
                row[f"agreement_{key}"] = same / idx.numel()
                if self.layout.kind == PYRAMID:
                    row[f"agreement_{key}_per_scale"] = self._per_scale(key, low, idx)

    def _per_scale(self, key: str, low: torch.Tensor, idx: torch.Tensor) -> list[float]:
        """Each scale's share of tokens equal to fp32 (coarse to fine), summed over the set."""
        bounds = self.layout.scale_bounds(idx.shape[-1])
        sums = self.scale_agree.setdefault(key, [[0, 0] for _ in bounds])
        shares = []
        for (start, end), total in zip(bounds, sums, strict=True):
            same = int((low[..., start:end] == idx[..., start:end]).sum())
            total[0] += same
            total[1] += idx[..., start:end].numel()
            shares.append(same / idx[..., start:end].numel())
        return shares

    def result(self, per_image: list[dict], **pixel_figures) -> dict:
        """The set's result: the token figures, ``pixel_figures`` (none for an encode-only
        model), the held-out bits per token and the targets."""
        tok = self.tokenizer
        agree = self.agree
        result = {
            "images": len(per_image),
            "factor": tok.factor,
            "codebook_size": tok.codebook_size,
            # "bayer4": codes depend on position (docs/TRAINING.md, "The dither"); read with the perplexity
            "dither": getattr(tok.quantizer, "dither", "none"),
            **pixel_figures,
            "codebook": codebook_stats(self.counts),
            "agreement": {p: agree[p][0] / max(agree[p][1], 1) for p in self.precisions},
            "agreement_autocast": {p: agree[f"{p}_autocast"][0] / max(agree[f"{p}_autocast"][1], 1)
                                   for p in self.precisions},
            "encode_seconds": self.timings,
            # one image per call, as timed above; "machine" says where
            "images_per_second": {k: len(per_image) / t for k, t in self.timings.items() if t > 0},
            "megapixels_per_second": {k: self.pixels / 1e6 / t for k, t in self.timings.items() if t > 0},
            "machine": machine(),
            "per_image": per_image,
        }
        if self.scale_agree:  # a pyramid: agreement per scale, coarse to fine
            result["agreement_per_scale"] = {key: [same / max(n, 1) for same, n in sums]
                                             for key, sums in self.scale_agree.items()}
        if self.margins is not None:

            result["margins"] = {**shares(self.margins), "delta": DELTA}
        if self.learnability:

            for row, held in zip(per_image, learn.held_out_bits(self.grids, tok.codebook_size) or [],
                                 strict=False):
                row.update(held)
            result["learnability"] = learn.summarise(per_image)
        return result


def _finish(result: dict) -> dict:
    result["targets"] = check_targets(result)
    result["utilization"] = result["codebook"]["utilization"]
    result["entropy_bits"] = result["codebook"]["entropy_bits"]
    result["perplexity"] = result["codebook"]["perplexity"]
    return result


def evaluate_tokenizer(tokenizer, images: Sequence[np.ndarray], names: Sequence[str] | None = None,
                       precisions: Sequence[str] = ("bf16", "fp16"),
                       channels_last: bool = True, baseline: bool = True, tile: int = 128,
                       on_image: ImageCallback | None = None, learnability: bool = True,
                       invariance_batch: int = 4) -> dict:
    """PSNR/SSIM (fp32 eager round trip), colour error, whole vs tiled PSNR, codebook stats,
    and agreement per precision, against the area x factor + bicubic baseline; and
    (``learnability``) what a generative model trained on the tokens meets: shift
    equivariance, token-grid crop cost, perplexity and held-out bits per token
    (``vqserve.model.learnability``), per image and in ``result["learnability"]``.

    ``tile``: also round-trip each image as independent ``tile``-pixel pieces (0: skip).
    ``invariance_batch``: also check the tokens at batch 1 and at this batch
    (``batch_invariance``, ``result["batch_invariance"]``; 0 or 1: skip).
    ``on_image(name, original, reconstruction, baseline)`` is called with uint8 ``[H,W,3]``
    arrays per image (side-by-side PNGs), so no caller has to hold every reconstruction.

    ``agreement[p]``: the encoder as serving and exports run it in ``p``
    (``low_precision_encoder``: fp32 residual stream for bf16 and fp16); ``agreement_autocast[p]``:
    the whole encoder under autocast, as training runs it.
    ``images`` are uint8 ``[H,W,3]`` arrays; each is centre-cropped to a multiple of the
    tokenizer's factor and processed one at a time (sizes may differ).
    """
    if not tokenizer.decodes:  # an encode-only model: the token figures alone
        return evaluate_encoder(tokenizer, images, names, precisions, channels_last, learnability,
                                invariance_batch)
    figures = _TokenFigures(tokenizer, precisions, channels_last, learnability)
    f = tokenizer.factor
    if not figures.layout.is_grid:
        tile = 0  # a pyramid's or sequence's image sizes are fixed: no smaller tiles
    names = list(names) if names is not None else [f"image{i}" for i in range(len(images))]
    per_image = []
    sq_err, n_px = 0.0, 0
    base_sq_err, tiled_sq_err = 0.0, 0.0
    for name, img in zip(names, images, strict=True):
        img = model_sized(tokenizer, np.asarray(img))
        batch = torch.from_numpy(np.array(img))[None]
        idx = figures.encode(batch)
        recon = tokenizer.decode(idx).cpu()
        err = (batch.to(torch.float64) - recon.to(torch.float64)) ** 2
        sq_err += float(err.sum())
        n_px += err.numel()
        row = {"name": name, "height": img.shape[0], "width": img.shape[1],
               "psnr": psnr(batch, recon), "ssim": ssim(batch, recon),
               "mean_error_rgb": mean_colour_error(batch, recon)}
        row["max_abs_mean_error"] = max(abs(v) for v in row["mean_error_rgb"])
        row["flat_tint"], row["flat_share"] = flat_area_tint(batch[0], recon[0])
        base = None
        if baseline:
            base = downsample_bicubic_baseline(batch, f)
            row["baseline_psnr"] = psnr(batch, base)
            row["baseline_ssim"] = ssim(batch, base)
            base_sq_err += float(((batch.to(torch.float64) - base.to(torch.float64)) ** 2).sum())
        if tile:
            tiled = tiled_round_trip(tokenizer, batch, tile)
            row["tiled_psnr"] = psnr(batch, tiled)
            tiled_sq_err += float(((batch.to(torch.float64) - tiled.to(torch.float64)) ** 2).sum())
        figures.learn(row, img, idx, recon)
        if on_image is not None:
            on_image(name, batch[0].numpy(), recon[0].numpy(), None if base is None else base[0].numpy())
        figures.agreement(row, batch, idx)
        per_image.append(row)
    result = figures.result(per_image, psnr=_psnr_from(sq_err, n_px),
                            ssim=float(np.mean([r["ssim"] for r in per_image])))
    result["max_abs_mean_error"] = max(r["max_abs_mean_error"] for r in per_image)
    result["max_flat_tint"] = max(r["flat_tint"] for r in per_image)
    if baseline:
        result["baseline_psnr"] = _psnr_from(base_sq_err, n_px)
        result["baseline_ssim"] = float(np.mean([r["baseline_ssim"] for r in per_image]))
    if tile:
        result["tile"] = tile
        result["tiled_psnr"] = _psnr_from(tiled_sq_err, n_px)
    if invariance_batch > 1:
        result["batch_invariance"] = batch_invariance(tokenizer, images, invariance_batch)
    return _finish(result)


def evaluate_encoder(tokenizer, images: Sequence[np.ndarray], names: Sequence[str] | None = None,
                     precisions: Sequence[str] = ("bf16", "fp16"), channels_last: bool = True,
                     learnability: bool = True, invariance_batch: int = 4) -> dict:
    """``evaluate_tokenizer`` for an encode-only model (``tokenizer.decodes`` False): what
    needs no reconstruction - codebook use, agreement per precision (as served and under
    autocast), encode time, and the learnability figures that need no decoder (shift
    equivariance, perplexity, held-out bits per token). ``result["decodes"]`` is False."""
    figures = _TokenFigures(tokenizer, precisions, channels_last, learnability)
    names = list(names) if names is not None else [f"image{i}" for i in range(len(images))]
    per_image = []
    for name, img in zip(names, images, strict=True):
        img = model_sized(tokenizer, np.asarray(img))
        batch = torch.from_numpy(np.array(img))[None]
        idx = figures.encode(batch)
        row = {"name": name, "height": img.shape[0], "width": img.shape[1]}
        figures.learn(row, img, idx, None)
        figures.agreement(row, batch, idx)
        per_image.append(row)
    result = figures.result(per_image, decodes=False)
    if invariance_batch > 1:
        result["batch_invariance"] = batch_invariance(tokenizer, images, invariance_batch)
    return _finish(result)


def _psnr_from(sq_err: float, n: int) -> float:
    return 10 * math.log10(255.0**2 / (sq_err / n)) if sq_err > 0 else float("inf")


PYRAMID_EVAL_SIDE = 256  # the image size a pyramid model is evaluated at (VAR's own 256 schedule)


def model_sized(tokenizer, img: np.ndarray) -> np.ndarray:
    """An image the tokenizer takes: a grid model's centre crop to a multiple of its factor;
    for a pyramid (VAR) or a sequence (TiTok), VAR's own validation transform to its accepted size nearest 256
    (shorter side LANCZOS-resized to 1.125 x that size, then centre-cropped)."""
    layout = tokenizer.token_layout
    if layout.is_grid:
        return _centre_crop_multiple(img, tokenizer.factor)
    from PIL import Image

    side = layout.square_size_near(PYRAMID_EVAL_SIDE)
    h, w = img.shape[:2]
    mid = round(1.125 * side)
    size = (mid, int(mid * h / w)) if w <= h else (int(mid * w / h), mid)  # torchvision Resize(mid)
    resized = np.asarray(Image.fromarray(img).resize(size, Image.LANCZOS))
    top, left = int(round((resized.shape[0] - side) / 2.0)), int(round((resized.shape[1] - side) / 2.0))
    return np.ascontiguousarray(resized[top:top + side, left:left + side])


def _centre_crop_multiple(img: np.ndarray, factor: int) -> np.ndarray:
    """Centre crop so height and width are multiples of ``factor`` (kept here, not imported
    from the training data module, so serving can use this module)."""
    h, w = img.shape[:2]
    hh, ww = h - h % factor, w - w % factor
    y0, x0 = (h - hh) // 2, (w - ww) // 2
    return img[y0 : y0 + hh, x0 : x0 + ww]


def downsample_bicubic_baseline(images_u8: torch.Tensor, factor: int) -> torch.Tensor:
    """The baseline every tokenizer must beat: area-downsample x factor, bicubic upsample."""
    x = images_u8.permute(0, 3, 1, 2).to(torch.float32)
    small = F.interpolate(x, scale_factor=1 / factor, mode="area")
    up = F.interpolate(small, size=x.shape[-2:], mode="bicubic", align_corners=False)
    return up.clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
