"""Check a ``vqserve tokenize`` output folder (``vqserve verify``): files, schema, keys, tokens.

A tokenized dataset is trusted for weeks of training, so this answers "are these shards
exactly what tokenize wrote, and do they still mean what the manifest says?" in layers,
cheapest first:

* **manifest** — the manifest (``__vqserve__/manifest.json``; ``manifest.json`` in folders of
  layout 1) parses, is a tokenize manifest and says ``complete``;
* **files / sha256 / readable** — every listed shard exists, hashes to its recorded sha256
  and opens; no unlisted ``shard-*`` file lies beside them (a mix of two runs);
* **schema / rows** — Parquet shards carry exactly :func:`shards.schema` (metadata aside),
  WebDataset samples their ``.json`` fields and index dtype; row counts match the manifest;
* **keys / tokens / grid** — no key twice in the dataset, every index below the codebook
  size, every grid ``height // factor x width // factor`` and holding that many tokens;
* **reencode** — a deterministic, seed-based sample of rows spread over the shards is
  re-read from its ``source``, preprocessed with the recorded settings and encoded with the
  recorded model; the tokens must be equal, bit for bit, or differ only by fp32 *ties*.
  A source that cannot be read any more is *skipped*, not failed: datasets outlive their
  raw images.

A tie: two correct fp32 machines (CPUs, GPUs, runtimes) may round a latent that lies within
about 1e-6 of a level of a rounding boundary differently. For a row whose re-encoded tokens
differ, the image's latents are recomputed in float64 on the CPU (``vqserve.model.ties``):
a differing token whose two codes are adjacent (one boundary between them) with an fp64
margin below ``delta`` is a tie, reported (count, rate, keys, margins) but not failed;
anything else fails as before. Only rows with a differing token pay for the fp64 pass.

Each check counts passed / failed / skipped units (shards or rows) and keeps the first few
problems with their file and key. Only :func:`verify_dataset` loads a model, and only
when a sample is to be re-encoded.
"""

from __future__ import annotations

import dataclasses
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vqserve.core import images
from vqserve.offline import shards, sources

CHECKS = ("manifest", "files", "sha256", "readable", "schema", "rows", "keys", "tokens", "grid",
          "reencode")
META_COLUMNS = ("key", "source", *shards.INT_COLUMNS)


class NotADataset(ValueError):
    """DIR is not a tokenize output folder at all: a usage error (exit 2), not corruption."""


class ModelMismatch(ValueError):
    """The model that would re-encode is not the one the tokens were made with: refuse."""


# ---- the report ---------------------------------------------------------------------------
@dataclass
class Count:
    passed: int = 0
    failed: int = 0
    skipped: int = 0


@dataclass
class Report:
    """Per-check counts plus the first ``max_problems`` problems (all are counted)."""

    out_dir: str
    max_problems: int = 10
    checks: dict[str, Count] = field(default_factory=lambda: {c: Count() for c in CHECKS})
    problems: list[dict] = field(default_factory=list)
    problem_count: int = 0
    notes: list[str] = field(default_factory=list)
    sample: dict = field(default_factory=dict)
    ties: dict = field(default_factory=dict)
    machines: dict = field(default_factory=dict)

    def ok(self, check: str, n: int = 1) -> None:
        self.checks[check].passed += n

    def skip(self, check: str, n: int = 1) -> None:
        self.checks[check].skipped += n

    def fail(self, check: str, message: str, file: str | None = None, key: str | None = None) -> None:
        self.checks[check].failed += 1
        self.problem_count += 1
        if len(self.problems) < self.max_problems:
            self.problems.append({"check": check, "file": file, "key": key, "message": message})

    @property
    def passed(self) -> bool:
        return all(c.failed == 0 for c in self.checks.values())

    def to_dict(self) -> dict:
        return {"dir": self.out_dir, "ok": self.passed,
                "checks": {k: dataclasses.asdict(v) for k, v in self.checks.items()},
                "problem_count": self.problem_count, "problems": self.problems,
                "sample": self.sample, "ties": self.ties, "machines": self.machines, "notes": self.notes}


