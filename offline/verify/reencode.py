"""The last check of ``vqserve verify``: re-encode a sample of rows from their sources, and
tell fp32 ties from mismatches.

A deterministic, seed-based sample of rows spread over the shards is re-read from its
``source``, preprocessed with the recorded settings and encoded with the recorded model; the
tokens must be equal, bit for bit, or differ only by fp32 *ties*. A source that cannot be
read any more is *skipped*, not failed: datasets outlive their raw images.

A tie: two correct fp32 machines (CPUs, GPUs, runtimes) may round a latent that lies within
about 1e-6 of a level of a rounding boundary differently. For a row whose re-encoded tokens
differ, the image's latents are recomputed in float64 on the CPU (``vqserve.model.ties``):
a differing token whose two codes are adjacent (one boundary between them) with an fp64
margin below ``delta`` is a tie, reported (count, rate, keys, margins) but not failed;
anything else fails. Only rows with a differing token pay for the fp64 pass.

Only this module loads a model (and torch), and only when a sample is to be re-encoded.
:func:`recorded_runtime` (which runtime makes a manifest's tokens) serves ``vqserve
detokenize`` too.
"""

from __future__ import annotations

import dataclasses
import tarfile

import numpy as np

from vqserve.core import images
from vqserve.core.identity import same_tokens
from vqserve.export.runtimes.execution import PlannedRuntime, plan_for
from vqserve.offline import sources
from vqserve.offline.job import runtime_machine
from vqserve.offline.verify.checks import _Ctx
from vqserve.offline.verify.folder import META_COLUMNS, NotADataset, load_table
from vqserve.offline.verify.report import Report


class ModelMismatch(ValueError):
    """The model that would re-encode is not the one the tokens were made with: refuse."""


def sample_positions(total: int, n: int, seed: int) -> list[int]:
    """``n`` of ``range(total)``, one per equal stratum at a seeded offset: deterministic,
    spread evenly over the dataset (hence over the shards), every row when ``n >= total``."""
    if n >= total:
        return list(range(total))
    rng = np.random.default_rng(seed)
    u = rng.random(n)
    return sorted({min(total - 1, int((i + u[i]) * total / n)) for i in range(n)})


def recorded_runtime(recorded: dict, model: str | None = None) -> tuple[str, str, str | None]:
    """(model, backend, dtype) that make the tokens a manifest's ``model`` block records.
    Exact tokens - the model's fp32 eager tokens, whatever backend the plan ran - are made
    by the model as given (a checkpoint in eager fp32, an exact export as exported); tokens
    of a lower precision export the plan made in its cache, by that export; others, by the
    recorded backend and dtype. ``model`` (the user's ``--model``) replaces the recorded one."""
    ref = model or recorded["ref"]
    if recorded.get("exact"):
        return ref, "auto", None
    if recorded.get("artifact") and not model:
        return recorded["artifact"], "auto", None
    return ref, recorded.get("backend", "auto"), recorded.get("dtype")


def _open_runtime(manifest: dict, model: str | None, device: str | None, report: Report):
    """The recorded model (or ``model``) on the recorded backend/dtype; refuses another model."""
    import torch

    from vqserve.export.runtimes.loader import load_runtime, resolve_device

    m = manifest["model"]
    if device == "auto":
        device = resolve_device(device)
    ref = model or m["ref"]
    recorded = str(m.get("device", "cpu")).split(":")[0]
    if device is None:
        device = recorded
        if device == "cuda" and not torch.cuda.is_available():
            device = "cpu"
            report.notes.append("tokens were made on cuda, re-encoding on cpu (no GPU here): an "
                                "index at a rounding boundary may differ")
    elif device.split(":")[0] != recorded:
        report.notes.append(f"tokens were made on {recorded}, re-encoding on {device}: an index at "
                            "a rounding boundary may differ")
    ref, backend, dtype = recorded_runtime(m, model)
    try:
        runtime = load_runtime(ref, backend=backend, dtype=dtype, device=device)
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a damaged checkpoint
        hint = "" if model else "; pass --model with the model the tokens were made with"
        raise NotADataset(f"cannot load the model {ref!r} to re-encode the sample: {exc}{hint} "
                          "(or --sample 0 to skip re-encoding)") from None
    check_model_hash(runtime, manifest, ref)
    return PlannedRuntime(runtime, plan_for(device, workers=1))  # tokenize's arithmetic, one image


