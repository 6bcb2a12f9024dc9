"""Dataset inputs -> an ordered list of :class:`Record` (what to tokenize, in what order).

``vqserve tokenize INPUT...`` accepts any mix of:

* a **folder** of images, recursive (``.jpg .jpeg .png .webp .bmp .tif .tiff``), sorted by
  relative path; the key is the relative path without its extension;
* a **list file** (``.txt`` / ``.lst``): one image path per line (relative paths are taken
  from the list file's folder; blank lines and ``#`` comments skipped); the key is the line (normalised);
* **WebDataset shards** (``.tar``; globs and brace ranges such as ``data-{000..099}.tar``):
  members grouped by the WebDataset key (the path up to the first dot of the file name);
  the image is the sample's first ``jpg/jpeg/png/webp/...`` member;
* **Parquet** files with an image-bytes column (``--image-column``, raw bytes or a
  ``{bytes, path}`` struct as Hugging Face ``datasets`` writes it) and an optional
  ``--key-column`` (else the key is ``<file stem>/<row>``);
* a single image file (key: its file name without the extension).

Any of them may be a URL (``s3://``, ``gs://``, ``hf://``; :mod:`vqserve.offline.storage`): a
URL naming no file kind is a **prefix**, listed once (one paginated listing, in byte order,
folder markers, ``_SUCCESS`` and ``.crc`` skipped), each image's size and ETag recorded so a
resume refuses an object that changed; a list file's URL lines are taken as they are, so the
input bucket sees no listing at all; tar members and Parquet row groups are read by range.

Planning only lists: no image bytes are read. Bytes are read later, in decode worker
processes, by :func:`read_image_source` (tar members by offset, Parquet by row group), so
the main process never holds a dataset in memory. A problem found while listing (a
sample without an image, a duplicate key) becomes a Record with ``error`` set, at its
place in the order, so it lands in errors.jsonl deterministically.
"""

from __future__ import annotations

import glob
import os
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from vqserve.offline.storage import RemotePath, as_path, is_url, readable
from vqserve.offline.storage.fs import fs_path, local_of, require

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
LIST_EXTENSIONS = (".txt", ".lst")
_FILE_KINDS = (*IMAGE_EXTENSIONS, *LIST_EXTENSIONS, ".tar", ".parquet", ".tar.gz", ".tgz", ".tar.zst",
               ".tar.bz2", ".tar.xz")
_WDS_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "image")


class Record(NamedTuple):
    """One image to tokenize. ``source`` is what errors.jsonl and the shards show and what
    ``vqserve verify`` reopens: a path, ``TAR::MEMBER`` or ``PARQUET::row=N``."""

    key: str
    source: str
    kind: str        # file | tar | parquet
    path: str        # the image file, tar or parquet file (absolute)
    offset: int = 0  # tar: byte offset of the member's data; parquet: row number
    size: int = 0    # tar: member size in bytes
    error: str = ""  # set when listing already found the problem
    etag: str = ""   # a remote object's size and ETag when listed ("SIZE:ETAG"), else ""


class InputError(ValueError):
    """An INPUT argument cannot be used at all (missing, unknown kind): a usage error."""


def _expand(arg: str) -> list[str]:
    """Brace ranges then globs; a plain path passes through unchanged."""
    from braceexpand import braceexpand

    out: list[str] = []
    for pattern in braceexpand(arg) if "{" in arg else [arg]:
        if any(ch in pattern for ch in "*?["):
            if is_url(pattern):
                scheme = pattern.split("://", 1)[0]
                matches = [f"{scheme}://{m}" for m in sorted(RemotePath(pattern).fs.glob(fs_path(pattern)))]
            else:
                matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise InputError(f"{pattern}: no files match")
            out.extend(matches)
        else:
            out.append(pattern)
    return out