def format_summary(report: dict) -> str:
    """The human-readable form of :meth:`Report.to_dict` (what ``vqserve verify`` prints)."""
    status = "OK" if report["ok"] else f"FAILED ({report['problem_count']} problems)"
    lines = [f"verify {report['dir']}: {status}"]
    for name, c in report["checks"].items():
        if not (c["passed"] or c["failed"] or c["skipped"]):
            lines.append(f"  {name:<9} -     not checked")
            continue
        mark = "FAIL" if c["failed"] else "ok"
        extra = f", {c['skipped']} skipped" if c["skipped"] else ""
        lines.append(f"  {name:<9} {mark:<5} {c['passed']} passed, {c['failed']} failed{extra}")
    s = report["sample"]
    if s:
        lines.append(f"  sample: {s['selected']} of {s['rows']} rows (seed {s['seed']}): "
                     f"{s['matched']} re-encoded identically, {s.get('tied', 0)} identical but for fp32 ties, "
                     f"{s['mismatched']} differ, {s['skipped']} skipped (source unavailable)")
    lines += _ties_lines(report.get("ties") or {})
    lines += _machine_lines(report.get("machines") or {})
    lines += [f"  note: {n}" for n in report["notes"]]
    if report["problems"]:
        shown = len(report["problems"])
        lines.append(f"problems (first {shown} of {report['problem_count']}):")
        for p in report["problems"]:
            where = ":".join(x for x in (p["file"], f"key={p['key']!r}" if p["key"] is not None
                                         else None) if x)
            lines.append(f"  [{p['check']}] {where + ': ' if where else ''}{p['message']}")
    return "\n".join(lines)


def _ties_lines(ties: dict) -> list[str]:
    """The ties, one line each after a total: fp32 rounding noise, not corruption."""
    if not ties.get("count"):
        return []
    lines = [f"  ties: {ties['count']} of {ties['tokens']} re-encoded tokens ({ties['rate']:.2e}) differ "
             f"only where the fp64 latent lies within {ties['delta']:g} of the rounding boundary "
             "between the two codes (fp32 noise of two machines, not corruption)"]
    for t in ties["list"]:
        lines.append(f"    tie {t['file']}:key={t['key']!r} at {tuple(t['at'])}: recorded {t['recorded']}, "
                     f"re-encoded {t['fresh']}, fp64 margin {t['margin']:.2e}")
    if ties["count"] > len(ties["list"]):
        lines.append(f"    ... and {ties['count'] - len(ties['list'])} more")
    return lines


def _machine_lines(machines: dict) -> list[str]:
    """Both machines when the tokens were made on another one than re-encodes them here."""
    from vqserve.core.machine import machine_summary, same_arithmetic

    here, recorded = machines.get("here"), machines.get("recorded") or []
    if not here or not recorded or all(same_arithmetic(m, here) for m in recorded):
        return []
    return ([f"  tokens made on: {machine_summary(m)}" for m in recorded]
            + [f"  re-encoded on:  {machine_summary(here)}"])


# ---- manifest ----------------------------------------------------------------------------------
def read_manifest(out_dir: Path) -> dict | None:
    """The parsed manifest, ``None`` when it exists but does not parse (corruption, not usage).

    Raises :class:`NotADataset` when there is no manifest or it belongs to something else
    (an export artifact folder also holds a ``manifest.json``)."""
    if not out_dir.is_dir():
        raise NotADataset(f"{out_dir} is not a folder (give the --out folder of `vqserve tokenize`)")
    expected = shards.layout_of(out_dir)
    path = expected.manifest_path(out_dir)
    if not path.is_file():
        raise NotADataset(f"{out_dir} holds no {expected.manifest}: not a `vqserve tokenize` output folder")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    layout = manifest.get("identity", {}).get("layout") if isinstance(manifest, dict) else None
    if layout != expected.version:
        raise NotADataset(f"{path} is not a `vqserve tokenize` manifest (layout {layout!r}, "
                          f"expected {expected.version!r})")
    return manifest


def _manifest_problems(m: dict) -> list[str]:
    """Fields the later checks rely on; a manifest missing them cannot vouch for anything."""
    problems = []
    model = m.get("model")
    if not isinstance(model, dict):
        return ["has no 'model' section"]
    for k in ("model_hash", "codebook_size", "factor", "codes_per_position", "ref"):
        if k not in model:
            problems.append(f"model.{k} is missing")
    if not isinstance(m.get("preprocess"), dict):
        problems.append("has no 'preprocess' section")
    try:
        np.dtype(m.get("index_dtype"))
    except TypeError:
        problems.append(f"index_dtype {m.get('index_dtype')!r} is not a numpy dtype")
    listed = m.get("shards")
    if not isinstance(listed, list) or not all(
            isinstance(s, dict) and {"name", "rows", "sha256"} <= set(s) for s in listed):
        problems.append("'shards' is not a list of {name, rows, sha256}")
    elif not m.get("complete"):
        problems.append("is not complete (the run was interrupted: run the same `vqserve tokenize` "
                        "command again to finish it)")
    return problems


