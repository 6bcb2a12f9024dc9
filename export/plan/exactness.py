"""Whether a path may be chosen at all: the planner never trades tokens for speed unless asked.

The reference is the model in eager fp32 (or the ``--dtype`` the user pinned). Every other
path - the model exported in-process to ONNX Runtime (and, on request, TorchScript /
torch.export) - qualifies only if its tokens *and* the pixels it decodes equal the
reference's on every calibration photograph, and its tokens do not depend on the batch. So
any plan the planner may pick by default gives the tokens of the model in fp32. Lower
precision is a choice the user makes: ``--dtype bf16|fp16``, or ``--dtype auto`` (bf16/fp16
too, where they agree with fp32 on ``min_agreement`` of the tokens); the result says
``exact`` true or false.

The same checks decide the shortcuts a plan may take: for each method (encode, decode) where
a call of one image gave the result of the same image inside a full micro-batch, lone images
run unpadded, and where every power-of-two call did, short calls are padded to buckets; the
chosen plan then passes the server's own start-up check (:func:`_certified`), or loses those
shortcuts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from vqserve.export.plan.candidates import DtypeResult
from vqserve.export.runtimes.determinism import check_invariance, start_up_check, synthetic_images
from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime


def calibration_images(side: int = 128) -> tuple[np.ndarray, str]:
    """Every ``side`` tile of the validation photographs of scikit-image where it is
    installed (18 tiles at 128), else 8 synthetic images: agreement with fp32 is a property
    of photographs, so they come first."""
    try:
        from vqserve.export.parity import validation_photos

        tiles, info = validation_photos(side)
        return tiles, f"{len(tiles)} photo tiles {side}x{side} (skimage {', '.join(info['photos'])})"
    except (ImportError, ValueError):
        return synthetic_images(8, side, seed=1), f"8 synthetic images {side}x{side}"


def exactness_rule(dtype: str | None) -> str:
    """How a path qualifies. ``identical`` (no dtype, or a pinned one): its tokens and decoded
    pixels equal the reference's (eager in that dtype, fp32 by default) on every calibration
    image, so choosing it changes no output. ``agreement`` (``--dtype auto``): its tokens
    agree with fp32's on at least ``min_agreement`` of the positions."""
    return "agreement" if dtype == "auto" else "identical"


def _encode_then_decode(raw, photos: np.ndarray, decode_these: np.ndarray | None = None,
                        workers: int = 1) -> tuple[np.ndarray, np.ndarray | None]:
    """``raw``'s tokens of ``photos``, and the pixels it decodes from ``decode_these``
    (default: those tokens), one image per call: how paths are compared with the reference.
    Pixels are None for an encode-only model (``RuntimeInfo.decodes`` False)."""
    runtime = PlannedRuntime(raw, ExecutionPlan(1, workers))
    try:
        tokens = runtime.encode(photos)
        if not getattr(raw.info, "decodes", True):
            return tokens, None
        return tokens, runtime.decode(tokens if decode_these is None else decode_these)
    finally:
        runtime.close()


