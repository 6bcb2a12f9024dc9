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
import time
from collections import Counter

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
                     seed: int = 0, tokenizer=None, progress=None, budget_s: float | None = None) -> Certificate:
    """``runtime``: an unwrapped Runtime; it is run by ``plan`` and by ``plan`` with one
    worker, so the check covers what the server and ``vqserve tokenize`` both do.
    ``tokenizer``: the fp32 eager model whose decision margins on ``images`` the certificate
    reports (default: the runtime's own when it is eager fp32; none for an export).
    ``progress``: a :class:`vqserve.core.progress.Progress` counting image passes (each image
    encoded, and decoded, once), told each step. ``budget_s``: the first image is timed, and
    when the whole check would take longer, only the cases that decide invariance run
    (:func:`sized_cases`); the certificate's notes say what was and was not checked."""
    rng = np.random.default_rng(seed)
    n = len(images)
    single = PlannedRuntime(runtime, dataclasses.replace(plan, workers=1))
    runners = {1: single}
    if plan.workers > 1:
        runners[plan.workers] = PlannedRuntime(runtime, plan)
    passes = [(w, size) for w in runners for size in batch_sizes for _ in range(compositions)]
    decodes = getattr(runtime.info, "decodes", True)  # an encode-only model has no pixels to check
    notes = [] if decodes else ["encode-only model: no decoder, decoded pixels not checked"]
    say = progress or _Silent()
    say.resize(n * (1 + len(passes)))

    def alone(image: np.ndarray):
        tokens = single.encode(image[None])
        pixels = single.decode(tokens) if decodes else np.zeros((1, 1), np.uint8)
        say.advance(1)
        return tokens[0], pixels[0]

    try:
        say.step("each image alone (the reference)")
        started = time.perf_counter()
        first = alone(images[0])
        first_s = time.perf_counter() - started
        if budget_s is not None:
            sized = sized_cases(first_s, n, passes, plan.micro_batch_at(images.shape[-3] * images.shape[-2]),
                                plan.workers, budget_s)
            if sized is not None:
                n, passes, note = sized
                images = images[:n]
                notes.append(note)
                say.resize(n * (1 + len(passes)))
        rest = [alone(image) for image in images[1:]]
        ref_tokens = np.stack([first[0], *(t for t, _ in rest)])
        ref_pixels = np.stack([first[1], *(p for _, p in rest)]) if decodes else np.zeros(1, np.uint8)
        bad_tokens = bad_pixels = 0
        for workers, size in passes:
            runner = runners[workers]
            say.step(f"batch {size} with {workers} worker{'s' if workers > 1 else ''}")
            order = rng.permutation(n)
            tokens = _batched(runner.encode, images, order, size)
            bad_tokens += int(np.count_nonzero(tokens != ref_tokens))
            if decodes:
                pixels = _batched(runner.decode, ref_tokens, order, size)
                bad_pixels += int(np.count_nonzero(pixels != ref_pixels))
            say.advance(n)
    finally:
        for r in runners.values():
            r.close()
    info = runtime.info
    if tokenizer is None and info.backend == "eager" and info.dtype == "fp32":
        tokenizer = getattr(runtime, "tokenizer", None)
    if tokenizer is not None:
        say.step("decision margins of the tokens (float64)")
    runs = max(1, len(passes))
    return Certificate(
        batch_invariant=bad_tokens == 0, decode_batch_invariant=bad_pixels == 0, images=n,
        image_size=[int(images.shape[-3]), int(images.shape[-2])], source=source,
        batch_sizes=sorted({1, *(size for _, size in passes)}),
        compositions=max(Counter(passes).values(), default=0), workers=sorted({1, *(w for w, _ in passes)}),
        plan=plan.to_dict(), token_mismatch_fraction=bad_tokens / (runs * ref_tokens.size),
        pixel_mismatch_fraction=bad_pixels / (runs * ref_pixels.size), device=info.device,
        backend=info.backend, dtype=info.dtype, notes=notes,
        # a video model's margins: not measured yet (vqserve.model.ties reads images)
        margins=image_margins(tokenizer, images) if tokenizer is not None and images.ndim == 4 else {})


def sized_cases(first_s: float, n: int, passes: list[tuple[int, int]], micro_batch: int, workers: int,
                budget_s: float) -> tuple[int, list[tuple[int, int]], str] | None:
    """None when the whole check (``n`` images alone, then each of ``passes``: (workers,
    batch size)) fits ``budget_s`` at ``first_s`` per image pass; else the cases that decide
    invariance - the largest call that will serve (a full micro-batch) against the image
    alone with one worker, and the same calls run ``workers`` at once - on as few images as
    they need, and one line saying what was and was not checked."""
    whole = first_s * n * (1 + len(passes))
    if whole <= budget_s:
        return None
    largest = max(1, micro_batch)
    cases = []
    if largest > 1:  # a micro-batch of 1 runs every image alone: the reference already is that call
        cases.append((1, largest))
    if workers > 1:  # parallel calls: as many full calls as workers at once
        cases.append((workers, largest * workers))
    if not cases:  # one worker, calls of one: batching changes nothing; run it once batched anyway
        cases.append((1, 2))
    images = min(n, max(2, max(size for _, size in cases)))
    left_out = sorted({size for _, size in passes} - {1} - {size for _, size in cases})
    estimate = first_s * images * (1 + len(cases))
    line = (f"sized to the model: the first image took {first_s:.1f} s, so checking all {n} images at every "
            f"batch size {sorted({s for _, s in passes})} and worker count {sorted({w for w, _ in passes})} "
            f"would take ~{whole:.0f} s (budget {budget_s:g} s); checked {images} images alone against "
            + " and ".join(f"batch {s} with {w} worker{'s' if w > 1 else ''}" for w, s in cases)
            + f" (~{estimate:.0f} s)"
            + "; not checked: " + (f"batch sizes {left_out}, " if left_out else "") + "other shuffles of the images")
    return images, cases, line


class _Silent:
    """No progress asked for."""

    def resize(self, total: int) -> None:
        pass

    def step(self, name: str) -> None:
        pass

    def advance(self, units: int = 1) -> None:
        pass


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


CHECK_BUDGET_S = 30.0  # a start-up check longer than this keeps only the cases that decide invariance
CHECK_IMAGES = 6
CHECK_BATCH_SIZES = (1, 2, 5)


def start_up_check(runtime, plan: ExecutionPlan, progress=None, budget_s: float | None = None) -> Certificate:
    """The server's quick check: six synthetic images at about 64x64 (a multiple of the
    model's factor), batch sizes 1, 2 and 5, one shuffle each; about a second on a CPU for
    the default model. A video model gets six clips of ``1 + T`` such frames. ``budget_s``:
    sized to the model when the whole check would take longer (:func:`sized_cases`);
    ``progress``: told each step (:class:`vqserve.core.progress.Progress`)."""
    layout = runtime.info.layout
    size = layout.square_size_near(64)  # a pyramid: the accepted size nearest 64
    if layout.kind == "video":  # six clips of 1 + T synthetic frames each
        frames = 1 + layout.temporal_factor
        images = synthetic_images(CHECK_IMAGES * frames, size).reshape(CHECK_IMAGES, frames, size, size, 3)
    else:
        images = synthetic_images(CHECK_IMAGES, size)
    return check_invariance(runtime, plan, images, "synthetic",
                            batch_sizes=CHECK_BATCH_SIZES, compositions=1, progress=progress, budget_s=budget_s)