# ---- reading a shard whatever its format -------------------------------------------------------
@dataclass
class ShardTable:
    """One shard as columns: metadata lists plus flat tokens and row offsets (both formats),
    so the row checks are one code path and no token grid is reshaped before it is checked."""

    meta: dict[str, list]
    offsets: np.ndarray       # int64 [rows + 1]
    values: np.ndarray        # every row's tokens, concatenated
    dtype: str                # the stored index dtype
    shapes: list | None = None  # WebDataset: each row's stored array shape

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    def tokens(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]


def load_table(path: Path) -> ShardTable:
    """Read a whole shard; raises on a damaged file (the caller reports it as unreadable)."""
    if path.suffix == ".parquet":
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        meta = {n: table.column(n).to_pylist() for n in table.column_names if n != "tokens"}
        tok = table.column("tokens")
        lengths = pc.fill_null(pc.list_value_length(tok), 0).to_numpy(zero_copy_only=False)
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        values = pc.list_flatten(tok).to_numpy(zero_copy_only=False)
        return ShardTable(meta, offsets, values, str(values.dtype))
    rows = shards.read_rows(path)
    meta = {c: [r.get(c) for r in rows] for c in META_COLUMNS}
    flat = [np.asarray(r["tokens"]).reshape(-1) for r in rows]
    dtypes = {f.dtype.name for f in flat}
    dtype = dtypes.pop() if len(dtypes) == 1 else ",".join(sorted(dtypes)) or "none"
    offsets = np.concatenate([[0], np.cumsum([f.size for f in flat], dtype=np.int64)])
    values = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)
    return ShardTable(meta, offsets, values, dtype, shapes=[np.shape(r["tokens"]) for r in rows])