def _folder_records(folder: Path) -> Iterator[Record]:
    """Every image below ``folder`` (hidden names skipped), by relative path; ``source`` is
    the file's real path. The real path of each folder is found once and a file's is that
    plus its name unless the file is itself a link: resolving every path component of every
    file cost ~115 µs per file (about 2 minutes before the first image of a million)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        real_dir = None
        rel_dir = os.path.relpath(dirpath, folder)
        prefix = "" if rel_dir == "." else f"{Path(rel_dir).as_posix()}/"
        for name in filenames:
            if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith("."):
                full = os.path.join(dirpath, name)
                if real_dir is None:
                    real_dir = os.path.realpath(dirpath)
                real = os.path.realpath(full) if os.path.islink(full) else os.path.join(real_dir, name)
                files.append((prefix + name, real))
    for rel, real in sorted(files):
        yield Record(key=rel.rsplit(".", 1)[0], source=real, kind="file", path=real)


def _lines(list_file: Path | RemotePath) -> Iterator[str]:
    if isinstance(list_file, RemotePath):
        with list_file.open("rb") as fh:
            for raw in fh:
                yield raw.decode("utf-8")
        return
    with open(list_file, encoding="utf-8") as fh:
        yield from fh


def _list_records(list_file: Path | RemotePath) -> Iterator[Record]:
    base = list_file.parent if isinstance(list_file, RemotePath) else list_file.resolve().parent
    for line in _lines(list_file):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if is_url(line) or isinstance(base, RemotePath):  # no request now: read when its task runs
            url = line if is_url(line) else str(base / line)
            yield Record(key=line, source=url, kind="file", path=url)
            continue
        p = Path(line) if Path(line).is_absolute() else base / line
        yield Record(key=os.path.normpath(line), source=str(p.resolve()), kind="file",
                     path=str(p.resolve()))


def wds_key(member_name: str) -> tuple[str, str]:
    """WebDataset's convention: ``dir/name.ext.ext2`` -> key ``dir/name``, ext ``ext.ext2``."""
    d, _, base = member_name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext.lower()


def _where(p: Path | RemotePath) -> tuple[str, str]:
    """A container's path as records name it, and its ``SIZE:ETAG`` when remote (one HEAD)."""
    if isinstance(p, RemotePath):
        return str(p), _version(p.info())
    return str(p.resolve()), ""


def _version(info: dict) -> str:
    """``SIZE:ETAG`` of a listed object: what changes when the object does."""
    return f"{info.get('size', '')}:{str(info.get('ETag') or info.get('etag') or '').strip(chr(34))}"


def _tar_records(tar_path: Path | RemotePath) -> Iterator[Record]:
    path, version = _where(tar_path)
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    order: list[str] = []
    try:
        with _open_tar(tar_path) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = wds_key(member.name)
                if key not in samples:
                    samples[key] = {}
                    order.append(key)
                samples[key][ext] = member
    except (tarfile.TarError, OSError) as exc:
        # a truncated or corrupt shard: keep what was listed, record the rest as one error
        for key in order:
            yield from _tar_sample(path, key, samples[key], version)
        yield Record(key=f"{tar_path.name}#unreadable", source=path, kind="tar", path=path,
                     error=f"tar shard cannot be read past {len(order)} samples ({type(exc).__name__}: {exc})")
        return
    for key in order:
        yield from _tar_sample(path, key, samples[key], version)


def _open_tar(path: Path | RemotePath) -> tarfile.TarFile:
    if isinstance(path, RemotePath):  # headers by range, through fsspec's read-ahead buffer
        return tarfile.open(fileobj=path.open("rb", block_size=1 << 20), mode="r:")
    return tarfile.open(path, "r:")


def _tar_sample(path: str, key: str, members: dict[str, tarfile.TarInfo], version: str = "") -> Iterator[Record]:
    for ext in _WDS_IMAGE_EXTS:
        if ext in members:
            m = members[ext]
            yield Record(key=key, source=f"{path}::{m.name}", kind="tar", path=path,
                         offset=m.offset_data, size=m.size, etag=version)
            return
    yield Record(key=key, source=f"{path}::{key}", kind="tar", path=path,
                 error=f"sample has no image member (has: {', '.join(sorted(members)) or 'nothing'})")


SKIPPED_NAMES = ("_SUCCESS",)
SKIPPED_SUFFIXES = (".crc",)


def _prefix_records(prefix: RemotePath) -> Iterator[Record]:
    """Every image object below ``prefix``: one paginated listing, in byte order (the order
    S3 lists in, and a local folder's sorted relative paths), folder markers, ``_SUCCESS``,
    ``.crc`` and hidden names skipped; the key is the relative name without its extension."""
    listed = prefix.files()
    for rel in sorted(listed, key=lambda n: n.encode("utf-8")):
        base = rel.rsplit("/", 1)[-1]
        if (rel.endswith("/") or base in SKIPPED_NAMES or base.endswith(SKIPPED_SUFFIXES)
                or any(part.startswith(".") for part in rel.split("/"))
                or not base.lower().endswith(IMAGE_EXTENSIONS)):
            continue
        url = str(prefix / rel)
        yield Record(key=rel.rsplit(".", 1)[0], source=url, kind="file", path=url,
                     etag=_version(listed[rel]))