def _exactness(raw, reference: tuple[np.ndarray, np.ndarray] | None, photos: np.ndarray, side_small: int,
               workers: int, rule: str, min_agreement: float, max_micro: int,
               check, side_large: int | None = None) -> tuple[DtypeResult, tuple[np.ndarray, np.ndarray]]:
    """Agreement with the reference (tokens, then pixels decoded from the reference's tokens)
    and batch invariance; ``reference`` None: this runtime is the reference, and its tokens and
    pixels (returned) become it. Buckets are granted only where calls of every bucket agree at
    ``side_small`` and at ``side_large`` too: a GPU chooses its kernels per shape (on an H100,
    bf16 buckets agreed at 256x256 and not at 64x64), so one size does not speak for another."""
    res = DtypeResult(raw.info.dtype, backend=raw.info.backend)
    ref_tokens, ref_pixels = reference or (None, None)
    tokens, pixels = _encode_then_decode(raw, photos, ref_tokens, workers)
    res.agreement = 1.0 if ref_tokens is None else float(np.mean(tokens == ref_tokens))
    res.pixels_equal = ref_pixels is None or bool(np.array_equal(pixels, ref_pixels))
    check()
    small = synthetic_images(6, side_small, seed=2)
    cert = check_invariance(raw, ExecutionPlan(4, workers), small, "calibration", batch_sizes=(1, 2, 5),
                            compositions=1)
    res.batch_invariant = cert.invariant
    check()
    cert = check_invariance(raw, ExecutionPlan(max_micro, workers, lone_unpadded=("decode", "encode")),
                            synthetic_images(max_micro, side_small, seed=4), "calibration",
                            batch_sizes=(1, 3, max_micro), compositions=1)
    res.lone_invariant = [m for m, ok in (("decode", cert.decode_batch_invariant), ("encode", cert.batch_invariant))
                          if ok]
    if max_micro > 2:  # short calls padded to 1, 2, 4, ...: each bucket below the micro-batch once
        check()
        sizes = tuple(sorted({1, *(b + 1 for b in _powers_below(max_micro)), max_micro}))
        found = ("decode", "encode")
        for side in dict.fromkeys(s for s in (side_small, side_large) if s):  # small first: it is cheap
            if not found:
                break
            check()
            cert = check_invariance(raw, ExecutionPlan(max_micro, workers, bucketed=found),
                                    synthetic_images(max_micro, side, seed=5), "calibration",
                                    batch_sizes=sizes, compositions=1)
            found = tuple(m for m, ok in (("decode", cert.decode_batch_invariant),
                                          ("encode", cert.batch_invariant)) if ok and m in found)
        res.bucket_invariant = list(found)
    if workers > 1:
        check()
        cert = check_invariance(raw, ExecutionPlan(1, 1, workers), small, "calibration",
                                batch_sizes=(1, 5), compositions=1)
        res.threads_invariant = cert.invariant
    if rule == "identical" and res.agreement < 1.0:
        res.why_not = f"tokens differ from the reference on {1 - res.agreement:.4%} of positions"
    elif rule == "identical" and not res.pixels_equal:
        res.why_not = "decoded pixels differ from the reference's"
    elif rule == "agreement" and res.agreement < min_agreement:
        res.why_not = f"agreement {res.agreement:.4%} < {min_agreement:.2%}"
    elif not res.batch_invariant:
        res.why_not = "tokens depend on the batch"
    res.eligible = not res.why_not
    return res, (tokens, pixels)


def _powers_below(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``: the buckets of a bucketed plan at micro-batch ``n``."""
    return [1 << k for k in range(max(0, n - 1).bit_length()) if 1 << k < n]


def _certified(raw, plan: ExecutionPlan, say) -> ExecutionPlan:
    """The plan as the server's own start-up check sees it: a plan that fails that check (a
    lone call that moved a decoded pixel there although the calibration found it equal)
    loses the unpadded lone calls of the method that failed (decode pixels, or encode
    tokens), then all of them, and failing still, falls back to micro-batch 1."""
    attempt, tried = plan, set()
    while True:
        cert = start_up_check(raw, attempt)
        if cert.invariant:
            return attempt
        tried.add(attempt)
        failed = {"encode"} if not cert.batch_invariant else set()
        failed |= {"decode"} if not cert.decode_batch_invariant else set()
        candidates = (dataclasses.replace(attempt, bucketed=tuple(set(attempt.bucketed) - failed)),
                      dataclasses.replace(attempt, lone_unpadded=tuple(set(attempt.lone_unpadded) - failed),
                                          bucketed=tuple(set(attempt.bucketed) - failed)),
                      dataclasses.replace(attempt, lone_unpadded=(), bucketed=()), ExecutionPlan(1, plan.workers))
        simpler = next((c for c in candidates if c not in tried), None)
        say(f"plan {attempt.describe()} failed the start-up check ({cert.summary()}); "
            + (f"trying {simpler.describe()}" if simpler else "keeping micro-batch 1"))
        if simpler is None:
            return ExecutionPlan(1, plan.workers)
        attempt = simpler
