"""A ``vqserve tokenize`` output folder as ``vqserve verify`` reads it: its manifest, and each
shard as columns whatever its format.

:func:`read_manifest` tells a folder that is not a tokenize output at all (a usage error,
:class:`NotADataset`) from one whose manifest is damaged (corruption, a failed check);
``vqserve detokenize`` finds the model that made the tokens with it too. :func:`load_table`
reads a Parquet or WebDataset shard into one :class:`ShardTable`, so every row check is one
code path and no token grid is reshaped before it is checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vqserve.offline import shards
from vqserve.offline.storage import readable

META_COLUMNS = ("key", "source", *shards.INT_COLUMNS)


class NotADataset(ValueError):
    """DIR is not a tokenize output folder at all: a usage error (exit 2), not corruption."""


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

        table = pq.read_table(readable(path))
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

        got = pq.read_schema(readable(path)).remove_metadata()
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