def _schema_problem(path: Path, table: ShardTable, index_dtype: str) -> str | None:
    """Parquet: the exact Arrow schema tokenize writes; WebDataset: the fields and the dtype."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        got = pq.read_schema(path).remove_metadata()
        want = shards.schema(index_dtype)
        if got.equals(want):
            return None
        diff = [f"{f.name}: {got.field(f.name).type if f.name in got.names else 'missing'} "
                f"(expected {f.type})" for f in want if f.name not in got.names
                or not got.field(f.name).equals(f)]
        diff += [f"{n}: unexpected column" for n in got.names if n not in want.names]
        return "schema differs from tokenize's: " + "; ".join(diff or ["column order"])
    missing = [c for c in META_COLUMNS if any(v is None for v in table.meta[c])]
    if missing:
        return f"samples lack fields {', '.join(missing)} in their .json"
    if table.rows and table.dtype != np.dtype(index_dtype).name:
        return f"tokens are {table.dtype}, the manifest says {index_dtype}"
    return None


# ---- the checks ---------------------------------------------------------------------------------
@dataclass
class _Ctx:
    out: Path
    manifest: dict
    report: Report
    manifest_name: str                                    # where problems with it are reported
    keys: dict[str, str] = field(default_factory=dict)   # key -> shard that holds it first
    rows_per_shard: dict[str, int] = field(default_factory=dict)  # readable shards only


def _check_files(ctx: _Ctx) -> list[tuple[dict, Path]]:
    """Listed shards present and hashed right; no strays. Returns the shards that exist."""
    rep, present = ctx.report, []
    listed_names = set()
    for entry in ctx.manifest["shards"]:
        name = str(entry["name"])
        listed_names.add(name)
        path = ctx.out / name
        if Path(name).name != name or not name.startswith("shard-"):
            rep.fail("files", f"manifest lists a shard named {name!r}, not a shard-* file",
                     ctx.manifest_name)
            continue
        if not path.is_file():
            rep.fail("files", "listed in the manifest but missing", name)
            rep.skip("sha256")
            continue
        rep.ok("files")
        present.append((entry, path))
        digest = shards.sha256_file(path)
        if digest == entry["sha256"]:
            rep.ok("sha256")
        else:
            rep.fail("sha256", f"sha256 {digest[:16]}... differs from the manifest's "
                               f"{str(entry['sha256'])[:16]}... (the file changed after tokenize)", name)
    for stray in sorted(ctx.out.glob("shard-*")):
        if stray.suffix in (".parquet", ".tar") and stray.name not in listed_names:
            rep.fail("files", "shard file not listed in the manifest (from another run?)", stray.name)
    return present


def _check_shard(ctx: _Ctx, entry: dict, path: Path) -> None:
    """Readable, schema, row count, then the per-row checks, for one shard."""
    rep, name = ctx.report, path.name
    index_dtype = ctx.manifest["index_dtype"]
    try:
        table = load_table(path)
        problem = _schema_problem(path, table, index_dtype)
    except Exception as exc:  # pyarrow / tarfile / numpy raise many types for damaged files
        rep.fail("readable", f"cannot be read ({type(exc).__name__}: {str(exc)[:200]})", name)
        for check in ("schema", "rows"):
            rep.skip(check)
        return
    rep.ok("readable")
    if table.rows == entry["rows"]:
        rep.ok("rows")
    else:
        rep.fail("rows", f"holds {table.rows} rows, the manifest says {entry['rows']}", name)
    if problem:
        rep.fail("schema", problem, name)
        return  # row fields cannot be trusted to exist; the row checks would only repeat this
    rep.ok("schema")
    ctx.rows_per_shard[name] = table.rows
    _check_rows(ctx, name, table)


def _check_rows(ctx: _Ctx, name: str, table: ShardTable) -> None:
    rep, model = ctx.report, ctx.manifest["model"]
    factor, codebook = int(model["factor"]), int(model["codebook_size"])
    depth = int(model["codes_per_position"])
    bad_rows = _rows_out_of_range(table, codebook)
    meta = table.meta
    for i in range(table.rows):
        key = meta["key"][i]
        if key in ctx.keys:
            rep.fail("keys", f"duplicate key (also in {ctx.keys[key]})", name, key)
        else:
            ctx.keys[key] = name
            rep.ok("keys")
        if i in bad_rows:
            t = table.tokens(i)
            rep.fail("tokens", f"{int((t >= codebook).sum())} indices >= codebook size {codebook} "
                               f"(max {int(t.max())})", name, key)
        else:
            rep.ok("tokens")
        problem = _grid_problem(meta, i, table, factor, depth)
        if problem:
            rep.fail("grid", problem, name, key)
        else:
            rep.ok("grid")


def _rows_out_of_range(table: ShardTable, codebook: int) -> set[int]:
    """Vectorised: the rows holding an index >= codebook (one pass over the flat values)."""
    bad = np.flatnonzero(table.values >= codebook)
    if not bad.size:
        return set()
    return set(np.searchsorted(table.offsets, bad, side="right").astype(int) - 1)


def _grid_problem(meta: dict, i: int, table: ShardTable, factor: int, depth: int) -> str | None:
    h, w = meta["height"][i], meta["width"][i]
    gh, gw = meta["grid_height"][i], meta["grid_width"][i]
    if not (h and w) or h % factor or w % factor:
        return f"image size {h}x{w} is not a positive multiple of the factor {factor}"
    if (gh, gw) != (h // factor, w // factor):
        return f"grid {gh}x{gw} != {h}x{w} // {factor} = {h // factor}x{w // factor}"
    n = table.offsets[i + 1] - table.offsets[i]
    if n != gh * gw * depth:
        return f"holds {n} tokens, a {gh}x{gw} grid with {depth} code(s) per position needs {gh * gw * depth}"
    if table.shapes is not None:
        want = (gh, gw) if depth == 1 else (gh, gw, depth)
        if tuple(table.shapes[i]) != want:
            return f"tokens array has shape {tuple(table.shapes[i])}, expected {want}"
    return None


# ---- re-encoding a sample ---------------------------------------------------------------------
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
    from vqserve.export.runtimes.execution import PlannedRuntime, plan_for

    return PlannedRuntime(runtime, plan_for(device, workers=1))  # tokenize's arithmetic, one image


def check_model_hash(runtime, manifest: dict, ref: str) -> None:
    """The runtime must make the recorded tokens: the same files, or both exact for the same
    checkpoint (an export of it and the checkpoint itself; ``same_tokens``)."""
    from vqserve.core.identity import same_tokens

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
    from vqserve.offline.pipeline import runtime_machine

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


# ---- entry point ----------------------------------------------------------------------------------
def verify_dataset(out_dir: str | Path, sample: int = 32, runtime=None, seed: int = 0,
                   model: str | None = None, device: str | None = None,
                   max_problems: int = 10, tie_delta: float | None = None) -> dict:
    """Run every check on a tokenize output folder; returns :meth:`Report.to_dict`.

    ``runtime``: an already loaded runtime (its hash is still checked); ``None`` loads
    ``model`` (default: the manifest's ``model.ref``) on the recorded backend and dtype,
    on ``device`` (default: the recorded one), only if a sampled source can be read.
    ``tie_delta``: the fp64 margin below which a differing token is an fp32 tie (default
    ``vqserve.model.ties.DELTA``, at least ``MIN_DELTA``).
    Raises :class:`NotADataset` / :class:`ModelMismatch` (usage errors, both ValueError).
    """
    if sample < 0:
        raise ValueError(f"--sample must be >= 0, got {sample}")
    # resolved (importing torch) only when a sample is re-encoded or a threshold was given
    delta = _tie_delta(tie_delta) if sample or tie_delta is not None else None
    out = Path(out_dir)
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
