"""Token shards on disk: the Parquet schema, deterministic atomic writes, reading back.

One row per image. Readable with pyarrow / pandas / ``datasets`` alone::

    key, source                      string
    orig_height, orig_width          int32   the image as displayed (after EXIF rotation)
    crop_top, crop_left,
    crop_height, crop_width          int32   the region used, in original pixels
    height, width                    int32   the pixels the model saw
    grid_height, grid_width          int32   the token grid (a pyramid's: its finest scale)
    tokens                           list<uint8|uint16|uint32>  row-major [grid_h, grid_w(, Q)];
                                     a pyramid's flat [L], coarse to fine, row-major within a scale

An output folder holds the shards and, in ``__vqserve__/``, the manifest and the error log
(:class:`Layout`): readers of a folder of Parquet files (pandas, ``pyarrow.dataset``,
Hugging Face ``datasets``) skip that folder, so the output folder itself is the dataset.

Each shard also carries key-value metadata: ``vqserve.fingerprint`` (the settings it was
made with), ``vqserve.plan`` (sha256 of its input records, so a resume notices changed
inputs) and ``vqserve.errors`` (the images of this shard that failed); a shard of pyramid tokens
(VAR) also ``vqserve.token_layout`` (``TokenLayout.to_dict()``: the scale schedules, so a reader
of the file alone can split each row; grid shards carry no such key and keep their bytes). Shards are written
to a temporary name, fsynced and renamed: a file with the final name is always complete.
Writes are byte-deterministic: the same rows give the same bytes.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vqserve.core.files import atomic_write
from vqserve.core.token_layout import TokenLayout
from vqserve.offline.storage import readable

META_FINGERPRINT = b"vqserve.fingerprint"
META_PLAN = b"vqserve.plan"
META_ERRORS = b"vqserve.errors"
META_TOKEN_LAYOUT = b"vqserve.token_layout"
INT_COLUMNS = ("orig_height", "orig_width", "crop_top", "crop_left", "crop_height", "crop_width",
               "height", "width", "grid_height", "grid_width")
FORMATS = ("parquet", "webdataset")


@dataclass(frozen=True)
class Layout:
    """Where the side files of an output folder live.

    Layout 2 keeps them in ``__vqserve__/``: pyarrow and pandas skip names starting with
    ``_``, Hugging Face ``datasets`` skips folders starting with ``__``, so
    ``pd.read_parquet(DIR)``, ``pyarrow.dataset.dataset(DIR)`` and
    ``load_dataset("parquet", data_dir=DIR)`` read the shards and nothing else. The
    WebDataset metadata member is ``__vqserve__``, a name webdataset skips (a ``.json``
    member would come out as a sample without tokens). Layout 1 (manifest and errors beside
    the shards) is what releases before 26 Nov 2026 wrote: such folders still verify,
    detokenize and resume, in their own layout, so a resumed run stays byte-identical.
    """

    version: str
    manifest: str          # relative to the output folder
    errors: str
    wds_meta: str          # the member of a WebDataset shard holding fingerprint/plan/errors

    def manifest_path(self, out: Path) -> Path:
        return out / self.manifest

    def errors_path(self, out: Path) -> Path:
        return out / self.errors


LAYOUT_2 = Layout("vqserve-tokens/2", "__vqserve__/manifest.json", "__vqserve__/errors.jsonl",
                  "__vqserve__")
LAYOUT_1 = Layout("vqserve-tokens/1", "manifest.json", "errors.jsonl", "__vqserve__.json")
LAYOUTS = {layout.version: layout for layout in (LAYOUT_2, LAYOUT_1)}
CURRENT_LAYOUT = LAYOUT_2
WDS_META_MEMBERS = tuple(layout.wds_meta for layout in LAYOUTS.values())


def layout_of(out: Path) -> Layout:
    """The layout of an existing output folder (by where its manifest is), else the current
    one. A folder with a top-level ``manifest.json`` reads as layout 1 even when that file is
    something else's (an export folder): the manifest check then refuses it by its content."""
    for layout in LAYOUTS.values():
        if layout.manifest_path(out).exists():
            return layout
    return CURRENT_LAYOUT