def _parquet_records(pq_path: Path | RemotePath, image_column: str, key_column: str | None) -> Iterator[Record]:
    import pyarrow.parquet as pq

    path, version = _where(pq_path)
    try:
        pf = pq.ParquetFile(readable(pq_path))
    except Exception as exc:
        raise InputError(f"{pq_path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    names = pf.schema_arrow.names
    if image_column not in names:
        raise InputError(f"{pq_path}: no column {image_column!r} (columns: {', '.join(names)}); "
                         "name the image-bytes column with --image-column")
    if key_column and key_column not in names:
        raise InputError(f"{pq_path}: no column {key_column!r} for --key-column (columns: {', '.join(names)})")
    row = 0
    if key_column:
        for batch in pf.iter_batches(columns=[key_column], batch_size=65536):
            for value in batch.column(0).to_pylist():
                key = str(value) if value is not None else f"{pq_path.stem}/{row}"
                yield Record(key=key, source=f"{path}::row={row}", kind="parquet", path=path, offset=row,
                             etag=version)
                row += 1
    else:
        for row in range(pf.metadata.num_rows):
            yield Record(key=f"{pq_path.stem}/{row}", source=f"{path}::row={row}", kind="parquet",
                         path=path, offset=row, etag=version)


def expand_inputs(inputs: Iterable[str]) -> list[str]:
    """The INPUT arguments with braces and globs expanded; each must exist."""
    out = []
    for arg in inputs:
        for p in _expand(arg):
            if is_url(p):  # listed later: no request here, only whether its filesystem is installed
                require(p)
                out.append(p)
                continue
            p = local_of(p)
            if not os.path.exists(p):
                raise InputError(f"{p}: no such file or folder")
            out.append(p)
    if not out:
        raise InputError("no INPUT given")
    return out


def list_records(inputs: Iterable[str], image_column: str = "image",
                 key_column: str | None = None) -> list[Record]:
    """Every INPUT (already expanded) -> records in input order; duplicate keys become errors."""
    records: list[Record] = []
    seen: dict[str, str] = {}
    for arg in inputs:
        p = as_path(arg)
        name = p.name.lower()
        if isinstance(p, RemotePath) and not name.endswith(_FILE_KINDS):
            it: Iterable[Record] = _prefix_records(p)
        elif isinstance(p, RemotePath) and name.endswith(IMAGE_EXTENSIONS):
            it = [Record(key=p.stem, source=str(p), kind="file", path=str(p))]
        elif p.is_dir():
            it = _folder_records(p)
        elif name.endswith(".tar"):
            it = _tar_records(p)
        elif name.endswith((".tar.gz", ".tgz", ".tar.zst", ".tar.bz2", ".tar.xz")):
            raise InputError(f"{arg}: compressed tar shards cannot be read by offset; "
                             "WebDataset shards are plain .tar (images inside are already compressed)")
        elif name.endswith(".parquet"):
            it = _parquet_records(p, image_column, key_column)
        elif name.endswith(LIST_EXTENSIONS):
            it = _list_records(p)
        elif name.endswith(IMAGE_EXTENSIONS):
            it = [Record(key=p.name.rsplit(".", 1)[0], source=str(p.resolve()), kind="file",
                         path=str(p.resolve()))]
        else:
            raise InputError(f"{arg}: not a folder, image, list file (.txt/.lst), WebDataset .tar "
                             "or .parquet file")
        for rec in it:
            if not rec.error:
                if rec.key in seen:
                    rec = rec._replace(error=f"duplicate key (first seen at {seen[rec.key]})")
                else:
                    seen[rec.key] = rec.source
            records.append(rec)
    return records


# ---- reading bytes (runs in decode workers) ------------------------------------------------
class _ParquetRows:
    """Per decode process: the Parquet file last read (its metadata, row-group starts) and the
    image column of the row group last read. Records of a task are consecutive rows, so a
    task costs one footer read and one row-group read, not one per image."""

    def __init__(self):
        self.path: str | None = None
        self.file = None
        self.starts: list[int] = []
        self.group: tuple[int, str] | None = None
        self.values = None

    def value(self, path: str, row: int, image_column: str):
        import bisect

        import pyarrow.parquet as pq

        if path != self.path:
            self.file, self.path, self.group = pq.ParquetFile(readable(as_path(path))), path, None
            md = self.file.metadata
            self.starts = [0]
            for rg in range(md.num_row_groups):
                self.starts.append(self.starts[-1] + md.row_group(rg).num_rows)
        if not 0 <= row < self.starts[-1]:
            raise ValueError(f"row {row} is past the end of {path}")
        rg = bisect.bisect_right(self.starts, row) - 1
        if self.group != (rg, image_column):
            self.values = self.file.read_row_group(rg, columns=[image_column]).column(0)
            self.group = (rg, image_column)
        return self.values[row - self.starts[rg]].as_py()


_parquet_rows = _ParquetRows()


def read_image_source(rec: Record, image_column: str = "image") -> bytes | str:
    """A record -> encoded image bytes (or a file path Pillow opens). Raises OSError/ValueError."""
    if rec.kind == "file":
        return RemotePath(rec.path).read_bytes() if is_url(rec.path) else rec.path
    if rec.kind == "tar":
        if is_url(rec.path):  # one ranged GET
            data = RemotePath(rec.path).read_range(rec.offset, rec.size)
            if len(data) != rec.size:
                raise ValueError(f"tar member is truncated ({len(data)} of {rec.size} bytes)")
            return data
        with open(rec.path, "rb") as fh:
            fh.seek(rec.offset)
            data = fh.read(rec.size)
        if len(data) != rec.size:
            raise ValueError(f"tar member is truncated ({len(data)} of {rec.size} bytes)")
        return data
    if rec.kind == "parquet":
        value = _parquet_rows.value(rec.path, rec.offset, image_column)
        if isinstance(value, dict):  # Hugging Face datasets' Image feature: {bytes, path}
            if value.get("bytes"):
                value = value["bytes"]
            elif value.get("path"):
                return _beside(rec.path, value["path"])
        if value is None:
            raise ValueError(f"column {image_column!r} is null in this row")
        if isinstance(value, str):
            return _beside(rec.path, value)
        return bytes(value)
    raise ValueError(f"unknown record kind {rec.kind!r}")


def fetch_remote(records: Iterable[Record]) -> dict[int, bytes | Exception]:
    """The bytes of a task's remote image files and tar members, fetched concurrently (one GET
    each, all in flight together: one round trip per task, not per image), by record index;
    a failure is its exception, raised when that record is read."""
    by_scheme: dict[str, tuple[list, list]] = {}
    for i, rec in enumerate(records):
        if not rec.error and rec.kind in ("file", "tar") and is_url(rec.path):
            whole, ranged = by_scheme.setdefault(rec.path.split("://", 1)[0], ([], []))
            (whole if rec.kind == "file" else ranged).append((i, rec))
    out: dict[int, bytes | Exception] = {}
    for scheme, (whole, ranged) in by_scheme.items():
        fs = RemotePath(f"{scheme}://x").fs
        if whole:
            extra = {"max_concurrency": 1} if scheme == "s3" else {}  # one GET each, no HEAD first
            got = fs.cat([fs_path(r.path) for _, r in whole], on_error="return", **extra)
            for i, r in whole:
                value = got.get(fs_path(r.path))
                out[i] = value if isinstance(value, bytes | Exception) else OSError(f"{r.path}: not read")
        if ranged:
            got = fs.cat_ranges([fs_path(r.path) for _, r in ranged], [r.offset for _, r in ranged],
                                [r.offset + r.size for _, r in ranged], on_error="return")
            for (i, r), value in zip(ranged, got, strict=True):
                if isinstance(value, bytes) and len(value) != r.size:
                    value = ValueError(f"tar member is truncated ({len(value)} of {r.size} bytes)")
                out[i] = value
    return out


def _beside(container: str, name: str) -> bytes | str:
    """An image file named relative to the Parquet file holding its name."""
    if is_url(container):
        return (RemotePath(container).parent / name).read_bytes()
    return str(Path(container).parent / name)


def parse_source(source: str) -> Record:
    """A ``source`` string as stored in shards -> a Record that :func:`read_image_source` reads
    (used by ``vqserve verify`` to reopen a sample)."""
    if "::" in source:
        container, _, locator = source.rpartition("::")
        if container.lower().endswith(".parquet") and locator.startswith("row="):
            return Record(key="", source=source, kind="parquet", path=container, offset=int(locator[4:]))
        if container.lower().endswith(".tar"):
            with _open_tar(as_path(container)) as tar:
                m = tar.getmember(locator)
                return Record(key="", source=source, kind="tar", path=container,
                              offset=m.offset_data, size=m.size)
    return Record(key="", source=source, kind="file", path=source)
