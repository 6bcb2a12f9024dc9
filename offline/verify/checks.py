"""The checks of ``vqserve verify`` that need no model: files, sha256, schema, rows, keys,
tokens and grids, shard by shard, cheapest first.

Each records into the run's :class:`~vqserve.offline.verify.report.Report`; a shard that
cannot be read, or whose schema differs, is not row-checked (its rows' fields cannot be
trusted to exist). The rows of the shards that passed are what the re-encoded sample
(:mod:`vqserve.offline.verify.reencode`) is drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vqserve.core.files import sha256_file
from vqserve.core.token_layout import TokenLayout
from vqserve.offline.storage import objects
from vqserve.offline.verify.folder import ShardTable, _schema_problem, load_table
from vqserve.offline.verify.report import Report


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
        digest = sha256_file(path) if isinstance(path, Path) else objects.sha256_read(path)
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
    layout = TokenLayout.from_info(model)  # a pyramid's scales, from the manifest
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
        problem = _grid_problem(meta, i, table, factor, depth) if layout.is_grid else \
            _flat_problem(meta, i, table, layout)
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


def _flat_problem(meta: dict, i: int, table: ShardTable, layout: TokenLayout) -> str | None:
    """A pyramid or sequence row: its image size is one the layout takes, and it holds exactly
    that many tokens."""
    h, w = meta["height"][i], meta["width"][i]
    gh, gw = meta["grid_height"][i], meta["grid_width"][i]
    try:
        (length,) = layout.token_shape(h, w)
    except ValueError as exc:
        return str(exc)
    if (gh, gw) != layout.shard_grid(h, w):
        return f"grid_height x grid_width {gh}x{gw} != {'x'.join(map(str, layout.shard_grid(h, w)))} ({layout.kind})"
    n = table.offsets[i + 1] - table.offsets[i]
    if n != length:
        return f"holds {n} tokens, a {h}x{w} image's {layout.kind} has {length}"
    if table.shapes is not None and tuple(table.shapes[i]) != (length,):
        return f"tokens array has shape {tuple(table.shapes[i])}, expected ({length},)"
    return None


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