@dataclass
class TokenRow:
    key: str
    source: str
    orig_height: int
    orig_width: int
    crop: tuple[int, int, int, int]   # top, left, height, width
    height: int
    width: int
    tokens: np.ndarray                # [grid_h, grid_w(, Q)] in the index dtype

    def meta(self, layout: TokenLayout | None = None) -> dict:
        t, left, h, w = self.crop
        if layout is None or layout.is_grid:
            grid = int(self.tokens.shape[0]), int(self.tokens.shape[1])
        else:  # a pyramid's finest scale (the latent of the image the model saw), a sequence's 1 x L
            grid = layout.shard_grid(self.height, self.width)
        return {"key": self.key, "source": self.source, "orig_height": self.orig_height,
                "orig_width": self.orig_width, "crop_top": t, "crop_left": left, "crop_height": h,
                "crop_width": w, "height": self.height, "width": self.width,
                "grid_height": grid[0], "grid_width": grid[1]}


def layout_meta(layout: TokenLayout | None) -> dict:
    """The shard metadata of a non-grid layout (nothing for a grid: its bytes stay as they were)."""
    if layout is None or layout.is_grid:
        return {}
    return {"token_layout": layout.to_dict()}


def shard_pattern(count: int, fmt: str = "parquet") -> str:
    """Every shard name of a folder as one brace range (``shard-{000000..000012}.tar``), the
    form WebDataset and ``braceexpand`` take: a reader needs no glob and no listing."""
    ext = shard_name(0, fmt).rsplit(".", 1)[1]
    return shard_name(0, fmt) if count <= 1 else f"shard-{{{0:06d}..{count - 1:06d}}}.{ext}"


def shard_name(index: int, fmt: str = "parquet") -> str:
    """Deterministic from the input order: shard ``index`` holds records
    ``[index * shard_size, (index + 1) * shard_size)`` of the listed inputs."""
    return f"shard-{index:06d}.{'parquet' if fmt == 'parquet' else 'tar'}"


def schema(index_dtype: str):
    import pyarrow as pa

    fields = [pa.field("key", pa.string()), pa.field("source", pa.string())]
    fields += [pa.field(name, pa.int32()) for name in INT_COLUMNS]
    fields.append(pa.field("tokens", pa.list_(pa.from_numpy_dtype(np.dtype(index_dtype)))))
    return pa.schema(fields)


def write_parquet_shard(final: Path, rows: Sequence[TokenRow], index_dtype: str, fingerprint: str,
                        plan: str, errors: list[dict], layout: Layout = CURRENT_LAYOUT,
                        tokens: TokenLayout | None = None) -> None:
    """One Parquet file (zstd, one row group; none for a shard whose images all failed,
    except in layout 1, which stays as that release wrote it). ``tokens``: the token layout
    (None or a grid: rows are grids and nothing more is recorded)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kv = {META_FINGERPRINT: fingerprint.encode(), META_PLAN: plan.encode(),
          META_ERRORS: json.dumps(errors, sort_keys=True).encode()}
    if extra := layout_meta(tokens):
        kv[META_TOKEN_LAYOUT] = json.dumps(extra["token_layout"], sort_keys=True).encode()
    sch = schema(index_dtype).with_metadata(kv)
    metas = [r.meta(tokens) for r in rows]
    columns = [pa.array([m["key"] for m in metas], pa.string()),
               pa.array([m["source"] for m in metas], pa.string())]
    columns += [pa.array([m[c] for m in metas], pa.int32()) for c in INT_COLUMNS]
    flat = [np.ascontiguousarray(r.tokens, dtype=index_dtype).reshape(-1) for r in rows]
    offsets = np.zeros(len(flat) + 1, dtype=np.int32)
    np.cumsum([f.size for f in flat], out=offsets[1:])
    values = np.concatenate(flat) if flat else np.zeros(0, dtype=index_dtype)
    columns.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)))
    table = pa.Table.from_arrays(columns, schema=sch)

    def write(tmp: Path) -> None:
        if rows or layout is LAYOUT_1:
            pq.write_table(table, tmp, compression="zstd", row_group_size=max(1, len(rows)))
        else:  # no row group at all: an empty one makes `datasets` ask pyarrow for batches of 0
            pq.ParquetWriter(tmp, sch, compression="zstd").close()
    atomic_write(final, write)


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def wds_member_base(key: str) -> str:
    """WebDataset splits a member name at the first dot of its file name, so dots in a key's
    last component become ``_`` in member names (the true key is in the ``.json`` member)."""
    d, _, base = key.rpartition("/")
    base = base.replace(".", "_")
    return f"{d}/{base}" if d else base


def write_webdataset_shard(final: Path, rows: Sequence[TokenRow], index_dtype: str, fingerprint: str,
                           plan: str, errors: list[dict], layout: Layout = CURRENT_LAYOUT,
                           tokens: TokenLayout | None = None) -> None:
    """A tar of ``KEY.tokens.npy`` + ``KEY.json`` per image, plus the layout's metadata member."""
    def write(tmp: Path) -> None:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            for r in rows:
                base = wds_member_base(r.key)
                buf = io.BytesIO()
                np.save(buf, np.ascontiguousarray(r.tokens, dtype=index_dtype), allow_pickle=False)
                _tar_add(tar, f"{base}.tokens.npy", buf.getvalue())
                _tar_add(tar, f"{base}.json", json.dumps(r.meta(tokens), sort_keys=True).encode())
            meta = {"fingerprint": fingerprint, "plan": plan, "errors": errors, **layout_meta(tokens)}
            _tar_add(tar, layout.wds_meta, json.dumps(meta, sort_keys=True).encode())
    atomic_write(final, write)


