"""Parity of an exported artifact against the fp32 eager model, on real photographs.

Measured at export time and stored in ``manifest.json``:

* ``index_agreement``: fraction of token positions whose index equals eager fp32's;
* ``codebook_utilization``: distinct indices the artifact produced / codebook size (and the
  same for eager fp32, ``reference_codebook_utilization``);
* ``psnr_db``: PSNR of artifact decode(artifact encode(photos)) against the photos
  (``reference_psnr_db``: the same for eager fp32);
* ``decode_max_abs_diff`` / ``decode_psnr_vs_reference_db``: the artifact's decode of the
  eager fp32 indices against eager fp32's decode of them (decode parity alone).

Validation photos: the validation split of the training data (``chelsea`` and ``coffee``
from scikit-image, never trained on), cut into the same fixed, non-overlapping, centred
tiles the trainer validates on (18 tiles of 128x128): both take the split and the tiling
from ``vqserve.model.photos``.
"""

from __future__ import annotations

import math

import numpy as np

from vqserve.export.runtimes.execution import PlannedRuntime
from vqserve.export.runtimes.loader import EagerRuntime
from vqserve.model.evaluation import psnr
from vqserve.model.photos import BUILTIN_VAL, load_builtin_photo, tile_grid

VALIDATION_PHOTOS = BUILTIN_VAL


def validation_photos(size: int = 128, count: int | None = None) -> tuple[np.ndarray, dict]:
    """uint8 ``[N,size,size,3]`` validation tiles and a description for the manifest.

    ``count`` None (or 0): every tile, in photo order (what the trainer validates on).
    Otherwise ``count`` tiles taken round-robin across the photos, so each is represented.
    """
    per_photo = [tile_grid(load_builtin_photo(name), size) for name in VALIDATION_PHOTOS]
    if not count:
        tiles = [t for ts in per_photo for t in ts]
    else:
        tiles = []
        for i in range(max(len(ts) for ts in per_photo)):
            tiles += [ts[i] for ts in per_photo if i < len(ts)]
        if len(tiles) < count:
            # fewer tiles than asked: repeat is pointless, say so
            raise ValueError(f"only {len(tiles)} validation tiles of {size}px exist, asked for {count}")
        tiles = tiles[:count]
    if not tiles:
        raise ValueError(f"no validation photo is at least {size}x{size}")
    batch = np.ascontiguousarray(np.stack(tiles)).astype(np.uint8)
    info = {"source": "skimage.data", "photos": list(VALIDATION_PHOTOS), "split": "val",
            "tiles": "non-overlapping centred grid", "count": int(batch.shape[0]), "size": size}
    return batch, info


def _finite(x: float) -> float | str:
    return round(x, 3) if math.isfinite(x) else "inf"


def measure_parity(runtime, reference, photos: np.ndarray, batch_size: int = 8) -> dict:
    """Compare ``runtime`` (any Runtime) with ``reference`` (eager fp32 Runtime) on photos."""

    def run(fn, x):
        return np.concatenate([fn(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])

    ref_idx = run(reference.encode, photos)
    idx = run(runtime.encode, photos)
    size = reference.info.codebook_size
    agreement = float(np.mean(idx.astype(np.int64) == ref_idx.astype(np.int64)))
    tokens = {
        "index_agreement": agreement,
        "positions": int(ref_idx.size),
        "codebook_utilization": len(np.unique(idx)) / size,
        "reference_codebook_utilization": len(np.unique(ref_idx)) / size,
    }
    if not reference.info.decodes:  # an encode-only model: tokens are all there is
        return {**tokens, "decode": "none (encode-only model)"}
    ref_pix = run(reference.decode, ref_idx)
    pix = run(runtime.decode, idx)
    dec_of_ref = run(runtime.decode, ref_idx)
    return {
        **tokens,
        "psnr_db": _finite(psnr(pix, photos)),
        "reference_psnr_db": _finite(psnr(ref_pix, photos)),
        "decode_max_abs_diff": int(np.max(np.abs(dec_of_ref.astype(np.int16) - ref_pix.astype(np.int16)))),
        "decode_psnr_vs_reference_db": _finite(psnr(dec_of_ref, ref_pix)),
    }


def same_dtype_agreement(served, model_path, dtype: str, device: str, plan, photos: np.ndarray) -> float | None:
    """Path identity: the fraction of tokens the artifact shares with the eager runtime at
    the same dtype (1.0 where the format runs the same kernels; less where it does not,
    e.g. ONNX Runtime's own convolutions). None where eager cannot run the dtype."""

    try:
        eager = PlannedRuntime(EagerRuntime(model_path, dtype=dtype, device=device), plan)
    except (ValueError, RuntimeError):
        return None
    try:
        same = np.mean(np.asarray(served.encode(photos)) == np.asarray(eager.encode(photos)))
    finally:
        eager.close()
    return float(same)