def check_model_hash(runtime, manifest: dict, ref: str) -> None:
    """The runtime must make the recorded tokens: the same files, or both exact for the same
    checkpoint (an export of it and the checkpoint itself; ``same_tokens``)."""
    want, got = manifest["model"]["model_hash"], runtime.info.model_hash
    if not same_tokens(manifest["model"], runtime.info):
        raise ModelMismatch(f"the model {ref!r} has hash {got[:16]}..., but the tokens were made "
                            f"with {want[:16]}...; re-encoding with another model proves nothing: "
                            "pass --model with the original model (or --sample 0)")


def _preprocess(manifest: dict) -> images.Preprocess:
    names = {f.name for f in dataclasses.fields(images.Preprocess)}
    return images.Preprocess(**{k: v for k, v in manifest["preprocess"].items() if k in names})


def _reencode_sample(ctx: _Ctx, n: int, seed: int, runtime, model: str | None,
                     device: str | None, delta: float) -> None:
    """Re-encode the sampled rows; the model is loaded at the first readable source, so a
    dataset whose raw images are gone verifies without one."""
    rep, order = ctx.report, list(ctx.rows_per_shard.items())
    total = sum(c for _, c in order)
    picks = sample_positions(total, n, seed)
    rep.sample = {"rows": total, "requested": n, "selected": len(picks), "seed": seed,
                  "matched": 0, "tied": 0, "mismatched": 0, "skipped": 0}
    rep.ties = {"delta": delta, "tokens": 0, "count": 0, "rate": 0.0, "rows": 0, "list": []}
    reference = _Reference(ctx.manifest, model)
    pre = _preprocess(ctx.manifest)
    column = ctx.manifest.get("identity", {}).get("image_column", "image")
    start, p = 0, 0
    for name, count in order:
        mine = []
        while p < len(picks) and picks[p] < start + count:
            mine.append(picks[p] - start)
            p += 1
        start += count
        if not mine:
            continue
        table = load_table(ctx.out / name)
        for i in mine:
            row = {c: table.meta[c][i] for c in META_COLUMNS}
            try:
                prepared = _read_source(row["source"], column, pre)
            except _Unavailable as exc:
                rep.skip("reencode")
                rep.sample["skipped"] += 1
                if rep.sample["skipped"] <= 3:
                    rep.notes.append(f"skipped {row['key']!r}: source unavailable ({exc})")
                continue
            if runtime is None:
                runtime = _open_runtime(ctx.manifest, model, device, rep)
                rep.machines = _machines(ctx.manifest, runtime)
            problem, ties = _compare(runtime, prepared, row, table.tokens(i), reference, delta)
            rep.ties["tokens"] += int(table.tokens(i).size)
            if problem:
                rep.fail("reencode", problem, name, row["key"])
                rep.sample["mismatched"] += 1
            else:
                rep.ok("reencode")
                rep.sample["tied" if ties else "matched"] += 1
            _add_ties(rep, ties, name, row["key"])
    rep.ties["rate"] = rep.ties["count"] / max(rep.ties["tokens"], 1)
    if reference.unavailable:
        rep.notes.append(reference.unavailable)


def _add_ties(rep: Report, ties: list[dict], name: str, key: str) -> None:
    if not ties:
        return
    rep.ties["count"] += len(ties)
    rep.ties["rows"] += 1
    room = rep.max_problems - len(rep.ties["list"])
    rep.ties["list"] += [{"file": name, "key": key, **t} for t in ties[:max(room, 0)]]


def _machines(manifest: dict, runtime) -> dict:
    """The machines that made the tokens (the manifest's record) and this one."""
    return {"recorded": [m for m in manifest.get("machines") or [] if isinstance(m, dict)],
            "here": runtime_machine(runtime.info.to_dict())}