WRITERS = {"parquet": write_parquet_shard, "webdataset": write_webdataset_shard}


_WARM: set = set()


def load_writer(fmt: str) -> None:
    """Warm the ``fmt`` writer up once per process: import what it needs and write one row
    to memory. The first Parquet write imports pyarrow and pandas and initialises the codec
    (~0.45 s of CPU on a 2-core Xeon, then ~36 ms per 1,000 rows), so the first shard's
    commit does not pay for it and a run's per-image CPU figure counts no one-time cost."""
    if fmt != "parquet" or fmt in _WARM:
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_arrays([pa.array(["k"]), pa.array([[1, 2]], pa.list_(pa.uint16()))],
                                 names=["key", "tokens"])
    pq.write_table(table, pa.BufferOutputStream(), compression="zstd")
    _WARM.add(fmt)


@dataclass
class ShardInfo:
    fingerprint: str
    plan: str
    errors: list[dict]
    rows: int


def open_tar(path) -> tarfile.TarFile:
    """A shard's tar, local or remote (a :class:`~vqserve.offline.storage.RemotePath`)."""
    if isinstance(path, Path):
        return tarfile.open(path, "r:")
    return tarfile.open(fileobj=readable(path), mode="r:")


def read_shard_info(path) -> ShardInfo:
    """The metadata of a committed shard (no token data read; a remote shard's footer is read
    by range). Raises on a damaged file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        md = pq.read_metadata(readable(path))
        kv = md.metadata or {}
        return ShardInfo(kv.get(META_FINGERPRINT, b"").decode(), kv.get(META_PLAN, b"").decode(),
                         json.loads(kv.get(META_ERRORS, b"[]")), md.num_rows)
    with open_tar(path) as tar:
        names = tar.getnames()
        meta_name = next((n for n in WDS_META_MEMBERS if n in names), None)
        member = tar.extractfile(meta_name) if meta_name else None
        meta = json.loads(member.read()) if member else {}
    rows = sum(1 for n in names if n.endswith(".tokens.npy"))
    return ShardInfo(meta.get("fingerprint", ""), meta.get("plan", ""), meta.get("errors", []), rows)


def read_rows(path) -> list[dict]:
    """All rows of a shard as dicts with ``tokens`` reshaped to ``[grid_h, grid_w(, Q)]`` (a
    pyramid's stay flat ``[L]``: split them with the layout the shard and manifest record)."""
    rows: list[dict] = []
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(readable(path))
        flat = META_TOKEN_LAYOUT in (table.schema.metadata or {})  # a pyramid: rows stay [L]
        for rec in table.to_pylist():
            values = np.asarray(rec["tokens"], dtype=table.schema.field("tokens").type.value_type.to_pandas_dtype())
            rec["tokens"] = values if flat else _grid(values, rec)
            rows.append(rec)
        return rows
    with open_tar(path) as tar:
        members = {m.name: m for m in tar.getmembers()}
        for name, m in members.items():
            if not name.endswith(".json") or name in WDS_META_MEMBERS:
                continue
            rec = json.loads(tar.extractfile(m).read())
            npy = tar.extractfile(members[name[: -len(".json")] + ".tokens.npy"]).read()
            rec["tokens"] = np.load(io.BytesIO(npy), allow_pickle=False)
            rows.append(rec)
    return rows


def _grid(flat: np.ndarray, rec: dict) -> np.ndarray:
    h, w = rec["grid_height"], rec["grid_width"]
    depth = flat.size // max(1, h * w)
    return flat.reshape(h, w) if depth == 1 else flat.reshape(h, w, depth)
