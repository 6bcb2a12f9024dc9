"""Check a ``vqserve tokenize`` output folder (``vqserve verify``): files, schema, keys, tokens.

A tokenized dataset is trusted for weeks of training, so this answers "are these shards
exactly what tokenize wrote, and do they still mean what the manifest says?" in layers,
cheapest first:

* **manifest** — the manifest (``__vqserve__/manifest.json``; ``manifest.json`` in folders of
  layout 1) parses, is a tokenize manifest and says ``complete`` (``folder``);
* **files / sha256 / readable** — every listed shard exists, hashes to its recorded sha256
  and opens; no unlisted ``shard-*`` file lies beside them (a mix of two runs; ``checks``);
* **schema / rows** — Parquet shards carry exactly :func:`shards.schema` (metadata aside),
  WebDataset samples their ``.json`` fields and index dtype; row counts match the manifest;
* **keys / tokens / grid** — no key twice in the dataset, every index below the codebook
  size, every grid ``height // factor x width // factor`` and holding that many tokens;
* **reencode** — a deterministic, seed-based sample of rows spread over the shards is
  re-read from its ``source``, preprocessed with the recorded settings and encoded with the
  recorded model; the tokens must be equal, bit for bit, or differ only by fp32 *ties*
  (``reencode``, which says what a tie is). A source that cannot be read any more is
  *skipped*, not failed: datasets outlive their raw images.

Each check counts passed / failed / skipped units (shards or rows) and keeps the first few
problems with their file and key (``report``). Only :func:`verify_dataset` loads a model, and
only when a sample is to be re-encoded.
"""

from __future__ import annotations

from pathlib import Path

from vqserve.offline import shards
from vqserve.offline.storage import as_path
from vqserve.offline.verify.checks import _check_files, _check_shard, _Ctx
from vqserve.offline.verify.folder import _manifest_problems, read_manifest
from vqserve.offline.verify.reencode import _reencode_sample, check_model_hash
from vqserve.offline.verify.report import Report, format_summary

# what `vqserve verify` needs: the checks, and how their report prints
__all__ = ["format_summary", "verify_dataset"]


def verify_dataset(out_dir: str | Path, sample: int = 32, runtime=None, seed: int = 0,
                   model: str | None = None, device: str | None = None,
                   max_problems: int = 10, tie_delta: float | None = None) -> dict:
    """Run every check on a tokenize output folder; returns :meth:`Report.to_dict`.

    ``runtime``: an already loaded runtime (its hash is still checked); ``None`` loads
    ``model`` (default: the manifest's ``model.ref``) on the recorded backend and dtype,
    on ``device`` (default: the recorded one), only if a sampled source can be read.
    ``tie_delta``: the fp64 margin below which a differing token is an fp32 tie (default
    ``vqserve.model.ties.DELTA``, at least ``MIN_DELTA``).
    Raises :class:`~vqserve.offline.verify.folder.NotADataset` /
    :class:`~vqserve.offline.verify.reencode.ModelMismatch` (usage errors, both ValueError).
    """
    if sample < 0:
        raise ValueError(f"--sample must be >= 0, got {sample}")
    # resolved (importing torch) only when a sample is re-encoded or a threshold was given
    delta = _tie_delta(tie_delta) if sample or tie_delta is not None else None
    out = as_path(out_dir)
    rep = Report(str(out), max_problems=max_problems)
    manifest = read_manifest(out)
    manifest_name = shards.layout_of(out).manifest
    if manifest is None:
        rep.fail("manifest", "is not valid JSON (damaged?)", manifest_name)
        return rep.to_dict()
    problems = _manifest_problems(manifest)
    for p in problems:
        rep.fail("manifest", p, manifest_name)
    if problems:
        return rep.to_dict()
    rep.ok("manifest")
    if runtime is not None:
        check_model_hash(runtime, manifest, manifest["model"]["ref"])
    ctx = _Ctx(out, manifest, rep, manifest_name)
    present = _check_files(ctx)
    for entry, path in present:
        _check_shard(ctx, entry, path)
    listed_rows = sum(int(s["rows"]) for s in manifest["shards"])
    if manifest.get("totals", {}).get("rows", listed_rows) != listed_rows:
        rep.fail("rows", f"totals.rows {manifest['totals']['rows']} != the shards' sum {listed_rows}",
                 manifest_name)
    if sample and ctx.rows_per_shard:
        _reencode_sample(ctx, sample, seed, runtime, model, device, delta)
    return rep.to_dict()


def _tie_delta(value: float | None) -> float:
    from vqserve.model.ties import DELTA, check_delta

    try:
        return check_delta(DELTA if value is None else value)
    except ValueError as exc:
        raise ValueError(f"--tie-delta: {exc}") from None
