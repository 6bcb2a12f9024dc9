"""Measure, on the device at hand, whether tokens are a pure function of the image.

A tokenizer server batches whatever arrives together, so an image's batch size, position
and neighbours depend on other clients' traffic. :func:`check_invariance` encodes every
image alone (the reference) and then inside shuffled batches of several sizes, with one
and with several parallel model calls, and reports any token (or decoded pixel) that moved.
It is run at export time (the manifest's ``determinism`` certificate) and when the server
starts (GetModelInfo, the log, a metric), on the runtime exactly as it will be used.

Images: real photo tiles where the caller has them (export), or :func:`synthetic_images`
(the server must not need scikit-image): smooth gradients plus noise at several scales,
which put latents near quantizer boundaries as photographs do.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from vqserve.core.certificate import Certificate
from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime

BATCH_SIZES = (1, 2, 3, 5, 8)


def synthetic_images(count: int = 8, size: int = 64, seed: int = 0) -> np.ndarray:
    """uint8 ``[count,size,size,3]``: gradients, blobs and fine noise, deterministic."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    out = np.empty((count, size, size, 3), np.uint8)
    for i in range(count):
        base = rng.uniform(0, 255, 3) * (1 - yy[..., None]) + rng.uniform(0, 255, 3) * xx[..., None]
        coarse = rng.normal(0, 40, (size // 8, size // 8, 3)).repeat(8, 0).repeat(8, 1)
        fine = rng.normal(0, 12, (size, size, 3))
        out[i] = np.clip(base + coarse + fine, 0, 255).astype(np.uint8)
    return out


def _batched(fn, items: np.ndarray, order: np.ndarray, size: int) -> np.ndarray:
    """Run ``fn`` on ``items`` taken in ``order``, ``size`` at a time; results in item order."""
    out = [None] * len(items)
    for start in range(0, len(order), size):
        idx = order[start:start + size]
        res = np.asarray(fn(items[idx]))
        for k, j in enumerate(idx):
            out[j] = res[k]
    return np.stack(out)


def check_invariance(runtime, plan: ExecutionPlan, images: np.ndarray, source: str,
                     batch_sizes: tuple[int, ...] = BATCH_SIZES, compositions: int = 2,
                     seed: int = 0, tokenizer=None) -> Certificate:
    """``runtime``: an unwrapped Runtime; it is run by ``plan`` and by ``plan`` with one
    worker, so the check covers what the server and ``vqserve tokenize`` both do.
    ``tokenizer``: the fp32 eager model whose decision margins on ``images`` the certificate
    reports (default: the runtime's own when it is eager fp32; none for an export)."""
    rng = np.random.default_rng(seed)
    n = len(images)
    single = PlannedRuntime(runtime, dataclasses.replace(plan, workers=1))
    runners = {1: single}
    if plan.workers > 1:
        runners[plan.workers] = PlannedRuntime(runtime, plan)
    decodes = getattr(runtime.info, "decodes", True)  # an encode-only model has no pixels to check
    try:
        ident = np.arange(n)
        ref_tokens = _batched(single.encode, images, ident, 1)
        ref_pixels = _batched(single.decode, ref_tokens, ident, 1) if decodes else np.zeros(1, np.uint8)
        bad_tokens = bad_pixels = 0
        runs = 0
        for runner in runners.values():
            for size in batch_sizes:
                for _ in range(compositions):
                    order = rng.permutation(n)
                    tokens = _batched(runner.encode, images, order, size)
                    bad_tokens += int(np.count_nonzero(tokens != ref_tokens))
                    if decodes:
                        pixels = _batched(runner.decode, ref_tokens, order, size)
                        bad_pixels += int(np.count_nonzero(pixels != ref_pixels))
                    runs += 1
    finally:
        for r in runners.values():
            r.close()
    info = runtime.info
    if tokenizer is None and info.backend == "eager" and info.dtype == "fp32":
        tokenizer = getattr(runtime, "tokenizer", None)
    return Certificate(
        batch_invariant=bad_tokens == 0, decode_batch_invariant=bad_pixels == 0, images=n,
        image_size=[int(images.shape[-3]), int(images.shape[-2])], source=source,
        batch_sizes=list(batch_sizes), compositions=compositions, workers=sorted(runners),
        plan=plan.to_dict(), token_mismatch_fraction=bad_tokens / (runs * ref_tokens.size),
        pixel_mismatch_fraction=bad_pixels / (runs * ref_pixels.size), device=info.device,
        backend=info.backend, dtype=info.dtype,
        notes=[] if decodes else ["encode-only model: no decoder, decoded pixels not checked"],
        # a video model's margins: not measured yet (vqserve.model.ties reads images)
        margins=image_margins(tokenizer, images) if tokenizer is not None and images.ndim == 4 else {})


def image_margins(tokenizer, images: np.ndarray) -> dict:
    """``vqserve.model.ties.shares`` of the fp32 margins of ``images``' tokens, one image at a
    time; {} for a quantizer with no defined margin."""
    from vqserve.model import ties

    if ties.decision(tokenizer.quantizer) is None:
        return {}
    total = None
    for image in images:
        z = ties.fp32_latents(tokenizer, image[None])
        total = ties.merge_counts(total, ties.low_margin_counts(ties.margins(tokenizer.quantizer, z)))
    return {**ties.shares(total), "delta": ties.DELTA}


def start_up_check(runtime, plan: ExecutionPlan) -> Certificate:
    """The server's quick check: six synthetic images at about 64x64 (a multiple of the
    model's factor), batch sizes 1, 2 and 5, one shuffle each; about a second on a CPU.
    A video model gets six clips of ``1 + T`` such frames."""
    layout = runtime.info.layout
    size = layout.square_size_near(64)  # a pyramid: the accepted size nearest 64
    if layout.kind == "video":  # six clips of 1 + T synthetic frames each
        frames = 1 + layout.temporal_factor
        images = synthetic_images(6 * frames, size).reshape(6, frames, size, size, 3)
    else:
        images = synthetic_images(6, size)
    return check_invariance(runtime, plan, images, "synthetic",
                            batch_sizes=(1, 2, 5), compositions=1)