class _Reference:
    """The fp32 eager tokenizer whose float64 copy judges ties, loaded at the first row
    whose tokens differ. Ties are judged only for fp32 tokens (bf16/fp16 tokens differ
    from fp64 by design, at their measured agreement) and only with the checkpoint the
    tokens are the exact tokens of; without one, every differing token is a mismatch."""

    def __init__(self, manifest: dict, model: str | None):
        self.manifest, self.model = manifest, model
        self.tokenizer = None
        self.unavailable = ""
        self._tried = False

    def get(self, runtime):
        if not self._tried:
            self._tried = True
            self.tokenizer = self._load(runtime)
        return self.tokenizer

    def _load(self, runtime):
        m = self.manifest["model"]
        if m.get("dtype", "fp32") != "fp32":
            self.unavailable = (f"tokens were made in {m.get('dtype')}: no fp32 ties are recognised, "
                                "every differing token is a mismatch")
            return None
        tokenizer = getattr(runtime, "tokenizer", None)
        if tokenizer is not None and runtime.info.dtype == "fp32":
            return tokenizer
        ref = self.model or m["ref"]
        try:
            from vqserve.export.runtimes.loader import model_hash_of
            from vqserve.model import load_tokenizer

            if model_hash_of(ref) == m.get("source_hash", m["model_hash"]):
                return load_tokenizer(ref).eval()
        except (OSError, ValueError, RuntimeError):
            pass
        self.unavailable = (f"{ref!r} is not the checkpoint the tokens were made from, so fp64 latents "
                            "cannot be recomputed: every differing token counts as a mismatch (pass "
                            "--model with the checkpoint to recognise fp32 ties)")
        return None


class _Unavailable(Exception):
    """A sampled row's source cannot be reopened: counted as skipped, never as a failure."""


def _read_source(source: str, column: str, pre: images.Preprocess) -> images.Prepared:
    """The row's source, reopened and preprocessed; anything that stops that is unavailability
    (moved, deleted, truncated since): a dataset may outlive its raw images."""
    try:
        rec = sources.parse_source(source)
        return images.prepare(sources.read_image_source(rec, column), pre)
    except (OSError, KeyError, ValueError, tarfile.TarError) as exc:  # ImageError is a ValueError
        raise _Unavailable(f"{type(exc).__name__}: {str(exc)[:160]}") from None


def _compare(runtime, prepared: images.Prepared, row: dict, stored: np.ndarray, reference: _Reference,
             delta: float) -> tuple[str | None, list[dict]]:
    """(the problem or None, the ties): tokens equal, or differing only by ties, pass."""
    then = (row["orig_height"], row["orig_width"],
            (row["crop_top"], row["crop_left"], row["crop_height"], row["crop_width"]),
            (row["height"], row["width"]))
    now = (prepared.orig_height, prepared.orig_width, tuple(prepared.crop), prepared.pixels.shape[:2])
    if now != then:
        return (f"the source changed since it was tokenized (size/crop/pixels now {now}, "
                f"recorded {then})"), []
    fresh = np.asarray(runtime.encode(prepared.pixels[None]))[0]
    flat = fresh.reshape(-1).astype(np.int64)
    old = stored.astype(np.int64)
    if flat.shape != old.shape:
        return f"re-encoded {flat.size} tokens, the shard holds {old.size}", []
    diff = np.flatnonzero(flat != old)
    if not diff.size:
        return None, []
    ties, others = _ties(reference, runtime, prepared.pixels, old.reshape(fresh.shape), fresh, delta)
    if ties is None:
        ties, others = [], [{"at": tuple(int(x) for x in np.unravel_index(d, fresh.shape)),
                             "recorded": int(old[d]), "fresh": int(flat[d]), "margin": None} for d in diff[:1]]
    if not others:
        return None, ties
    first = others[0]
    why = ("codes not adjacent" if first["margin"] is None else f"fp64 margin {first['margin']:.2e} >= {delta:g}")
    tied = f", {len(ties)} fp32 ties" if ties else ""
    return (f"re-encoded tokens differ at {diff.size} of {old.size} positions{tied} (first at {first['at']}: "
            f"stored {first['recorded']}, model gives {first['fresh']}, {why})"), ties


def _ties(reference: _Reference, runtime, pixels: np.ndarray, stored: np.ndarray, fresh: np.ndarray,
          delta: float):
    """(ties, others) of one image's differing tokens on fp64 latents; (None, None) when no
    reference can judge them (the caller then reports a plain mismatch)."""
    tokenizer = reference.get(runtime)
    if tokenizer is None or fresh.ndim != 2:  # residual (several codes per position): no ties
        return None, None
    from vqserve.model import ties

    if ties.decision(tokenizer.quantizer) is None:
        return None, None
    z64 = ties.fp64_latents(tokenizer, pixels[None])
    found, others = ties.classify(tokenizer.quantizer, z64, stored[None], fresh[None], delta)
    def in_image(t: dict) -> dict:  # the image's own (y, x), without the batch index
        return {**t, "at": t["at"][1:]}

    return [in_image(t) for t in found], [in_image(t) for t in others]
